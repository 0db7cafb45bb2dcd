#!/usr/bin/env bash
# loss.tv_weight on chained and eagle3 heads: the recipe's KL against DSpark's objective (TV 0.9 + CE 0.1), same data,
# same steps; held-out expected tau from the final evaluation (docs/results.md, "The dspark kind").
#
#   bash scripts/tv_vs_kl.sh    # after scripts/compare_kinds.sh wrote runs/kinds/distill-default.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
T=$(python -m medusa_train.target.prepare)
for kind in chained eagle3; do
  steps=$([ $kind = chained ] && echo 200 || echo 80)
  for obj in kl tv; do
    out=${WORK:-runs/tv}/$kind-$obj
    [ -f $out/acceptance.json ] && continue
    loss=$([ $obj = kl ] && echo "" || echo "loss.distill_weight=0 loss.ce_weight=0.1 loss.tv_weight=0.9")
    t0=$SECONDS
    python -m medusa_train.train.cli recipes/smollm2-135m.yaml target.model="$T" data.dataset=runs/kinds/distill-default.jsonl \
      target.dtype=float32 heads.kind=$kind train.max_steps=$steps heads.draft_vocab_size=4096 heads.context_layers=0 \
      train.lr=3e-3 train.batch_size=4 data.max_length=384 train.warmup_steps=$((steps/20)) train.save_every=0 \
      eval.every=$steps eval.max_batches=4 eval.tau_every=0 train.log_every=$((steps/10)) tracking.backend=none \
      $( [ $kind = eagle3 ] && echo heads.norms=auto ) output_dir=$out $loss 2>&1 | grep -E "expected tau|error" || true
    echo "$kind $obj: $steps steps in $((SECONDS - t0)) s"
  done
done
