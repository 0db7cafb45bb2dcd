"""What the hidden-state cache costs a process's memory: rows of random states pass through `TargetStates` as a
training epoch passes them (batches of 4), first computed, then, in a fresh process as the next epoch or another
process would, read back. Reported: the growth of the process's anonymous resident memory (RssAnon: what the page
cache cannot take back) over the run, against the bytes of the rows.

    python scripts/cache_memory.py --rows 2000 --length 256 --width 576 --out docs/results/cache-memory.json

Modes: `memory` (train.cache_hidden with one process: every row kept in memory), `disk-write` and `disk-read`
(train.hidden_cache_dir, or cache_hidden under several processes: shards memory-mapped).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def one(mode: str, rows: int, length: int, width: int, directory: str) -> dict:
    """In the child: every row through the cache once; the peak growth of RssAnon."""
    sys.path.insert(0, str(ROOT))
    import torch
    from torch import nn

    from medusa_train.target.states import TargetStates

    class Target(nn.Module):  # stands for a frozen target: its "hidden states" are a fixed function of the ids
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(width, 64, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    class States(TargetStates):
        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            g = torch.Generator().manual_seed(int(ids[0, 0]))
            return torch.randn(*ids.shape, width, generator=g)

    target = Target()
    states = States(target, target.head, cache=True, directory=None if mode == "memory" else directory)
    base = peak = rss_anon()
    for start in range(0, rows, 4):
        ids = torch.arange(start, start + 4)[:, None] * 100_000 + torch.arange(length)[None]
        states({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        peak = max(peak, rss_anon())
    states.flush()
    computed, cached = states.computed_rows, states.cached_rows
    return {"mode": mode, "growth_bytes": peak - base, "computed_rows": computed, "cached_rows": cached}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--width", type=int, default=576, help="values a token (SmolLM2-135M's d: 576)")
    parser.add_argument("--out")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.child[0], args.rows, args.length, args.width, args.child[1])))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("memory", "disk-write", "disk-read"):
            out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--length", str(args.length),
                                  "--width", str(args.width), "--child", mode, tmp],
                                 capture_output=True, text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    data = args.rows * args.length * args.width * 4
    print(f"{args.rows} rows x {args.length} tokens x {args.width} float32 values = {data / 2 ** 30:.2f} GiB of states")
    for r in results:
        print(f"{r['mode']:>10}: RssAnon grew {r['growth_bytes'] / 2 ** 30:.2f} GiB "
              f"({r['computed_rows']} rows computed, {r['cached_rows']} read from the cache)")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": args.rows, "length": args.length, "width": args.width,
                                              "data_bytes": data, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
