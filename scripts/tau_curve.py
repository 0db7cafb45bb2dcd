"""The real tau against the step, for a run trained with `eval.tau_every`, and its best heads against its last on a
prompt set nothing was tuned on.

    python scripts/tau_curve.py RUN_DIR --prompts ../shared/data/mt_bench_question.jsonl --limit 80 \
        --out docs/results/tau-curve-smollm2.json --plot docs/results/tau-curve-smollm2.png

Reads RUN_DIR/metrics.jsonl (eval/tau, eval/expected_tau@B, train/loss, best/step) and, when the run ended with its
best heads, measures RUN_DIR/best and RUN_DIR/last with the engine as the trainer does (heads alone, the static tree at
the run's eval.tau_budget, greedy), on the first user turns of --prompts through the chat template.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from medusa_train.config import load_config  # noqa: E402


def curve(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    budgets = sorted({k.split("@")[1] for r in rows for k in r if k.startswith("eval/expected_tau@")
                      and not k.endswith("_stderr")}, key=int)
    out = {"steps": [], "tau": [], "loss": {}, "expected_tau": {b: [] for b in budgets},
           "stderr": {b: [] for b in budgets}}
    for r in rows:
        if "train/loss" in r:
            out["loss"][r["step"]] = r["train/loss"]
        if "eval/tau" in r:
            out["steps"].append(r["step"])
            out["tau"].append(r["eval/tau"])
            for b in budgets:
                out["expected_tau"][b].append(r.get(f"eval/expected_tau@{b}"))
                out["stderr"][b].append(r.get(f"eval/expected_tau@{b}_stderr"))
        if "best/step" in r:
            out["best_step"] = r["best/step"]
    return out


def measure(run: Path, prompts_file: str, limit: int, tokens: int, budget: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.engine.drafters import load_topk_accuracy
    from medusa_train.data.chat import render_prompt
    from medusa_train.kinds.heads import DraftHeads, load_spec
    from medusa_train.data.prompts import load_prompts
    from medusa_train.train.tau import measure_tau

    name = load_spec(run).target_name
    target = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(name)
    prompts = [render_prompt(tokenizer, p.text) for p in load_prompts(prompts_file)[:limit or None]]
    result = {"prompts": len(prompts), "max_new_tokens": tokens, "budget": budget, "dtype": dtype}
    for which in ("best", "last"):
        heads = DraftHeads.from_pretrained(run / which, target)
        step = json.loads((run / which / "acceptance.json").read_text())["step"]
        tau = measure_tau(heads, target, load_topk_accuracy(run / which), prompts, budget, tokens)
        result[which] = {"step": step, **tau}
        print(f"{which} (step {step}): tau {tau['tau']:.3f}, {tau['tokens_per_s']:.1f} tokens/s", flush=True)
    return result


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(data["steps"], data["tau"], "o-", label="real tau (engine, held-out prompts)")
    for b, ys in data["expected_tau"].items():
        ax.plot(data["steps"], ys, ".--", label=f"expected tau, tree of {b} nodes (held-out)")
    if "best_step" in data:
        ax.axvline(data["best_step"], color="grey", lw=0.8, ls=":", label=f"best: step {data['best_step']}")
    ax.set_xlabel("step")
    ax.set_ylabel("tau")
    loss = ax.twinx()
    steps = sorted(data["loss"])
    loss.plot(steps, [data["loss"][s] for s in steps], color="grey", alpha=0.5, label="training loss")
    loss.set_ylabel("training loss (grey)", color="grey")
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title("tau against the step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run's output_dir (trained with eval.tau_every)")
    p.add_argument("--prompts", default=None, help="measure best/ and last/ on these prompts' first user turns")
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    if not (args.run / "metrics.jsonl").is_file():
        sys.exit(f"error: {args.run}/metrics.jsonl not found: pass a run's output_dir")
    data = curve(args.run)
    if not data["steps"]:
        sys.exit(f"error: {args.run} logged no eval/tau: train with eval.tau_every=N")
    for s, t in zip(data["steps"], data["tau"]):
        print(f"step {s:>5}: tau {t:.3f}" + ("  <- best" if s == data.get("best_step") else ""))
    recipe = load_config(args.run / "recipe.yaml")
    if args.prompts and (args.run / "best").is_dir() and (args.run / "last").is_dir():
        data["best_vs_last"] = measure(args.run, args.prompts, args.limit, args.max_new_tokens,
                                       recipe.eval.tau_budget, args.dtype)
        data["best_vs_last"]["source"] = args.prompts
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
