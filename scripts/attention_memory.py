"""What a training step of eagle3 or dflash heads costs in its attention, by sequence length and attention path:
seconds, the process's peak resident memory, what autograd keeps for backward, and the attention's FLOPs as PyTorch
counts them (`FlopCounterMode`: the objective's FLOPs less those of the same step with the attention made free).

    python scripts/attention_memory.py --lengths 512 1024 2048 --out docs/results/attention-cost.json
    python scripts/attention_memory.py --root OLD_CHECKOUT --modes chunked ...   # a checkout from before, side by side

`--modes` are the values of that checkout's `medusa_train.kinds.attention.MODE`: here `torch` (the GPU's branch
wherever CUDA's flash kernel does not apply, and its algorithm where it does: one causal pass a step plus each row's
extra keys; PyTorch ops, so every FLOP is counted), `cpu` (PyTorch's CPU flash kernel; its FLOPs are not counted),
`recompute` (`torch` with train.activation_checkpointing); before 2026-11-28, `chunked` (the GPU's branch then: the
dense mask a chunk of rows at a time) and `sdpa`. Each configuration runs in a process of its own, on one thread
unless `--threads`.

Target: random weights of the `small` shape (6 query / 2 key-value heads, d 384, 6 layers, vocabulary 8192), 2 rows;
eagle3 with 7 steps, dflash with blocks of 8 (7 mask tokens) and 64 anchors a row; float32. `causal_passes` is the
FLOPs a flash kernel's causal pass over the same queries and keys does, once a step (eagle3: 7 steps' worth; 2
matmuls forward and 5 backward over T(T+1)/2 scores): the yardstick of "no score the pattern masks out".
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(root: str, kind: str, length: int, mode: str, repeats: int) -> dict:
    """Runs in the child: forward and backward of the heads' training states and their loss, `repeats` times."""
    sys.path.insert(0, root)
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import medusa_train.kinds.attention as attention
    from inference.oracle import random_target
    from medusa_train.config import LossConfig
    from medusa_train.kinds import DraftHeads
    from medusa_train.train.losses import HeadsObjective

    try:
        from medusa_train.target.states import TargetStates
    except ImportError:
        from medusa_train.states import TargetStates  # a checkout after the package's rename

    steps = 7
    target = random_target("small", torch.device("cpu"), torch.float32, max_positions=length + 16)
    heads = DraftHeads.for_target(target, kind, steps, draft_ids=torch.arange(2048))
    ids = torch.randint(0, 8192, (2, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        h, greedy = TargetStates(target, target.get_output_embeddings(), layers=heads.target_layers)(batch)
    if mode == "recompute":
        heads.recompute, mode = True, "torch"
    attention.MODE = mode
    objective = HeadsObjective(heads, LossConfig())

    def step():
        torch.manual_seed(1)  # dflash's anchors: the same every time
        loss, _ = objective(h, greedy, ids, ids.clone(), batch["attention_mask"], target.get_input_embeddings(),
                            target.get_output_embeddings())
        loss.backward()

    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = {"kind": kind, "length": length, "attention": "recompute" if getattr(heads, "recompute", False) else mode,
           "seconds": round(statistics.median(seconds), 3), "saved_mib": round(saved[0] / 2**20, 1),
           "peak_rss_mib": round(peak / 1024, 1), "step_rss_growth_mib": round((peak - before) / 1024, 1)}
    if mode in ("cpu", "sdpa"):  # the CPU's flash kernel has no FLOP formula in the counter
        return row

    def counted() -> int:
        with FlopCounterMode(display=False) as c:
            step()
        return c.get_total_flops()

    total = counted()
    module = sys.modules[f"medusa_train.kinds.{kind}"]
    name = "attention" if hasattr(module, "attention") else "masked_attention"

    def free(q, k, v, *rest, **kw):  # every input reaches the output, at no counted FLOP
        extras = [t for pair in (kw.get("extras") or (rest[2] if len(rest) > 2 else ())) for t in pair]
        return q + sum(t.sum() for t in (k, v, *extras)) * 0

    setattr(module, name, free)
    row["attention_gflops"] = round((total - counted()) / 1e9, 2)
    hd, H = heads.draft_model.layers[0].head_dim, heads.draft_model.layers[0].num_heads
    if hasattr(heads.draft_model, "ttt_states"):  # eagle3's yardstick: a flash kernel's causal pass a step (2
        # matmuls forward, 5 backward, 2 FLOPs each, over T(T+1)/2 scores)
        row["causal_passes_gflops"] = round(steps * 14 * 2 * H * hd * length * (length + 1) / 2 / 1e9, 2)
        row["x_causal_passes"] = round(row["attention_gflops"] / row["causal_passes_gflops"], 2)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/attention_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["eagle3", "dflash"])
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 1024])
    p.add_argument("--modes", nargs="+", default=["cpu", "torch", "recompute"])
    p.add_argument("--root", default=str(ROOT), help="the checkout whose medusa_train runs (default: this one)")
    p.add_argument("--label", default="", help="a name for the checkout in the table (default: its git commit)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="a JSON file: its rows are kept and these added")
    args = p.parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        root, kind, length, mode, repeats = args.child
        print(json.dumps(one(root, kind, int(length), mode, int(repeats))))
        return 0
    label = args.label or subprocess.run(["git", "-C", args.root, "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
    rows = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).exists() else []
    for kind in args.kinds:
        for length in args.lengths:
            for mode in args.modes:
                done = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--child",
                                       args.root, kind, str(length), mode, str(args.repeats)],
                                      capture_output=True, text=True)
                row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
                    {"kind": kind, "length": length, "attention": mode, "error": done.stderr.strip()[-300:]}
                row = {"code": label, **row}
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
                if args.out:
                    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    keys = ["code", "kind", "length", "attention", "seconds", "saved_mib", "peak_rss_mib", "attention_gflops",
            "x_causal_passes"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, r.get("error", "") if k == "seconds" else "")) for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
