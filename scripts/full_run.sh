#!/usr/bin/env bash
# The documented full-length run on SmolLM2-135M-Instruct (2 CPU cores; README "Benchmark, full length").
# Unlike the main job it uses the public prompt and chat files in ../shared/data (never the benchmark's):
#   1. self-distill greedy replies, in bfloat16 (2.2x the float32 throughput on a CPU with AVX512-BF16), to
#      ShareGPT first prompts, shortest first, in one process, and Arena-Hard then Alpaca prompts in another
#      (MT-Bench excluded with --exclude; prompts over 256 tokens skipped; replies capped at 256 tokens);
#   2. (optional) the offline default pool's replies;
#   3. train chained heads, then parallel heads on the same data, lr, steps and draft vocabulary, with the
#      target in bfloat16 (target.dtype: its forward and the vocabulary matmuls run on AMX; the heads and
#      their optimizer stay float32; 2.3x the float32 throughput, the same held-out tau); the parallel run
#      reads the chained run's hidden states (train.hidden_cache_dir) instead of running the target;
#   4. benchmark every method on MT-Bench first turns (every BENCH_STRIDE-th: a per-category sample).
# Every stage resumes: distillation skips finished prompts, training resumes from its last checkpoint.
# A draft vocabulary of 8192 (not the main job's 4096): on held-out self-distilled replies it covers 91.6% of
# the target's tokens against 86.3%, and a token outside it can never be drafted.
# Stop stage 1 whenever you like (Ctrl-C): rows are flushed per batch, and a rerun resumes.
# Usage: bash scripts/full_run.sh [WORKDIR]   (sizes via env: SHAREGPT=0 (all) ARENA=0 ALPACA=0 DEFAULT=0
#        EPOCHS=1 BENCH_STRIDE=2)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-runs/full}; SHARED=${SHARED:-../shared/data}
SHAREGPT=${SHAREGPT:-0}; ARENA=${ARENA:-0}; ALPACA=${ALPACA:-0}; DEFAULT=${DEFAULT:-0}
EPOCHS=${EPOCHS:-1}; BENCH_STRIDE=${BENCH_STRIDE:-2}
mkdir -p "$W/data"
T=$(python -m medusa_train.prepare)
MT=$SHARED/mt_bench_question.jsonl

echo "=== [1/4] self-distill (bfloat16): ShareGPT | Arena-Hard then Alpaca, one thread each"
python - "$SHARED/llamafactory_alpaca_en_demo.json" "$W/data/alpaca-prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[2], "w") as f:
    for i, r in enumerate(json.load(open(sys.argv[1]))):
        f.write(json.dumps({"id": f"alpaca-{i}", "prompt": r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")}) + "\n")
PY
d() {  # $1 pool file, $2 out, $3 limit (0: all)
  OMP_NUM_THREADS=1 python -m medusa_train.distill recipes/smollm2-135m.yaml target.model="$T" target.dtype=bfloat16 \
      --prompts "$1" --exclude "$MT" --out "$2" --order shortest --max-prompt-tokens 256 --max-new-tokens 256 \
      --batch-size 32 --limit "$3"
}
d "$SHARED/sharegpt_first_prompts_2978.json" "$W/data/sharegpt.jsonl" "$SHAREGPT" > "$W/distill-sharegpt.log" 2>&1 &
( d "$SHARED/arena_hard_v0.1_question.jsonl" "$W/data/arena.jsonl" "$ARENA"
  d "$W/data/alpaca-prompts.jsonl" "$W/data/alpaca.jsonl" "$ALPACA" ) > "$W/distill-other.log" 2>&1 &
wait

echo "=== [2/4] the default pool (optional: DEFAULT=N prompts)"
if [ "$DEFAULT" -gt 0 ]; then d default "$W/data/default.jsonl" "$DEFAULT"; fi
mkdir -p "$W/train-data"
for f in sharegpt arena alpaca default; do if [ -f "$W/data/$f.jsonl" ]; then cp "$W/data/$f.jsonl" "$W/train-data/"; fi; done

echo "=== [3/4] train chained heads, then parallel heads from the same hidden states ($EPOCHS epoch(s) each)"
for kind in chained parallel; do
  python train.py recipes/smollm2-135m.yaml target.model="$T" data.dataset="$W/train-data" heads.kind=$kind \
      heads.draft_vocab_size=8192 target.dtype=bfloat16 train.epochs="$EPOCHS" train.batch_size=4 train.save_every=50 eval.every=0 \
      train.hidden_cache_dir="$W/hidden" output_dir="$W/heads-$kind" 2>&1 | tee "$W/train-$kind.log"
done

echo "=== [4/4] benchmark on MT-Bench first turns (every ${BENCH_STRIDE}th prompt)"
python -m inference.bench --target "$T" --heads "$W/heads-chained" --heads-parallel "$W/heads-parallel" \
    --prompts "$MT" --stride "$BENCH_STRIDE" --max-new-tokens 128 \
    --out "$W/results.json" --plot "$W/bench.png"
