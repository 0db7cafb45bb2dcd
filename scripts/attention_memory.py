"""What a training step of eagle3 or dflash heads holds for backward, by sequence length, with three attentions:
`cpu` (PyTorch's SDPA as a CPU runs it: its flash kernel takes the mask and grouped heads), `math` (the same masked call
in the math kernel, which is what CUDA runs for a mask with grouped heads: the GPU path before kinds/attention.py) and
`chunked` (kinds/attention.py's ChunkedAttention, the GPU path now). Each configuration runs in a process of its own:
its peak resident memory (ru_maxrss) and the bytes autograd keeps for backward (saved_tensors_hooks) are reported.

    python scripts/attention_memory.py --lengths 512 1024 2048 --out docs/results/attention-memory.json

Target: random weights of the `small` shape (6 query / 2 key-value heads, d 384, 6 layers, vocabulary 8192), 2 rows;
eagle3 with 7 steps, dflash with blocks of 8 (7 mask tokens) and 64 anchors a row; float32.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(kind: str, length: int, mode: str) -> dict:
    """Runs in the child: one forward and backward of the heads' training states and their loss."""
    sys.path.insert(0, str(ROOT))
    import torch

    import medusa_train.kinds.attention as attention
    from inference.oracle import random_target
    from medusa_train.config import LossConfig
    from medusa_train.kinds import DraftHeads
    from medusa_train.target.states import TargetStates
    from medusa_train.train.losses import HeadsObjective

    target = random_target("small", torch.device("cpu"), torch.float32, max_positions=length + 16)
    heads = DraftHeads.for_target(target, kind, 7, draft_ids=torch.arange(2048))
    ids = torch.randint(0, 8192, (2, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        h, greedy = TargetStates(target, target.get_output_embeddings(), layers=heads.target_layers)(batch)
    attention.MODE = "sdpa" if mode in ("cpu", "math") else "chunked"
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    backends = torch.nn.attention.SDPBackend
    with torch.nn.attention.sdpa_kernel([backends.MATH] if mode == "math" else
                                        [backends.FLASH_ATTENTION, backends.EFFICIENT_ATTENTION, backends.MATH]):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = HeadsObjective(heads, LossConfig())(h, greedy, ids, ids.clone(), batch["attention_mask"],
                                                          target.get_input_embeddings(),
                                                          target.get_output_embeddings())
        loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"kind": kind, "length": length, "attention": mode, "saved_mib": round(saved[0] / 2**20, 1),
            "peak_rss_mib": round(peak / 1024, 1), "step_rss_growth_mib": round((peak - before) / 1024, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/attention_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["eagle3", "dflash"])
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 1024])
    p.add_argument("--modes", nargs="+", default=["cpu", "math", "chunked"])
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(one(args.child[0], int(args.child[1]), args.child[2])))
        return 0
    rows = []
    for kind in args.kinds:
        for length in args.lengths:
            for mode in args.modes:
                done = subprocess.run([sys.executable, __file__, "--child", kind, str(length), mode],
                                      capture_output=True, text=True)
                row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
                    {"kind": kind, "length": length, "attention": mode, "error": done.stderr.strip()[-200:]}
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
    keys = ["kind", "length", "attention", "saved_mib", "peak_rss_mib", "step_rss_growth_mib"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, r.get("error", ""))) for k in keys))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
