"""How the requests a target wrote itself look: what each filter dropped, the length distribution, a rough category
mix and a sample, from the `OUT.requests` file that `distill --prompts self` keeps beside its output.

    python scripts/self_prompts_report.py runs/self/self.jsonl.requests --latin-only --sample 20

Categories are keyword rules (first match wins, in the order below), a rough guide and not a classifier.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from medusa_train.data.self_prompts import filter_prompts  # noqa: E402

CATEGORIES = [
    ("code", r"\b(code|python|javascript|java|c\+\+|sql|function|program|script|algorithm|html|css|api|debug)\b"),
    ("maths", r"\b(calculate|equation|solve|maths?|probability|percent|sum of|how many|integral|\d+\s*[x*+/-]\s*\d)"),
    ("writing", r"\b(write|story|poem|essay|letter|blog|article|email|script|lyrics|describe a scene|narrative)\b"),
    ("advice", r"\b(should i|how can i|how do i|tips|advice|help me|recommend|suggest|best way|improve)\b"),
    ("explain", r"\b(what is|what are|explain|why do|why is|how does|how do|difference between|define|meaning)\b"),
    ("summarise / edit", r"\b(summar|rewrite|paraphrase|translate|edit|proofread|shorten|list)\w*"),
]


def category(text: str) -> str:
    low = text.lower()
    return next((name for name, rule in CATEGORIES if re.search(rule, low)), "other")


def quantiles(xs: list[int]) -> dict[str, int]:
    xs = sorted(xs)
    return {f"p{q}": xs[min(len(xs) - 1, int(q / 100 * len(xs)))] for q in (10, 25, 50, 75, 90)} | {"max": xs[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("requests", type=Path, help="OUT.requests, beside distill --prompts self's output")
    p.add_argument("--latin-only", action="store_true", help="as the distill run had it")
    p.add_argument("--sample", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the report as JSON too")
    args = p.parse_args()
    rows = [json.loads(line) for line in args.requests.read_text().splitlines() if line.strip()]
    samples = [(r["text"], bool(r["finished"])) for r in sorted(rows, key=lambda r: r["id"])]
    verdict = filter_prompts(samples, latin_only=args.latin_only)
    kept = [samples[i][0] for i in verdict.kept]
    words = [len(t.split()) for t in kept]
    mix: dict[str, int] = {}
    for t in kept:
        mix[category(t)] = mix.get(category(t), 0) + 1
    report = {"drawn": len(samples), "kept": len(kept), "dropped": verdict.dropped, "words": quantiles(words),
              "mix": dict(sorted(mix.items(), key=lambda kv: -kv[1])),
              "sample": random.Random(args.seed).sample(kept, min(args.sample, len(kept)))}
    print(f"drawn {report['drawn']}, kept {report['kept']} ({100 * len(kept) / len(samples):.0f}%); dropped: "
          + ", ".join(f"{k} {v}" for k, v in verdict.dropped.items() if k != "excluded"))
    print("words per kept request: " + ", ".join(f"{k} {v}" for k, v in report["words"].items()))
    print("category mix: " + ", ".join(f"{k} {100 * v / len(kept):.0f}%" for k, v in report["mix"].items()))
    for i, t in enumerate(report["sample"], 1):
        print(f"{i:>2}. {' '.join(t.split())}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
