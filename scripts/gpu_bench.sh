#!/usr/bin/env bash
# The engine on a GPU, in one command: the oracle benchmark (every drafted token accepted, so what is measured is
# the engine) on random-weight targets shaped like SmolLM2-135M and Llama-3.1-8B, bfloat16, eager and compiled
# (`--compile`: static cache, the verify compiled per tree size and replayed as a CUDA graph), against plain
# `generate` eager and compiled (transformers' static cache + torch.compile, what a user would pick instead).
# Needs no download and no trained heads. Writes OUT/oracle-*.json and prints each table.
#
#   bash scripts/gpu_bench.sh [OUT]          # default OUT=runs/gpu
#
# The first compiled call at each tree size compiles (tens of seconds per size for the 8B shape); the timed
# generations follow a warm-up.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu}
mkdir -p "$OUT"
for shape in smollm2 llama-8b; do
    python -m inference.oracle --shape "$shape" --device cuda --dtype bfloat16 --budgets 1,2,4,8,16 --limit 4 \
        --max-new-tokens 128 --out "$OUT/oracle-$shape-eager.json"
    python -m inference.oracle --shape "$shape" --device cuda --dtype bfloat16 --budgets 1,2,4,8,16 --limit 4 \
        --max-new-tokens 128 --compile --out "$OUT/oracle-$shape-compiled.json"
done
