"""A two-turn prompt pool for the `distill --turns` experiment (docs/results.md, "Every assistant turn"): the offline
default pool's first turns, each followed by one of a fixed list of follow-up requests of the kinds chat users send
(shorter, simpler, another form, an example, a critique), as ShareGPT rows. Written here, deterministic, and disjoint
from MT-Bench, whose second turns the experiment benchmarks.

    python scripts/multiturn_pool.py --n 256 --out runs/turns/pool.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FOLLOW_UPS = [
    "Can you make that answer about half as long?",
    "Explain the same thing again for a ten-year-old.",
    "Turn your answer into a bulleted list.",
    "Give me one concrete example of what you described.",
    "What is the weakest point of your answer, and how would you fix it?",
    "Now write the main idea as a short poem.",
    "Summarize your answer in a single sentence.",
    "Rewrite your answer in a more formal tone.",
    "What would someone who disagrees with you say?",
    "Add a short conclusion that ties everything together.",
    "Which part of your answer is most important, and why?",
    "Rewrite it as a short dialogue between two friends.",
    "Suggest three follow-up questions I could ask about this.",
    "Can you check your answer for mistakes and correct them?",
    "Write a catchy title for your answer.",
    "Explain the same idea using an analogy from cooking.",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256, help="conversations (the default pool's first N prompts)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from medusa_train.data.prompts import default_prompts

    rows = [{"id": f"mt-{pid}", "conversations": [{"from": "human", "value": text},
                                                    {"from": "human", "value": FOLLOW_UPS[i % len(FOLLOW_UPS)]}]}
            for i, (pid, text) in enumerate(default_prompts("train")[:args.n])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} two-turn conversations in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
