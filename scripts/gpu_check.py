"""The GPU check: what a GPU must show before anyone trains or serves on one, in one command of under 10 minutes, with
no download and no registry (random-weight targets; imports: torch, transformers, accelerate and this project only).

    python scripts/gpu_check.py --out runs/gpu-check                # on a GPU machine (bash scripts/gpu_check.sh)
    python scripts/gpu_check.py --device cpu --quick --out /tmp/gc   # the same code paths on tiny shapes, any machine

Four parts, one table each, all in OUT/gpu-check.json (written again after the launch, so a hung oracle loses nothing):

1. **exact**: the engine's greedy output against `generate` on the device, for heads of every registered kind, static
   and dynamic trees: float64 on a tiny Llama (must match token for token: the engine's contract) and float32 and
   bfloat16 on a small random target (reported: exact wherever the kernels are batch-invariant; TF32 is off).
2. **train**: one training step of each kind's heads (4 of them) on a target of Llama-3.1-8B's shape (random
   weights, bfloat16, `--rows` x `--length` tokens, the recipe's draft vocabulary), then eagle3 at EAGLE-3's 7 steps
   for 1024, 2048 and 4096 tokens a row (`--eagle3-lengths`): the target's forward, the heads' forward, loss and
   backward under bf16 autocast, a step of the recipe's optimizer (`train.optimizer: auto`: Muon for eagle3); peak
   device memory, milliseconds a step (the median of `--steps` after a warm-up) and the training attention's kernel
   (`flash`: CUDA's; `torch`: PyTorch ops, where the flash kernel failed its check). An out-of-memory step is
   reported as such, and the next one runs.
3. **launch**: `accelerate launch --config_file recipes/accelerate/single_gpu.yaml train.py RECIPE` for 4 steps on a
   tiny random Llama, as users launch training: exit code, steps logged, heads written. It needs `datasets` (train.py
   reads rows through it), which a GPU machine without a registry lacks: `bash scripts/gpu_check.sh` downloads its
   three small wheels (datasets, dill, multiprocess; < 1 MB together, pure Python) into `runs/wheels` where a
   registry answers, carry that folder to the GPU machine, and `--wheels runs/wheels` installs them into the
   launch's own folder (nothing else is touched). Where `datasets` is missing all the same, the part says so.
4. **oracle**, last: `python -m inference.oracle` on the 8B shape, eager (budgets 1, 4, 16) and compiled
   (`--compile`: static cache, CUDA graphs; budgets 4 and 16), every drafted token right: what the engine costs
   around the verify, against plain and compiled `generate`. Skipped on a CPU (`--quick` runs it on the small
   shape, eagerly).

Every subprocess (the launch, each oracle run) has a timeout (`--timeout`, seconds): one that hangs is reported as
timed out and the check goes on, so a 15-minute loan always ends with the report written.

Exit 0 when every float64 generation was exact (the other parts are measurements), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference.oracle import random_target  # noqa: E402
from medusa_train.kinds import KINDS, DraftHeads  # noqa: E402


def perturbed(heads: DraftHeads, scale: float, seed: int = 0) -> DraftHeads:
    """Heads moved off their start, so that they draft varied tokens (some right, most wrong)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    return heads


def tiny_target(device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=259, bos_token_id=256, eos_token_id=258)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def exact(device: str, quick: bool, log) -> list[dict]:
    """Greedy output of the engine against `generate`, per dtype, kind and tree."""
    from inference import HeadsDrafter, SpeculativeGenerator

    rows = []
    cases = [("tiny llama", torch.float64, lambda: tiny_target(device, torch.float64))]
    for dtype in (torch.float32, torch.bfloat16):
        cases.append(("small" if not quick else "tiny llama", dtype,
                      (lambda dt=dtype: random_target("small", torch.device(device), dt)) if not quick
                      else (lambda dt=dtype: tiny_target(device, dt))))
    for name, dtype, build in cases:
        target = build()
        vocab = target.get_output_embeddings().weight.shape[0]
        g = torch.Generator().manual_seed(1)
        count = 4 if not quick else 2 if dtype == torch.float64 else 1  # quick: the float64 rows are the check
        prompts = [torch.randint(0, vocab - 4, (1, 24), generator=g).to(device) for _ in range(count)]
        new = 24 if quick else 48
        with torch.no_grad():
            want = [target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new, do_sample=False,
                                    pad_token_id=0)[0, p.shape[1]:].tolist() for p in prompts]
        for kind in KINDS:
            heads = perturbed(DraftHeads.for_target(target, kind, 3), 0.1)
            for tree in ("static", "dynamic"):
                gen = SpeculativeGenerator(target, None, HeadsDrafter(heads, target))
                same, tau = 0, []
                for p, w in zip(prompts, want):
                    out = gen.generate(p, max_new_tokens=new, tree=tree, tree_budget=8)
                    same += out.token_ids.tolist() == w
                    tau.append(out.stats.tau)
                row = {"target": name, "dtype": str(dtype).removeprefix("torch."), "kind": kind, "tree": tree,
                       "exact": f"{same}/{len(prompts)}", "all_exact": same == len(prompts),
                       "tau": round(statistics.mean(tau), 2)}
                rows.append(row)
                log(f"[exact] {row}")
        del target
    return rows


def train_step(device: str, shape: str, kind: str, rows: int, length: int, steps: int, log, num_heads: int = 4
               ) -> dict:
    """Peak memory and time of a training step of `kind`'s heads on a random `shape`-shaped bfloat16 target, with
    the recipe's optimizer for the kind."""
    import medusa_train.kinds.attention as attention
    from medusa_train.config import LossConfig, load_config
    from medusa_train.target.model import logit_transform
    from medusa_train.target.states import TargetStates
    from medusa_train.train.losses import HeadsObjective
    from medusa_train.train.optim import build_optimizer

    cuda = device.startswith("cuda")
    target = random_target(shape, torch.device(device), torch.bfloat16, max_positions=max(4096, length + 8))
    vocab = target.get_output_embeddings().weight.shape[0]
    draft = vocab // 4 if vocab // 4 >= 2048 else 0
    heads = DraftHeads.for_target(target, kind, num_heads,
                                  draft_ids=torch.arange(draft, device=device) if draft else None)
    heads.to(device)
    heads.float()  # the heads train in float32 beside a bfloat16 target, as the recipes' mixed precision does
    objective = HeadsObjective(heads, LossConfig(), logit_transform(target.config))
    cfg = load_config(str(ROOT / "recipes" / "llama-3.1-8b-instruct.yaml"),
                      [f"heads.kind={kind}", f"heads.num_heads={num_heads}", "eval.tau_every=0"], world_size=1)
    opt, _ = build_optimizer(cfg, heads, None, total_steps=steps + 1)
    states = TargetStates(target, target.get_output_embeddings(), layers=heads.target_layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=g).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    times = []
    result = {"kind": kind, "steps": num_heads, "shape": shape, "tokens": f"{rows} x {length}",
              "params": sum(p.numel() for p in heads.parameters() if p.requires_grad),
              "optimizer": cfg.train.optimizer}
    attention._checked.clear()
    try:
        for i in range(steps + 1):
            if cuda:
                torch.cuda.synchronize()
                if i == 1:
                    torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            with torch.no_grad():
                h, greedy = states(batch)
            with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
                loss, _ = objective(h, greedy, ids, batch["labels"], batch["attention_mask"],
                                    target.get_input_embeddings(), target.get_output_embeddings())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
        result["ms_per_step"] = round(1e3 * statistics.median(times), 1)
        if cuda:
            result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except torch.OutOfMemoryError:
        result["error"] = "out of memory"
    if type(heads).recomputes:  # draft layers: which kernel their attention ran (kinds/attention.py checks its own)
        used = {name for (name, *_), ok in attention._checked.items() if ok}
        result["attention"] = "flash" if "cuda" in used else "cpu flash" if "cpu" in used else "torch"
    log(f"[train] {result}")
    del target, heads, objective, opt
    if cuda:
        torch.cuda.empty_cache()
    return result


def run_for(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run with a timeout: one that runs past it is a result (rc 124, "timed out after N s"), not a
    traceback that loses the report."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout:.0f} s")


def oracle(device: str, quick: bool, out: Path, log, timeout: float) -> list[dict]:
    """The oracle benchmark, eager and compiled, through its own command line (a subprocess each: a clean device)."""
    runs = []
    shape, limit, new = ("small", 1, 32) if quick else ("llama-8b", 2, 64)
    for compiled in ((False,) if quick else (False, True)):
        budgets = "1,4" if quick else "4,16" if compiled else "1,4,16"  # each compiled budget costs its compile
        path = out / f"oracle-{shape}-{'compiled' if compiled else 'eager'}.json"
        cmd = [sys.executable, "-m", "inference.oracle", "--shape", shape, "--device", device, "--budgets", budgets,
               "--limit", str(limit), "--max-new-tokens", str(new), "--out", str(path)]
        cmd += ["--dtype", "bfloat16"] if device.startswith("cuda") else ["--dtype", "float32"]
        cmd += ["--compile"] if compiled else []
        t = time.perf_counter()
        done = run_for(cmd, timeout, cwd=ROOT)
        row = {"shape": shape, "compiled": compiled, "seconds": round(time.perf_counter() - t, 1),
               "rc": done.returncode}
        if done.returncode == 0:
            row |= json.loads(path.read_text())
        else:
            row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
        log(f"[oracle] {shape} {'compiled' if compiled else 'eager'}: rc {done.returncode}, {row['seconds']} s")
        runs.append(row)
    return runs


def datasets_path(work: Path, wheels: str, log) -> str | None:
    """A folder to put on the launch's PYTHONPATH holding `datasets` (installed there from the wheels in `wheels`,
    with no index and no dependencies: the GPU machine has the rest), "" where it is importable already, None where
    neither."""
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        return ""
    found = sorted(Path(wheels).glob("*.whl")) if wheels else []
    if not found:
        return None
    site = work / "site"
    done = run_for([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(site), *map(str, found)], 300)
    log(f"launch: datasets from {wheels}: pip rc {done.returncode} {done.stderr.strip()[-200:]}")
    return str(site) if done.returncode == 0 else None


def launch(device: str, out: Path, steps: int, log, timeout: float, wheels: str = "") -> dict:
    """`accelerate launch --config_file recipes/accelerate/single_gpu.yaml train.py RECIPE` as a user runs it (on a
    CPU: `--cpu`), `steps` steps of chained heads on a tiny random Llama and 40 rows of text: the exit code, the
    steps logged, the seconds, the peak memory the run logged."""
    import os
    import shutil

    work = out / "launch"
    shutil.rmtree(work, ignore_errors=True)
    site = datasets_path(work, wheels, log)
    if site is None:
        return {"launched": False, "error": "datasets is not installed (pip install datasets, or --wheels DIR with "
                                            "its wheels): train.py reads its rows through it"}
    sys.path.insert(0, str(ROOT / "tests"))
    from runs import write_text_data
    from tiny import save_tiny

    save_tiny(work / "model", "llama")
    write_text_data(work / "text.jsonl")
    (work / "recipe.yaml").write_text(
        f"target: {{model: {work / 'model'}}}\nheads: {{num_heads: 2}}\n"
        f"data: {{dataset: {work / 'text.jsonl'}, format: text, max_length: 24, eval_size: 4}}\n"
        f"train: {{batch_size: 4, max_steps: {steps}, log_every: 1}}\neval: {{every: 0, max_batches: 1}}\n"
        "tracking: {backend: none}\n")
    where = ["--cpu", "--num_processes", "1", "--mixed_precision", "no"] if device == "cpu" else [
        "--config_file", str(ROOT / "recipes" / "accelerate" / "single_gpu.yaml")]
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", *where, "--dynamo_backend", "no",
           str(ROOT / "train.py"), str(work / "recipe.yaml"), f"output_dir={work / 'out'}"]
    log(f"launch: {' '.join(cmd[1:3])} ... train.py, {steps} steps")
    t0 = time.perf_counter()
    env = os.environ | ({"PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
                        if site else {})
    proc = run_for(cmd, timeout, cwd=ROOT, env=env)
    seconds = round(time.perf_counter() - t0, 1)
    metrics = work / "out" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    logged = [r["step"] for r in rows if "train/loss" in r]
    result = {"launched": True, "exit_code": proc.returncode, "steps_logged": logged, "seconds": seconds,
              "peak_gib": round(max((r["train/peak_memory_gib"] for r in rows if "train/loss" in r), default=0), 3),
              "heads_written": (work / "out" / "model.safetensors").exists()}
    if proc.returncode != 0:
        result["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return result


def table(rows: list[dict], keys: list[str]) -> str:
    widths = [max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(str(r.get(k, "")).ljust(w) for k, w in zip(keys, widths)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes throughout (a CPU run of the same code paths)")
    p.add_argument("--rows", type=int, default=2, help="training rows a step (part 2)")
    p.add_argument("--length", type=int, default=2048, help="tokens a training row (part 2)")
    p.add_argument("--steps", type=int, default=3, help="timed training steps a kind, after one warm-up")
    p.add_argument("--eagle3-lengths", default="1024,2048,4096",
                   help="tokens a row for eagle3 at 7 steps (part 2; 2 rows each); empty: none")
    p.add_argument("--parts", default="exact,train,launch,oracle")
    p.add_argument("--timeout", type=float, default=240, help="seconds each subprocess may run (launch, oracle)")
    p.add_argument("--wheels", default="", help="a folder of the datasets, dill and multiprocess wheels (part 3)")
    p.add_argument("--out", default="runs/gpu-check")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("error: no CUDA device: run with --device cpu --quick to check the code paths", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False  # exactness in float32 needs true float32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    parts = set(args.parts.split(","))
    report: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "torch": torch.__version__, "quick": args.quick}
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        pass
    t0 = time.perf_counter()
    if "exact" in parts:
        report["exact"] = exact(args.device, args.quick, log)
        print("\n1. greedy output of the engine against generate\n" + table(
            report["exact"], ["target", "dtype", "kind", "tree", "exact", "tau"]))
    if "train" in parts:
        shape = "small" if args.quick else "llama-8b"
        rows, length = (2, 64) if args.quick else (args.rows, args.length)
        report["train"] = [train_step(args.device, shape, kind, rows, length, args.steps, log) for kind in KINDS]
        lengths = [int(n) for n in args.eagle3_lengths.split(",") if n] if not args.quick else [64, 128]
        report["train"] += [train_step(args.device, shape, "eagle3", 2, n, args.steps, log, num_heads=7)
                            for n in lengths]
        print("\n2. one training step (random target, bfloat16 autocast)\n" + table(
            report["train"], ["kind", "steps", "shape", "tokens", "params", "optimizer", "attention", "ms_per_step",
                              "peak_gib", "error"]))
    if "launch" in parts:
        report["launch"] = launch("cpu" if args.device == "cpu" else args.device, out, 4, log, args.timeout,
                                  args.wheels)
        print("\n3. accelerate launch train.py, 4 steps (tiny target)\n" + table(
            [report["launch"]], ["launched", "exit_code", "steps_logged", "seconds", "peak_gib", "heads_written",
                                 "error"]))
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")  # what ran so far, if the oracle hangs
    if "oracle" in parts and (args.device.startswith("cuda") or args.quick):
        report["oracle"] = oracle(args.device, args.quick, out, log, args.timeout)
        flat = [{"run": f"{r['shape']} {'compiled' if r['compiled'] else 'eager'}", "budget": b, **m}
                for r in report["oracle"] for b, m in r.get("budgets", {}).items()]
        flat += [{"run": f"{r['shape']} {'compiled' if r['compiled'] else 'eager'}", "error": r["error"]}
                 for r in report["oracle"] if "error" in r]
        print("\n4. the oracle benchmark (every draft right)\n" + table(
            flat, ["run", "budget", "tau", "tokens_per_s", "speedup", "efficiency", "exact_match", "error"]))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{report['device']}, torch {report['torch']}: {report['seconds']} s; {out / 'gpu-check.json'}")
    strict = [r for r in report.get("exact", []) if r["dtype"] == "float64"]
    return 0 if all(r["all_exact"] for r in strict) else 1


if __name__ == "__main__":
    sys.exit(main())
