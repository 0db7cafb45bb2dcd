"""Tau against the number of training rows: heads trained on growing slices of one data file (scripts/data_curve.sh),
each measured the same way, plotted against the rows they saw.

    python scripts/data_curve.py runs/self/heads-* --heldout runs/self/heldout.jsonl \
        --prompts ../shared/data/mt_bench_question.jsonl --limit 80 \
        --out docs/results/self-data-curve.json --plot docs/results/self-data-curve.png

For each run directory (a finished `train.py` output_dir): the rows it trained on (metrics.jsonl), the held-out
expected tau of its heads on --heldout (`python -m medusa_train.train.evaluate`, every row, the trees of --budgets
nodes), and the real tau of the engine with its heads alone (greedy, --max-new-tokens; the static tree at --budget nodes
shaped by that held-out acceptance, the same rows for every run) on the first user turns of --prompts. A run's
label is its data source: the `prompt_source` of its rows (self) or `pool`. With --bar the fit tau = a + b ln(rows)
over each label's points says at what row count the real tau would reach the bar, if the curve kept its slope.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from medusa_train.config import load_config  # noqa: E402


def trained_rows(run: Path) -> int:
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    return int(first["data/rows"])


def label(run: Path) -> str:
    data = Path(load_config(run / "recipe.yaml").data.dataset)
    files = sorted(data.glob("*.jsonl")) if data.is_dir() else [data]
    sources = set()
    for f in files:
        with open(f) as fh:
            for line in fh:
                sources.add(json.loads(line).get("prompt_source", "pool"))
    return "+".join(sorted(sources))


def heldout_tau(run: Path, heldout: str, budgets: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "acceptance.json"
        subprocess.run([sys.executable, "-m", "medusa_train.train.evaluate", str(run / "recipe.yaml"),
                        f"data.dataset={heldout}", "--heads", str(run), "--split", "all",
                        "--budgets", *map(str, budgets), "--out", str(out)], check=True, cwd=ROOT)
        got = json.loads(out.read_text())
    return {"expected_tau_tree": got["expected_tau_tree"], "stderr": got.get("expected_tau_tree_stderr"),
            "topk_accuracy": got["topk_accuracy"]}


def real_tau(runs: list[Path], accuracies: list[list[list[float]]], prompts_file: str, limit: int, tokens: int,
             budget: int, dtype: str) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from medusa_train.data.chat import render_prompt
    from medusa_train.kinds.heads import DraftHeads, load_spec
    from medusa_train.data.prompts import load_prompts
    from medusa_train.train.tau import measure_tau

    name = load_spec(runs[0]).target_name
    target = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(name)
    prompts = [render_prompt(tokenizer, p.text) for p in load_prompts(prompts_file)[:limit or None]]
    out = []
    for run, accuracy in zip(runs, accuracies):
        heads = DraftHeads.from_pretrained(run, target)
        tau = measure_tau(heads, target, accuracy, prompts, budget, tokens)
        print(f"{run}: real tau {tau['tau']:.3f} on {len(prompts)} prompts", flush=True)
        out.append(tau)
    return out


def crossing(points: list[tuple[int, float]], bar: float) -> dict | None:
    """Least squares tau = a + b ln(rows); the rows at which it reaches `bar` (None: fewer than two sizes)."""
    if len({r for r, _ in points}) < 2:
        return None
    xs, ys = [math.log(r) for r, _ in points], [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    rows = math.exp((bar - a) / b) if b > 0 else None
    return {"a": a, "b_per_doubling": b * math.log(2), "rows_at_bar": rows}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in sorted({r["label"] for r in result["runs"]}):
        rs = sorted((r for r in result["runs"] if r["label"] == name), key=lambda r: r["rows"])
        xs = [r["rows"] for r in rs]
        ax.plot(xs, [r["real_tau"]["tau"] for r in rs], "o-", label=f"{name}: real tau, {result['prompts_name']}")
        ax.plot(xs, [r["heldout"]["expected_tau_tree"][str(result["budget"])] for r in rs], "s--",
                label=f"{name}: expected tau@{result['budget']}, held-out")
    if result.get("bar"):
        ax.axhline(result["bar"], color="grey", lw=0.8, ls=":", label=f"bar: tau {result['bar']}")
    ax.set_xscale("log")
    ax.set_xlabel("training rows (log scale)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.legend(fontsize=7)
    ax.set_title("tau against the data")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="finished train.py output directories")
    p.add_argument("--heldout", required=True, help="chat rows none of the runs trained on")
    p.add_argument("--prompts", required=True, help="prompts for the real tau (their first user turns)")
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 64])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bar", type=float, default=2.5)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file() or not (run / "model.safetensors").is_file():
            sys.exit(f"error: {run} is not a finished run (no metrics.jsonl or model.safetensors)")
    budgets = sorted(set(args.budgets) | {args.budget})
    held = [heldout_tau(run, args.heldout, budgets) for run in args.runs]
    taus = real_tau(args.runs, [h["topk_accuracy"] for h in held], args.prompts, args.limit, args.max_new_tokens,
                    args.budget, args.dtype)
    result = {"prompts": args.prompts, "prompts_name": Path(args.prompts).stem, "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "budget": args.budget, "dtype": args.dtype, "bar": args.bar,
              "heldout": args.heldout, "runs": []}
    for run, tau, h in zip(args.runs, taus, held):
        result["runs"].append({"run": str(run), "rows": trained_rows(run), "label": label(run), "real_tau": tau,
                               "heldout": h})
    result["fit"] = {}
    for name in sorted({r["label"] for r in result["runs"]}):
        pts = [(r["rows"], r["real_tau"]["tau"]) for r in result["runs"] if r["label"] == name]
        result["fit"][name] = crossing(pts, args.bar)
    for r in sorted(result["runs"], key=lambda r: (r["label"], r["rows"])):
        print(f"{r['label']:>6} {r['rows']:>6} rows: real tau {r['real_tau']['tau']:.3f}, held-out expected "
              f"tau@{args.budget} {r['heldout']['expected_tau_tree'][str(args.budget)]:.3f}")
    print(json.dumps(result["fit"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
