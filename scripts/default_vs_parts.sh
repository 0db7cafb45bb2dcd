#!/usr/bin/env bash
# The default against its parts, side by side in one run per prompt set: plain decoding (ar), transformers' prompt
# lookup (pld), our n-gram lookup (ngram), the heads alone (chained) and the default (chained+ngram: the heads with
# lookup grafted on), greedy and exact-checked, on five kinds of prompts: chat (MT-Bench), math (GSM8K),
# instructions (Alpaca), hard chat (Arena-Hard) and ShareGPT first turns. The files are the public ones in
# ../shared/data (its README gives their sources); the project ships none of them.
#
#   DATA=../shared/data HEADS=runs/demo/heads-chained bash scripts/default_vs_parts.sh [extra bench arguments]
#
# Writes OUT/<set>.json per prompt set (`inference.bench`'s JSON) and OUT/summary.md: speedup over ar (tau) per
# method and set. LIMIT prompts per set (default 8), 128 new tokens, float32, the auto tree budget; SETS picks the
# prompt files.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA to the folder holding the public prompt files (e.g. ../shared/data)}
HEADS=${HEADS:-runs/demo/heads-chained}
OUT=${OUT:-runs/default-vs-parts}
LIMIT=${LIMIT:-8}
mkdir -p "$OUT"
SETS=${SETS:-"mt_bench_question.jsonl gsm8k_train.jsonl llamafactory_alpaca_en_demo.json arena_hard_v0.1_question.jsonl
sharegpt_first_prompts_2978.json"}
for set in $SETS; do
  name=${set%%.*}
  echo "=== $name"
  # a set the target cannot take (no prompt fits its context) is said and left out of the summary
  python -m inference.bench --heads "$HEADS" --prompts "$DATA/$set" --limit "$LIMIT" --max-new-tokens 128 \
      --methods ar,pld,ngram,chained,chained+ngram --out "$OUT/$name.json" "$@" || echo "=== $name: left out"
done
python - "$OUT" $SETS <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
sets = [s.split(".")[0] for s in sys.argv[2:] if (out / f"{s.split('.')[0]}.json").is_file()]
results = {s: json.loads((out / f"{s}.json").read_text()) for s in sets}
methods = list(next(iter(results.values()))["methods"])
lines = ["| method | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
for m in methods:
    cells = []
    for s in sets:
        r = results[s]["methods"][m]
        cells.append(f"{r['speedup']:.2f}x ({r['tau']:.2f})" + ("" if r["exact_match"] else " NOT EXACT"))
    lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
machine = next(iter(results.values()))["machine"]
text = f"speedup over ar (tau), {machine}\n\n" + "\n".join(lines) + "\n"
(out / "summary.md").write_text(text)
print(text)
PY
