"""Every causal LM architecture transformers ships, as a tiny random model, through the engine: exact greedy output
for every drafter (planted oracles, random chained / parallel / eagle3 / dflash / dspark heads, n-gram lookup; static
and dynamic trees) and sampling, or a one-line refusal at load. Writes the table to docs/architectures.md.

    python scripts/arch_sweep.py                 # all of them, each in a process of its own (~15 minutes, 2 cores)
    python scripts/arch_sweep.py llama bloom     # some
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def one(model_type: str) -> None:
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    from archs import sweep_one

    row = sweep_one(model_type)
    print(json.dumps(row.__dict__), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "docs" / "architectures.md"))
    parser.add_argument("--timeout", type=int, default=180)
    args = parser.parse_args()
    if args.one:
        one(args.one)
        return 0
    from archs import causal_lm_types

    import transformers

    types = args.model_types or causal_lm_types()
    rows = []
    for mt in types:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", mt], capture_output=True, text=True,
                                  timeout=args.timeout)
            line = (proc.stdout.strip().splitlines() or [""])[-1]
            row = json.loads(line) if line.startswith("{") else {
                "model_type": mt, "status": "CRASH", "detail": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
        except subprocess.TimeoutExpired:
            row = {"model_type": mt, "status": "not built", "detail": f"took over {args.timeout} s"}
        rows.append(row)
        print(f"{mt:32s} {row['status']:10s} {time.perf_counter() - t0:5.1f}s  {row['detail'][:120]}", flush=True)
    if not args.model_types:
        counts = {s: sum(r["status"] == s for r in rows) for s in ("exact", "refused", "not built", "MISMATCH",
                                                                    "CRASH")}
        lines = ["# Architectures: what the engine does with each causal LM transformers ships", "",
                 f"`python scripts/arch_sweep.py` on transformers {transformers.__version__}: every model type of "
                 "`AutoModelForCausalLM`, as a tiny random model (float64, 2 to 4 layers), through the engine with "
                 "every drafter (planted oracles that force full-depth and rank-1 paths, random chained, parallel, "
                 "eagle3, dflash and dspark heads, n-gram lookup; static and dynamic trees; sampling). **exact**: "
                 "greedy output equal to the model's own `generate` for all of them; **refused**: "
                 "`SpeculativeGenerator` refuses it at load in one line (quoted); **not built**: the tiny config we "
                 "derive from its defaults does not make a model whose own `generate` runs (nothing of ours ran).", "",
                 " | ".join(f"{k}: {v}" for k, v in counts.items()), "",
                 "| model type | result | detail |", "|---|---|---|"]
        lines += [f"| {r['model_type']} | {r['status']} | {r['detail'].replace('|', '/')} |" for r in rows]
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 1 if any(r["status"] in ("MISMATCH", "CRASH") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
