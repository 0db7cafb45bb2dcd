#!/usr/bin/env bash
# The documented full-length run on SmolLM2-135M-Instruct (2 CPU cores; README "Benchmark, full length").
# Unlike the main job it uses the public prompt and chat files in ../shared/data (never the benchmark's):
#   1. self-distill greedy replies to the shortest ShareGPT first prompts and Arena-Hard prompts
#      (MT-Bench excluded with --exclude; prompts over 256 tokens skipped; replies capped at 256 tokens);
#   2. add the offline default pool's replies (the main job's) and 96 Alpaca prompts' replies;
#   3. train chained heads, then parallel heads on the same data, lr, steps and draft vocabulary; the
#      parallel run reads the chained run's hidden states (train.hidden_cache_dir) instead of running the target;
#   4. benchmark every method on MT-Bench first turns (every BENCH_STRIDE-th: a per-category sample).
# Every stage resumes: distillation skips finished prompts, training resumes from its last checkpoint.
# A draft vocabulary of 8192 (not the main job's 4096): on held-out self-distilled replies it covers 91.6% of
# the target's tokens against 86.3%, and a token outside it can never be drafted.
# Usage: bash scripts/full_run.sh [WORKDIR]   (sizes via env: SHAREGPT=880 ARENA=260 EPOCHS=1 BENCH_STRIDE=2)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-runs/full}; SHARED=${SHARED:-../shared/data}
SHAREGPT=${SHAREGPT:-880}; ARENA=${ARENA:-260}; EPOCHS=${EPOCHS:-1}; BENCH_STRIDE=${BENCH_STRIDE:-2}
mkdir -p "$W/data"
T=$(python -m medusa_train.prepare)
MT=$SHARED/mt_bench_question.jsonl

echo "=== [1/4] self-distill ShareGPT ($SHAREGPT prompts) and Arena-Hard ($ARENA), one thread each"
d() {  # $1 pool file, $2 out, $3 limit
  OMP_NUM_THREADS=1 python -m medusa_train.distill recipes/smollm2-135m.yaml target.model="$T" --prompts "$1" \
      --exclude "$MT" --out "$2" --order shortest --max-prompt-tokens 256 --max-new-tokens 256 --batch-size 16 \
      --limit "$3"
}
d "$SHARED/sharegpt_first_prompts_2978.json" "$W/data/sharegpt.jsonl" "$SHAREGPT" > "$W/distill-sharegpt.log" 2>&1 &
d "$SHARED/arena_hard_v0.1_question.jsonl" "$W/data/arena.jsonl" "$ARENA" > "$W/distill-arena.log" 2>&1 &
wait

echo "=== [2/4] the default pool (as the main job) and 96 Alpaca prompts"
python -m medusa_train.distill recipes/smollm2-135m.yaml target.model="$T" --prompts default \
    --out "$W/data/default.jsonl" --limit 128 --max-new-tokens 192 --batch-size 16
python - "$SHARED/llamafactory_alpaca_en_demo.json" "$W/data/alpaca-prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[2], "w") as f:
    for i, r in enumerate(json.load(open(sys.argv[1]))[:96]):
        f.write(json.dumps({"id": f"alpaca-{i}", "prompt": r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")}) + "\n")
PY
python -m medusa_train.distill recipes/smollm2-135m.yaml target.model="$T" --prompts "$W/data/alpaca-prompts.jsonl" \
    --exclude "$MT" --out "$W/data/alpaca-distilled.jsonl" --max-new-tokens 192 --batch-size 16
mkdir -p "$W/train-data"
for f in sharegpt arena default alpaca-distilled; do cp "$W/data/$f.jsonl" "$W/train-data/"; done

echo "=== [3/4] train chained heads, then parallel heads from the same hidden states ($EPOCHS epoch(s) each)"
for kind in chained parallel; do
  python train.py recipes/smollm2-135m.yaml target.model="$T" data.dataset="$W/train-data" heads.kind=$kind \
      heads.draft_vocab_size=8192 train.epochs="$EPOCHS" train.batch_size=4 train.save_every=50 eval.every=0 \
      train.hidden_cache_dir="$W/hidden" output_dir="$W/heads-$kind" 2>&1 | tee "$W/train-$kind.log"
done

echo "=== [4/4] benchmark on MT-Bench first turns (every ${BENCH_STRIDE}th prompt)"
python -m inference.bench --target "$T" --heads "$W/heads-chained" --heads-parallel "$W/heads-parallel" \
    --prompts "$MT" --stride "$BENCH_STRIDE" --max-new-tokens 128 \
    --out "$W/results.json" --plot "$W/bench.png"
