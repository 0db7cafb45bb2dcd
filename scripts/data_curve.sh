#!/usr/bin/env bash
# Tau against rows the target wrote itself, on SmolLM2 (docs/results.md, "Data the target writes itself").
#   1. the target writes LIMIT requests from its user-turn prefix and answers the kept ones (bfloat16, replies up to
#      256 tokens, MT-Bench's prompts excluded); stop it with Ctrl-C once the file holds HELDOUT + the largest size
#      (rows are flushed per batch; rerunning the script continues where it stopped);
#   2. the first HELDOUT rows are held out; heads train on the next N rows for each N in SIZES, and on POOL rows of
#      the offline default pool (distilled the same way) for a like-for-like comparison; every run the same settings
#      (the main job's short-run heads: draft vocabulary 4096, no context layer, lr 3e-3; EPOCHS epochs);
#   3. each measured by scripts/data_curve.py: expected tau on the held-out rows, real tau on 80 MT-Bench first turns
#      (TOKENS new tokens each, heads alone, the static tree of 8 nodes).
# Usage: MT=path/to/mt_bench_question.jsonl bash scripts/data_curve.sh [WORKDIR]
#        (env: LIMIT=5000 HELDOUT=150 SIZES="256 600 1200" POOL=256 (0: none) EPOCHS=4 TOKENS=64)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-runs/self}
MT=${MT:?set MT to the MT-Bench question.jsonl (FastChat fastchat/llm_judge/data/mt_bench/question.jsonl)}
LIMIT=${LIMIT:-5000}; HELDOUT=${HELDOUT:-150}; SIZES=${SIZES:-256 600 1200}; POOL=${POOL:-256}; EPOCHS=${EPOCHS:-4}
TOKENS=${TOKENS:-64}
T=$(python -m medusa_train.target.prepare)
mkdir -p "$W"
distill() {
  python -m medusa_train.data.distill recipes/smollm2-135m.yaml target.model="$T" target.dtype=bfloat16 \
      --exclude "$MT" --max-new-tokens 256 --batch-size 32 "$@"
}
echo "=== [1/3] self-written requests and their replies -> $W/self.jsonl"
distill --prompts self --limit "$LIMIT" --latin-only --out "$W/self.jsonl" || [ $? = 75 ]  # 75: stopped, kept
if [ "$POOL" != 0 ]; then distill --prompts default --limit "$POOL" --out "$W/pool.jsonl"; fi

echo "=== [2/3] held-out rows and training slices; one run per slice"
python - "$W" "$HELDOUT" $SIZES <<'PY'
import sys
from pathlib import Path
w, held, sizes = Path(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
lines = (w / "self.jsonl").read_text().splitlines(keepends=True)
if len(lines) < held + max(sizes):
    sys.exit(f"error: {w}/self.jsonl holds {len(lines)} rows; {held} held out + {max(sizes)} need more: rerun")
(w / "heldout.jsonl").write_text("".join(lines[:held]))
for n in sizes:
    (w / f"train-self-{n}.jsonl").write_text("".join(lines[held:held + n]))
PY
runs=()
for data in $(for n in $SIZES; do echo "train-self-$n"; done) $([ "$POOL" != 0 ] && echo pool); do
  python train.py recipes/smollm2-135m.yaml target.model="$T" target.dtype=bfloat16 data.dataset="$W/$data.jsonl" \
      data.eval_size=0 heads.draft_vocab_size=4096 heads.context_layers=0 train.lr=3e-3 train.epochs="$EPOCHS" \
      train.save_every=0 eval.every=0 eval.tau_every=0 eval.max_batches=10 output_dir="$W/heads-$data" 2>&1 | tail -n 3
  runs+=("$W/heads-$data")
done

echo "=== [3/3] held-out expected tau and MT-Bench real tau, against the rows"
python scripts/data_curve.py "${runs[@]}" --heldout "$W/heldout.jsonl" --prompts "$MT" --limit 80 \
    --max-new-tokens "$TOKENS" \
    --out docs/results/self-data-curve.json --plot docs/results/self-data-curve.png
