#!/usr/bin/env bash
# Medusa-2 (heads trained jointly with a LoRA-adapted target, target.lora) against Medusa-1 (frozen target) on
# SmolLM2, for chained and parallel heads: the same distilled data and the same wall-clock of training, then the
# benchmark on MT-Bench's 80 first turns, and how far the adapted target moved (docs/results.md, "Medusa-2").
#
#   DATA=dir bash scripts/compare_medusa2.sh    # dir holds FastChat's MT-Bench question.jsonl (as mt_bench_question.jsonl)
#
# Medusa-1 is scripts/compare_kinds.sh's: 760 cached steps, ~5 minutes on 2 cores of an AMD EPYC. Medusa-2 spends the
# same five minutes as the paper's recipe does: the heads alone first (380 cached steps, half the time), then heads
# and adapters together from those heads (heads.init_from; a joint step runs the target forward with grad, its
# forward without the adapters for the KL term, and the backward through it: ~4.2 s against 0.31 s, so ~38 steps).
# Every stage resumes: finished ones are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the directory holding mt_bench_question.jsonl}"
WORK=${WORK:-runs/kinds}
HALF=${HALF:-380} JOINT=${JOINT:-38} RANK=${RANK:-16} LORA_LR=${LORA_LR:-1e-3} LM_WEIGHT=${LM_WEIGHT:-1.0}
MTBENCH="$DATA/mt_bench_question.jsonl"
T=$(python -m medusa_train.prepare)
mkdir -p "$WORK"
python -m medusa_train.distill recipes/smollm2-135m.yaml target.model="$T" target.dtype=bfloat16 --prompts default \
    --out "$WORK/distill-default.jsonl" --limit 256 --max-new-tokens 192 --batch-size 16 --exclude "$MTBENCH"
common=(recipes/smollm2-135m.yaml target.model="$T" data.dataset="$WORK/distill-default.jsonl" target.dtype=bfloat16
        heads.draft_vocab_size=4096 heads.context_layers=0 train.lr=3e-3 train.batch_size=4 data.max_length=384
        train.save_every=0 eval.max_batches=4 tracking.backend=none)
run() {  # name steps overrides...
    local out="$WORK/$1" steps=$2
    shift 2
    if [ -f "$out/acceptance.json" ]; then echo "$out already trained"; return; fi
    local t0=$SECONDS
    python -m medusa_train.cli "${common[@]}" train.max_steps="$steps" train.warmup_steps=$(( steps / 20 + 1 )) \
        eval.every="$steps" train.log_every=$(( steps / 10 + 1 )) output_dir="$out" "$@"
    echo "$(basename "$out"): $steps steps trained in $(( SECONDS - t0 )) s" | tee -a "$WORK/train-times.txt"
}
python -m inference.bench --target "$T" --methods ar --prompts "$MTBENCH" --max-new-tokens 128 \
    --replies "$WORK/replies-original.jsonl" --out "$WORK/results-mtbench80-original-ar.json"
for kind in chained parallel; do
    run "heads-$kind-$HALF" "$HALF" heads.kind="$kind"
    run "heads-$kind-medusa2" "$JOINT" heads.kind="$kind" heads.init_from="$WORK/heads-$kind-$HALF" \
        target.lora.r="$RANK" target.lora.alpha=$(( 2 * RANK )) target.lora.lr="$LORA_LR" loss.lm_weight="$LM_WEIGHT" \
        train.cache_hidden=false
    flag=--heads
    [ "$kind" = parallel ] && flag=--heads-parallel
    python -m inference.bench --target "$T" "$flag" "$WORK/heads-$kind-medusa2" --methods "ar,$kind" --prompts "$MTBENCH" --max-new-tokens 128 \
        --replies-against "$WORK/replies-original.jsonl" --out "$WORK/results-mtbench80-medusa2-$kind.json"
done
