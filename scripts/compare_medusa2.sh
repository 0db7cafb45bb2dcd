#!/usr/bin/env bash
# Medusa-2 (heads trained jointly with a LoRA-adapted target, target.lora) against Medusa-1 (frozen target) on
# SmolLM2, for chained and parallel heads: the same distilled data and about the same wall-clock of training, then
# the benchmark on MT-Bench's 80 first turns and how far the adapted target moved (docs/results.md, "Medusa-2").
#
#   DATA=dir bash scripts/compare_medusa2.sh    # dir holds FastChat's MT-Bench question.jsonl (as mt_bench_question.jsonl)
#
# Medusa-1 is scripts/compare_kinds.sh's: 760 cached steps, ~5 minutes on 2 cores of an AMD EPYC. Medusa-2 spends
# those minutes as the paper's recipe does: the heads alone first (380 cached steps, about half), then heads and
# adapters together from those heads (heads.init_from). A joint step runs the target's forward with grad, its forward
# without the adapters for the KL term and the backward through it: ~4.5 s against 0.31 s, so 38 steps.
# Settings are loss.lm_weight:target.lora.lr pairs; every one is trained, those in BENCH_* also benchmarked (a
# benchmark takes ~15 minutes). Every stage resumes: finished ones are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the directory holding mt_bench_question.jsonl}"
WORK=${WORK:-runs/kinds}
HALF=${HALF:-380} JOINT=${JOINT:-38} RANK=${RANK:-16}
SETTINGS_chained=${SETTINGS_chained:-"10:1e-3 1:1e-3 10:2e-4 50:1e-3"} BENCH_chained=${BENCH_chained:-"10:1e-3 1:1e-3"}
SETTINGS_parallel=${SETTINGS_parallel:-"10:1e-3"} BENCH_parallel=${BENCH_parallel:-"10:1e-3"}
MTBENCH="$DATA/mt_bench_question.jsonl"
T=$(python -m medusa_train.target.prepare)
mkdir -p "$WORK"
python -m medusa_train.data.distill recipes/smollm2-135m.yaml target.model="$T" target.dtype=bfloat16 --prompts default \
    --out "$WORK/distill-default.jsonl" --limit 256 --max-new-tokens 192 --batch-size 16 --exclude "$MTBENCH"
common=(recipes/smollm2-135m.yaml target.model="$T" data.dataset="$WORK/distill-default.jsonl" target.dtype=bfloat16
        heads.draft_vocab_size=4096 heads.context_layers=0 train.lr=3e-3 train.batch_size=4 data.max_length=384
        train.save_every=0 eval.max_batches=4 eval.tau_every=0 tracking.backend=none)
run() {  # name steps overrides...
    local out="$WORK/$1" steps=$2
    shift 2
    if [ -f "$out/acceptance.json" ]; then echo "$out already trained"; return; fi
    local t0=$SECONDS
    python -m medusa_train.train.cli "${common[@]}" train.max_steps="$steps" train.warmup_steps=$(( steps / 20 + 1 )) \
        eval.every="$steps" train.log_every=$(( steps / 10 + 1 )) output_dir="$out" "$@"
    echo "$(basename "$out"): $steps steps trained in $(( SECONDS - t0 )) s" | tee -a "$WORK/train-times.txt"
}
bench() {  # out.json args...
    if [ -f "$1" ]; then echo "$1 already measured"; return; fi
    local out=$1
    shift
    python -m inference.bench --target "$T" --prompts "$MTBENCH" --max-new-tokens 128 --out "$out" "$@"
}
bench "$WORK/medusa2-original-target-ar-mtbench80.json" --methods ar --replies "$WORK/replies-original.jsonl"
for kind in chained parallel; do
    run "heads-$kind-$HALF" "$HALF" heads.kind="$kind"
    settings=SETTINGS_$kind benched=BENCH_$kind
    for s in ${!settings}; do
        w=${s%%:*} lr=${s##*:} name="heads-$kind-m2-w$w-lr$lr"
        run "$name" "$JOINT" heads.kind="$kind" heads.init_from="$WORK/heads-$kind-$HALF" target.lora.r="$RANK" \
            target.lora.alpha=$(( 2 * RANK )) target.lora.lr="$lr" loss.lm_weight="$w" train.cache_hidden=false
        if [[ " ${!benched} " == *" $s "* ]]; then
            bench "$WORK/medusa2-$kind-lmweight$w-lr$lr-mtbench80.json" --heads "$WORK/$name" --methods "ar,$kind" \
                --replies-against "$WORK/replies-original.jsonl"
        fi
    done
done
