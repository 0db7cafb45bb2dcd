#!/usr/bin/env bash
# Does distilling every assistant turn (`distill --turns all`) raise the tau of the second turn? (docs/results.md,
# "Every assistant turn".) SmolLM2 answers N two-turn conversations (scripts/multiturn_pool.py: the default pool's
# first turns, each with a follow-up request; greedy, so its first replies are the same in both sets); chained heads
# are trained, the same steps each, on the first turns only and on both turns; then our engine's tau on MT-Bench's
# first turns and on its second turns, each after SmolLM2's own reply to the first (`inference.bench --turn 2`).
#
#   DATA=dir bash scripts/turns_experiment.sh   # dir holds FastChat's MT-Bench question.jsonl (mt_bench_question.jsonl)
#
# ENGINE: extra distill flags (e.g. "--engine vllm --vllm-python PY"). Every stage resumes: finished ones are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the directory holding mt_bench_question.jsonl}"
WORK=${WORK:-runs/turns} N=${N:-128} STEPS=${STEPS:-160} LIMIT=${LIMIT:-40} DTYPE=${DTYPE:-float32}
ENGINE=${ENGINE:-} TOKENS=${TOKENS:-48}
MTBENCH="$DATA/mt_bench_question.jsonl"
T=$(python -m medusa_train.target.prepare)
mkdir -p "$WORK"
python scripts/multiturn_pool.py --n "$N" --out "$WORK/pool.json"
distill() {  # prompts out [flags]
    python -m medusa_train.data.distill recipes/smollm2-135m.yaml target.model="$T" target.dtype="$DTYPE" \
        data.max_length=384 --prompts "$1" --out "$2" --turns all --batch-size 32 $ENGINE ${3:-}
}
distill "$WORK/pool.json" "$WORK/turns-all.jsonl" "--exclude $MTBENCH"
python - "$WORK" <<'EOF'
import json, sys
work = sys.argv[1]
rows = [json.loads(line) for line in open(f"{work}/turns-all.jsonl", encoding="utf-8").read().split("\n") if line]
with open(f"{work}/turns-1.jsonl", "w", encoding="utf-8") as f:  # the same first replies, later turns dropped
    for r in rows:
        f.write(json.dumps(r | {"messages": r["messages"][:2]}, ensure_ascii=False) + "\n")
two = sum(len(r["messages"]) >= 4 for r in rows)
print(f"{len(rows)} conversations, {two} with the second turn answered")
EOF
distill "$MTBENCH" "$WORK/mtbench.jsonl" "--limit $LIMIT --max-new-tokens 256"  # SmolLM2's own first replies
for data in 1 all; do
    out="$WORK/heads-$data"
    [ -f "$out/acceptance.json" ] && { echo "heads-$data already trained"; continue; }
    python -m medusa_train.train.cli recipes/smollm2-135m.yaml target.model="$T" target.dtype="$DTYPE" \
        data.dataset="$WORK/turns-$data.jsonl" data.max_length=384 train.max_steps="$STEPS" train.batch_size=4 \
        train.lr=3e-3 train.warmup_steps=20 train.save_every=0 eval.every="$STEPS" eval.max_batches=4 \
        eval.tau_every=0 train.log_every=50 tracking.backend=none output_dir="$out"
done
for turn in 1 2; do
    for data in 1 all; do
        python -m inference.bench --target "$T" --heads "$WORK/heads-$data" --methods chained \
            --prompts "$WORK/mtbench.jsonl" --turn "$turn" --max-new-tokens "$TOKENS" --tree-budget 8 \
            --out "$WORK/tau-turn$turn-heads-$data.json"
    done
done
python - "$WORK" <<'EOF'
import json, sys
work = sys.argv[1]
print("| trained on | MT-Bench turn 1 tau | MT-Bench turn 2 tau |")
print("|---|---|---|")
for data in ("1", "all"):
    taus = [json.load(open(f"{work}/tau-turn{t}-heads-{data}.json"))["methods"]["chained"]["tau"] for t in (1, 2)]
    print(f"| first turns only ({data}) | {taus[0]:.3f} | {taus[1]:.3f} |")
EOF
