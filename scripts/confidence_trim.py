"""Our engine's calibrated trim reading a dspark drafter's confidence head, against the same heads with the head left
unread (each parent's best child then keyed by its own probability, as every other kind's), side by side: the engine
benchmark (`inference.bench`) run once each way, in both orders (this machine drifts between runs), each measuring its
own plain decoding.

    python scripts/confidence_trim.py --heads runs/kinds/heads-dspark --methods ar,dspark,dspark+ngram \\
        --prompts ../shared/data/mt_bench_question.jsonl --limit 12 --max-new-tokens 128 --out runs/confidence-trim

Every argument but --out goes to `inference.bench`; --out is a folder, holding one JSON a run (`with-1.json`,
`without-1.json`, `without-2.json`, `with-2.json`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import bench  # noqa: E402
from inference.engine import drafters  # noqa: E402


def main(argv: list[str]) -> int:
    if "--out" not in argv:
        print("--out FOLDER is required", file=sys.stderr)
        return 2
    i = argv.index("--out")
    out, args = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    out.mkdir(parents=True, exist_ok=True)
    read = drafters.HeadsDrafter.node_confidence
    for name, confidence in (("with-1", read), ("without-1", None), ("without-2", None), ("with-2", read)):
        drafters.HeadsDrafter.node_confidence = confidence or (lambda self, tree: None)
        print(f"== {name}: the confidence head {'read' if confidence else 'not read'}", flush=True)
        if bench.main(args + ["--out", str(out / f"{name}.json")]):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
