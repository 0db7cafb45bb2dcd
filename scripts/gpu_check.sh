#!/usr/bin/env bash
# The GPU check in one command (scripts/gpu_check.py says what it runs): no download, no registry, under 10 minutes
# on one H100. Prints three tables and writes OUT/gpu-check.json; exit 1 if the engine was not exact in float64.
#
#   bash scripts/gpu_check.sh [OUT] [more flags of gpu_check.py]      # default OUT=runs/gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
shift || true
exec python scripts/gpu_check.py --out "$OUT" "$@"
