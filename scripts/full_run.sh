#!/usr/bin/env bash
# The documented full-length run on SmolLM2-135M-Instruct (2 CPU cores; README "Benchmark, full length").
# Unlike the main job it uses the public prompt and chat files in ../shared/data (never the benchmark's):
#   1. self-distill greedy replies to the shortest ShareGPT first prompts and Arena-Hard prompts
#      (MT-Bench excluded with --exclude; prompts over 256 tokens skipped; replies capped at 256 tokens);
#   2. add the offline default pool's replies (the main job's) and Alpaca's original answers (soft labels make
#      any assistant-style text useful: the target's own distribution is the label, not the written answer);
#   3. train chained and parallel heads on the same data, same lr and epochs, side by side (one thread each);
#   4. benchmark every method on MT-Bench first turns.
# Every stage resumes: distillation skips finished prompts, training resumes from its last checkpoint.
# Usage: bash scripts/full_run.sh [WORKDIR]   (sizes via env: SHAREGPT=640 ARENA=160 EPOCHS=2 BENCH_STRIDE=2)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-runs/full}; SHARED=${SHARED:-../shared/data}
SHAREGPT=${SHAREGPT:-640}; ARENA=${ARENA:-160}; EPOCHS=${EPOCHS:-2}; BENCH_STRIDE=${BENCH_STRIDE:-2}
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
python -m medusa_train.distill recipes/smollm2-135m.yaml target.model="$T" --prompts default \
    --out "$W/data/default.jsonl" --limit 208 --max-new-tokens 192 --batch-size 16

echo "=== [2/4] Alpaca original answers as chat rows (the first 96 prompts are distilled instead)"
python - "$SHARED/llamafactory_alpaca_en_demo.json" "$W/data" "$T" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
with open(f"{sys.argv[2]}/alpaca-prompts.jsonl", "w") as p, open(f"{sys.argv[2]}/alpaca-original.jsonl", "w") as o:
    for i, r in enumerate(rows):
        prompt = r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")
        if i < 96:
            p.write(json.dumps({"id": f"alpaca-{i}", "prompt": prompt}) + "\n")
        else:
            o.write(json.dumps({"id": f"alpaca-{i}", "messages": [
                {"role": "user", "content": prompt}, {"role": "assistant", "content": r["output"]}],
                "finish": "original"}) + "\n")
PY
python -m medusa_train.distill recipes/smollm2-135m.yaml target.model="$T" --prompts "$W/data/alpaca-prompts.jsonl" \
    --exclude "$MT" --out "$W/data/alpaca-distilled.jsonl" --max-new-tokens 192 --batch-size 16
mkdir -p "$W/train-data"
for f in sharegpt arena default alpaca-distilled alpaca-original; do cp "$W/data/$f.jsonl" "$W/train-data/"; done

echo "=== [3/4] train chained and parallel heads ($EPOCHS epochs each, side by side)"
tr() {  # $1 kind
  OMP_NUM_THREADS=1 python train.py recipes/smollm2-135m.yaml target.model="$T" data.dataset="$W/train-data" \
      heads.kind="$1" train.epochs="$EPOCHS" train.batch_size=8 train.save_every=50 eval.every=0 \
      output_dir="$W/heads-$1" > "$W/train-$1.log" 2>&1
}
tr chained & tr parallel & wait

echo "=== [4/4] benchmark on MT-Bench first turns (every ${BENCH_STRIDE}th prompt)"
python -m inference.bench --target "$T" --heads "$W/heads-chained" --heads-parallel "$W/heads-parallel" \
    --prompts "$MT" --stride "$BENCH_STRIDE" --max-new-tokens 128 --bigram-data "$W/train-data/sharegpt.jsonl" \
    --out "$W/results.json" --plot "$W/bench.png"
