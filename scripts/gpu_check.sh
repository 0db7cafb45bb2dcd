#!/usr/bin/env bash
# The GPU check in one command (scripts/gpu_check.py says what it runs): no download on the GPU machine, under 10
# minutes on one H100. Prints four tables and writes OUT/gpu-check.json; exit 1 if the engine was not exact in float64.
#
#   bash scripts/gpu_check.sh [OUT] [more flags of gpu_check.py]      # default OUT=runs/gpu-check
#
# The launch part needs `datasets`, which a GPU machine without a registry lacks: run this script once where pip
# reaches one (it fetches the three pure-Python wheels into runs/wheels, < 1 MB), then carry runs/wheels along.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
shift || true
WHEELS=runs/wheels
if ! python -c "import datasets" 2>/dev/null && ! ls "$WHEELS"/datasets-*.whl >/dev/null 2>&1; then
    pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" datasets dill multiprocess \
        2>/dev/null || echo "(no registry here: the launch part needs runs/wheels from a machine with one)" >&2
fi
exec python scripts/gpu_check.py --out "$OUT" --wheels "$WHEELS" "$@"
