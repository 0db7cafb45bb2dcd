#!/usr/bin/env bash
# The engine on a small, fast target (docs/results.md, "Engine overhead"): build a 12.6M-parameter Qwen2-style
# chat model from scratch on GSM8K (scripts/small_target.py), self-distill its replies to 1,000 of its training
# questions, train chained heads on them, then benchmark on 32 held-out questions it never saw, with the oracle
# and the step profiler beside it.
#
#   DATA=dir bash scripts/small_target.sh      # dir holds GSM8K's train split as gsm8k_train.jsonl
#
# About 40 minutes on 2 cores. Every stage resumes: finished ones are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the directory holding gsm8k_train.jsonl}"
WORK=${WORK:-runs/small}
T="$WORK/model"
[ -f "$T/config.json" ] || python scripts/small_target.py --data "$DATA/gsm8k_train.jsonl" --out "$WORK" --minutes 12
python -m medusa_train.data.distill recipes/smollm2-135m.yaml target.model="$T" --prompts "$WORK/train-prompts.jsonl" \
    --out "$WORK/distill.jsonl" --limit 1000 --max-new-tokens 160 --batch-size 16
if [ ! -f "$WORK/heads-chained/acceptance.json" ]; then
    python -m medusa_train.train.cli recipes/smollm2-135m.yaml target.model="$T" data.dataset="$WORK/distill.jsonl" \
        heads.context_layers=0 train.lr=3e-3 train.max_steps=240 train.batch_size=4 \
        data.max_length=384 train.save_every=0 eval.every=0 eval.tau_every=0 tracking.backend=none output_dir="$WORK/heads-chained"
fi
python -m inference.bench --target "$T" --heads "$WORK/heads-chained" --methods ar,pld,ngram,chained,chained+ngram \
    --prompts "$WORK/heldout-prompts.jsonl" --limit 32 --max-new-tokens 128 --out "$WORK/small-target-gsm8k32.json"
python -m inference.oracle --target "$T" --prompts "$WORK/heldout-prompts.jsonl" --limit 4 --budgets 1,2,4,8 \
    --out "$WORK/oracle-small-target-gsm8k4.json"
python -m inference.profile_step --target "$T" --heads "$WORK/heads-chained" --prompts "$WORK/heldout-prompts.jsonl" \
    --limit 8 --lookup-nodes 0 --budget 4 8 auto
