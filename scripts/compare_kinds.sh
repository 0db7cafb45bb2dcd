#!/usr/bin/env bash
# eagle3, dflash and dspark against chained and parallel heads: the same distilled data, the same wall-clock of training, then
# the benchmark on MT-Bench's first turns (LIMIT of them; 0: all 80) at the auto budget and at 8 nodes (docs/results.md,
# "Head kinds", "The dflash kind").
#
#   DATA=dir bash scripts/compare_kinds.sh     # dir holds FastChat's MT-Bench question.jsonl (as mt_bench_question.jsonl)
#
# Steps per kind give each about five minutes on 2 cores of an AMD EPYC (bfloat16 target): a cached chained or
# parallel step takes 0.31 s, an eagle3 step 1.07 s, and the first epoch adds the target's forward (~1 s a step);
# scripts/profile_train_step.py measures them on another machine. Every stage resumes: finished ones are skipped.
# NORMS: eagle3's heads.norms; [] (the default here) is the layer the documented run had, before eagle3 defaulted to
# two of EAGLE-3.1's norms; NORMS=auto trains today's default.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the directory holding mt_bench_question.jsonl}"
WORK=${WORK:-runs/kinds}
STEPS_CHAINED=${STEPS_CHAINED:-760} STEPS_PARALLEL=${STEPS_PARALLEL:-760} STEPS_EAGLE3=${STEPS_EAGLE3:-220}
STEPS_DFLASH=${STEPS_DFLASH:-260}  # 0.67 s a step on 2 Xeon (AMX) cores, where eagle3's takes 0.78 and chained 0.23
STEPS_DSPARK=${STEPS_DSPARK:-$STEPS_DFLASH}  # set it from scripts/profile_train_step.py for equal minutes
KINDS=${KINDS:-chained parallel eagle3 dflash dspark} LIMIT=${LIMIT:-0}
NORMS=${NORMS:-[]}
PROMPTS=${PROMPTS:-256}  # default-pool prompts distilled (SmolLM2's replies, up to 192 tokens each)
DTYPE=${DTYPE:-bfloat16}  # the target's dtype in distillation and training: float32 on a CPU without AVX512-BF16/AMX
DFLASH=${DFLASH:-heads.num_heads=7 heads.layers_per_head=2}  # a block of 8, two decoder layers
# the same block plus the Markov head (rank 256) and the confidence head, on DSpark's objective (the recipe's KL off)
DSPARK=${DSPARK:-"$DFLASH loss.distill_weight=0 loss.ce_weight=0.1 loss.tv_weight=0.9"}
MTBENCH="$DATA/mt_bench_question.jsonl"
T=$(python -m medusa_train.target.prepare)
mkdir -p "$WORK"
python -m medusa_train.data.distill recipes/smollm2-135m.yaml target.model="$T" target.dtype="$DTYPE" --prompts default \
    --out "$WORK/distill-default.jsonl" --limit "$PROMPTS" --max-new-tokens 192 --batch-size 16 --exclude "$MTBENCH"
train() {  # kind steps [overrides]
    local out="$WORK/heads-$1"
    if [ -f "$out/acceptance.json" ]; then echo "$1 heads already in $out"; return; fi
    local t0=$SECONDS
    python -m medusa_train.train.cli recipes/smollm2-135m.yaml target.model="$T" data.dataset="$WORK/distill-default.jsonl" \
        target.dtype="$DTYPE" heads.kind="$1" train.max_steps="$2" heads.draft_vocab_size=4096 heads.context_layers=0 \
        train.lr=3e-3 train.batch_size=4 data.max_length=384 train.warmup_steps=$(( $2 / 20 )) train.save_every=0 \
        eval.every="$2" eval.max_batches=4 eval.tau_every=0 train.log_every=$(( $2 / 20 )) tracking.backend=none \
        output_dir="$out" ${3:-}
    echo "$1: $2 steps trained in $(( SECONDS - t0 )) s" | tee -a "$WORK/train-times.txt"
}
heads=() methods=ar
for kind in $KINDS; do
    case $kind in
        chained) train chained "$STEPS_CHAINED"; heads+=(--heads "$WORK/heads-chained") ;;
        parallel) train parallel "$STEPS_PARALLEL"; heads+=(--heads "$WORK/heads-parallel") ;;
        eagle3) train eagle3 "$STEPS_EAGLE3" "heads.norms=$NORMS"; heads+=(--heads "$WORK/heads-eagle3") ;;
        dflash) train dflash "$STEPS_DFLASH" "$DFLASH"; heads+=(--heads "$WORK/heads-dflash") ;;
        dspark) train dspark "$STEPS_DSPARK" "$DSPARK"; heads+=(--heads "$WORK/heads-dspark") ;;
    esac
    methods+=",$kind"
done
n=$([ "$LIMIT" = 0 ] && echo 80 || echo "$LIMIT")
for budget in auto 8; do
    name=$budget
    [ "$budget" = auto ] || name="budget$budget"
    python -m inference.bench --target "$T" "${heads[@]}" --methods "$methods" --prompts "$MTBENCH" --limit "$LIMIT" \
        --max-new-tokens 128 --tree-budget "$budget" --out "$WORK/head-kinds-mtbench$n-$name.json" \
        --plot "$WORK/head-kinds-mtbench$n-$name.png"
done
