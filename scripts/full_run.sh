#!/usr/bin/env bash
# The full-length run of recipes/smollm2-135m.yaml on 2 CPU cores, in one go (docs/results.md, "Full length").
# It reads public prompt files from DATA (a directory you fill; the project ships none of them), by these names:
#   mt_bench_question.jsonl            FastChat  fastchat/llm_judge/data/mt_bench/question.jsonl  (benchmark; excluded)
#   sharegpt_first_prompts_2978.json   ml-energy/leaderboard-v2  sharegpt/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json
#   arena_hard_v0.1_question.jsonl     lmarena/arena-hard-auto  data/arena-hard-v0.1/question.jsonl
#   llamafactory_alpaca_en_demo.json   hiyouga/LLaMA-Factory  data/alpaca_en_demo.json
#   gsm8k_train.jsonl                  openai/grade-school-math  grade_school_math/data/train.jsonl
# Stages:
#   1. self-distill SmolLM2's greedy replies, in bfloat16 (2.2x the float32 throughput on a CPU with AMX or
#      AVX512-BF16), MT-Bench excluded (--exclude), replies capped at 256 tokens, two processes of one thread:
#      ShareGPT first prompts (shortest first, up to 768 prompt tokens, 2,700 of them) in one; Arena-Hard and
#      Alpaca (shortest first, up to 256 tokens), the first 600 GSM8K questions and 1,300 prompts of the offline
#      default pool in the other. About 6,000 conversations, 1.56M tokens, about 90 minutes;
#   2. train chained heads (the recipe: one context-encoder layer, draft vocabulary 8192, weight decay 0.1), then
#      parallel (Medusa-1) heads on the same data, the target in bfloat16; the target's hidden states are computed
#      once (train.hidden_cache_dir) and both runs read them. Measured 2026-11-25: the chained heads in 1 h 45 min;
#   3. benchmark every method on MT-Bench first turns (every BENCH_STRIDE-th: 1 = all 80, the documented run).
# Every stage resumes: distillation skips finished prompts, training resumes from its last checkpoint. Stop stage
# 1 whenever you like (Ctrl-C): rows are flushed per batch.
# Usage: DATA=path/to/prompt/files bash scripts/full_run.sh [WORKDIR]   (sizes via env: SHAREGPT=2700 ARENA=0
#        ALPACA=0 GSM8K=600 DEFAULT=1300 (0: all of a pool) EPOCHS=6 BENCH_STRIDE=1)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-runs/full}
SHARED=${DATA:?set DATA to the directory holding the prompt files listed at the top of this script}
SHAREGPT=${SHAREGPT:-2700}; ARENA=${ARENA:-0}; ALPACA=${ALPACA:-0}; GSM8K=${GSM8K:-600}; DEFAULT=${DEFAULT:-1300}
EPOCHS=${EPOCHS:-6}; BENCH_STRIDE=${BENCH_STRIDE:-1}
mkdir -p "$W/data"
T=$(python -m medusa_train.target.prepare)
MT=$SHARED/mt_bench_question.jsonl

echo "=== [1/3] self-distill (bfloat16): ShareGPT | Arena-Hard, Alpaca, GSM8K, default pool; one thread each"
python - "$SHARED/llamafactory_alpaca_en_demo.json" "$W/alpaca-prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[2], "w") as f:
    for i, r in enumerate(json.load(open(sys.argv[1]))):
        f.write(json.dumps({"id": f"alpaca-{i}", "prompt": r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")}) + "\n")
PY
d() {  # $1 pool, $2 out, $3 limit (0: all), $4 max prompt tokens, $5 batch size, $6 order (default shortest)
  OMP_NUM_THREADS=1 python -m medusa_train.data.distill recipes/smollm2-135m.yaml target.model="$T" target.dtype=bfloat16 \
      --prompts "$1" --exclude "$MT" --out "$2" --order "${6:-shortest}" --max-prompt-tokens "$4" --max-new-tokens 256 \
      --batch-size "$5" --limit "$3"
}
d "$SHARED/sharegpt_first_prompts_2978.json" "$W/data/sharegpt.jsonl" "$SHAREGPT" 768 16 > "$W/distill-sharegpt.log" 2>&1 &
( d "$SHARED/arena_hard_v0.1_question.jsonl" "$W/data/arena.jsonl" "$ARENA" 256 32
  d "$W/alpaca-prompts.jsonl" "$W/data/alpaca.jsonl" "$ALPACA" 256 32
  d "$SHARED/gsm8k_train.jsonl" "$W/data/gsm8k.jsonl" "$GSM8K" 256 32 file
  d default "$W/data/default.jsonl" "$DEFAULT" 256 32 file ) > "$W/distill-other.log" 2>&1 &
wait

echo "=== [2/3] train chained heads, then parallel heads from the same hidden states ($EPOCHS epoch(s) each)"
for kind in chained parallel; do
  ctx=0; if [ $kind = chained ]; then ctx=1; fi   # the recipe's settings; Medusa-1 has no context encoder
  python train.py recipes/smollm2-135m.yaml target.model="$T" data.dataset="$W/data" heads.kind=$kind \
      heads.context_layers=$ctx target.dtype=bfloat16 train.epochs="$EPOCHS" train.save_every=200 eval.every=0 eval.tau_every=0 \
      train.hidden_cache_dir="$W/hidden" output_dir="$W/heads-$kind" 2>&1 | tee "$W/train-$kind.log"
done

echo "=== [3/3] benchmark on MT-Bench first turns (every ${BENCH_STRIDE}th prompt)"
python -m inference.bench --target "$T" --heads "$W/heads-chained" "$W/heads-parallel" \
    --prompts "$MT" --stride "$BENCH_STRIDE" --max-new-tokens 128 \
    --out "$W/results.json" --plot "$W/bench.png"
