#!/usr/bin/env bash
# A venv holding the `speculators` package (0.9.0), the reference EAGLE-3 trainer, on a machine without a GPU: pip is
# held to the CPU build of torch (a plain install pulls a CUDA one) and the torchvision and torchaudio it brings go,
# since a text drafter needs neither. About 2 minutes and 1.5 GB. scripts/vs_speculators.sh trains with it.
#
#   bash scripts/speculators_venv.sh ~/speculators
#   ~/speculators/bin/python -c "import speculators; print(speculators.__version__)"
set -euo pipefail
VENV=${1:?usage: bash scripts/speculators_venv.sh DIR}
VERSION=${SPECULATORS_VERSION:-0.9.0}
STAGE="$VENV.staging"
rm -rf "$STAGE"
python3 -m venv "$STAGE"
"$STAGE/bin/python" -m pip install -q --disable-pip-version-check \
    -c <(echo "torch==2.13.0") "speculators==$VERSION" "torchvision==0.28.0"
"$STAGE/bin/python" -m pip uninstall -q -y torchvision torchaudio
"$STAGE/bin/python" -c "import speculators.train.cli"
rm -rf "$VENV"
mv "$STAGE" "$VENV"
echo "$VENV"
