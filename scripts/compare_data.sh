#!/usr/bin/env bash
# Self-distilled replies vs the original answers, same prompts, same training budget: which heads accept more?
# Prompts: the first N rows of LLaMA-Factory's data/alpaca_en_demo.json (instruction + input -> output). Scored by
# real tau with the engine on MT-Bench first turns (never trained on). DATA names the directory holding both files
# under the names scripts/full_run.sh lists. Usage: DATA=dir bash scripts/compare_data.sh [N] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-128}; STEPS=${2:-120}
SHARED=${DATA:?set DATA to the directory holding the prompt files (see scripts/full_run.sh)}
W=runs/compare-data; mkdir -p $W
T=$(python -m medusa_train.target.prepare)
python - "$SHARED/llamafactory_alpaca_en_demo.json" "$N" "$W" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))[:int(sys.argv[2])]
with open(f"{sys.argv[3]}/prompts.jsonl", "w") as p, open(f"{sys.argv[3]}/original.jsonl", "w") as o:
    for i, r in enumerate(rows):
        prompt = r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")
        p.write(json.dumps({"id": f"alpaca-{i}", "prompt": prompt}) + "\n")
        o.write(json.dumps({"id": f"alpaca-{i}", "messages": [{"role": "user", "content": prompt},
                                                               {"role": "assistant", "content": r["output"]}]}) + "\n")
PY
python -m medusa_train.data.distill recipes/smollm2-135m.yaml target.model=$T --prompts $W/prompts.jsonl \
    --out $W/distilled.jsonl --max-new-tokens 192 --batch-size 16 --exclude $SHARED/mt_bench_question.jsonl
for src in distilled original; do
  [ -f $W/heads-$src/acceptance.json ] || python train.py recipes/smollm2-135m.yaml target.model=$T \
      data.dataset=$W/$src.jsonl heads.draft_vocab_size=4096 heads.context_layers=0 train.lr=3e-3 \
      data.max_length=384 train.batch_size=4 train.max_steps=$STEPS train.warmup_steps=6 \
      train.save_every=0 eval.every=0 eval.tau_every=0 tracking.backend=none resume=none output_dir=$W/heads-$src
done
for src in distilled original; do
  python -m inference.bench --target $T --heads $W/heads-$src --methods chained --prompts $SHARED/mt_bench_question.jsonl \
      --limit 8 --max-new-tokens 128 --tree-budget 8 --out $W/bench-$src.json
done
python - $W <<'PY'
import json, sys
for src in ("distilled", "original"):
    acc = json.load(open(f"{sys.argv[1]}/heads-{src}/acceptance.json"))
    b = json.load(open(f"{sys.argv[1]}/bench-{src}.json"))["methods"]["chained"]
    print(f"{src:10s} expected chain tau (held-out split of its own data) {acc['expected_tau']:.3f}   "
          f"real tau on MT-Bench {b['tau']:.3f}   exact {b['exact_match']}")
PY
