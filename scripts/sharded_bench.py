"""The sharded target on the machine at hand: one command that trains the same heads on a random-weight target under
each launch config of "Past one GPU" (docs/training.md) and reports what each process holds, its peak memory, the
training speed, and how far each run's heads are from the unsharded run's.

    python scripts/sharded_bench.py --shape llama-8b --out runs/sharded          # a GPU machine (all its GPUs)
    python scripts/sharded_bench.py --shape smollm2 --device cpu --out runs/sharded-cpu   # 2 CPU processes

Configs (`--configs`, in this order by default): `single` (one process, the whole target), `ddp` (`--processes`
processes, default every GPU, each with the whole target), `fsdp2` and `deepspeed_zero3` (as many, the target
sharded), `zero3_offload` (one process, ZeRO-3 with the layers in CPU memory). On one GPU the multi-process ones are
left out (two processes cannot share a GPU under NCCL). Each run's heads are compared with the unsharded run of its
process count (`single` or `ddp`): sharding changes where the weights live, not the arithmetic, so those differences
are 0 or float rounding; across process counts the batch split's rounding, amplified by AdamW on near-zero gradients,
leaves larger ones (~4e-3 after 6 steps at lr 1e-3).

The target is `inference.oracle`'s shape (or `tiny`) with random weights (no download; the tests' byte-level
tokenizer), saved once under OUT in `--dtype`; the data are the tests' synthetic text rows; every run sees the same
rows in the same steps (`--batch` rows a step, split across processes). Writes OUT/sharded.json and prints a table.
DeepSpeed runs need `pip install deepspeed` (absent: those configs are reported as not run, with the reason).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CONFIGS = {  # name: (accelerate config, processes: "n" for --processes or 1, extra launch flags)
    "single": (None, 1, ()),
    "ddp": ("multi_gpu_ddp", "n", ()),
    "fsdp2": ("fsdp2", "n", ()),
    "deepspeed_zero3": ("deepspeed_zero3", "n", ()),
    "zero3_offload": ("deepspeed_zero3", 1, ("--offload_param_device", "cpu")),
}


def make_target(out: Path, shape: str, dtype: str) -> Path:
    """A random-weight Llama of `shape` and the tests' byte-level tokenizer, saved once."""
    import torch
    from tiny import tiny_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    from inference.oracle import SHAPES

    path = out / f"target-{shape}-{dtype}"
    if (path / "config.json").exists():
        return path
    fields = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2) if shape == "tiny" else SHAPES[shape]
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=4096, eos_token_id=258, bos_token_id=256, pad_token_id=259,
                         **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path.with_suffix(".tmp"))
    tiny_tokenizer().save_pretrained(path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return path


def launch(name: str, out: Path, recipe: Path, n: int, device: str, batch: int) -> dict:
    """One run of the recipe under config `name` on `n` processes; what it measured, or why it did not run. The heads
    train in float32 under every config (`--mixed_precision no`), so that their runs compare."""
    config, _, flags = CONFIGS[name]
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [str(ROOT / "train.py"), str(recipe), f"train.batch_size={batch}", f"output_dir={run_dir}"]
    if config is None:
        cmd = [sys.executable, *args]
    else:
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(ROOT / "recipes" / "accelerate" / f"{config}.yaml"), "--num_processes", str(n),
               "--mixed_precision", "no", "--dynamo_backend", "no", *flags, *args]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    if device == "cpu":
        env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")] or proc.stderr.splitlines()[-3:]
        return {"config": name, "processes": n, "ran": False, "why": " ".join(lines)[:400]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sizes = next((r for r in rows if "target/bytes_whole" in r), {})
    train = [r for r in rows if "train/loss" in r]
    return {"config": name, "processes": n, "ran": True, "wall_s": round(wall, 1),
            "tokens_per_s": round(train[-1]["train/tokens_per_s"], 1),
            "peak_memory_gib": round(max(r["train/peak_memory_gib"] for r in train), 3),
            "target_mib_here": round(sizes["target/bytes_here"] / 2 ** 20, 1) if sizes else None,
            "target_mib_whole": round(sizes["target/bytes_whole"] / 2 ** 20, 1) if sizes else None,
            "final_loss": train[-1]["train/loss"], "heads": str(run_dir / "model.safetensors")}


def max_diff(a: str, b: str) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa if wa[k].numel())


def main(argv=None) -> int:
    from medusa_train.base.errors import ArgumentParser

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-8b", help="tiny, or an inference.oracle shape: smollm2, small, llama-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="the target's dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--processes", type=int, default=None, help="for fsdp2 and deepspeed_zero3 (default: every GPU; "
                   "2 on cpu)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--kind", default="eagle3", help="heads.kind")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="rows a step, split across processes")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("runs/sharded"))
    args = p.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.processes is None:
        import torch

        args.processes = torch.cuda.device_count() if args.device == "cuda" else 2
    args.out.mkdir(parents=True, exist_ok=True)
    from runs import write_text_data

    target = make_target(args.out, args.shape, dtype)
    data = args.out / "text.jsonl"
    # ~2,400 one-byte tokens a document: enough blocks of --max-length for every step
    write_text_data(data, documents=args.batch * args.steps * args.max_length // 2400 + 2, words=400)
    recipe = args.out / "recipe.yaml"
    recipe.write_text(f"target: {{model: {target}, dtype: {dtype}}}\nheads: {{kind: {args.kind}, num_heads: 3}}\n"
                      f"data: {{dataset: {data}, format: text, max_length: {args.max_length}, eval_size: 0}}\n"
                      f"train: {{max_steps: {args.steps}, lr: 1.0e-3, warmup_steps: 2, log_every: 1, seed: 0, "
                      "save_every: 0}\neval: {every: 0, tau_every: 0}\n")
    results = []
    for name in args.configs.split(","):
        several = CONFIGS[name][1] == "n"
        n = args.processes if several else 1
        if several and n < 2:
            results.append({"config": name, "processes": n, "ran": False, "why": "needs 2 or more GPUs"})
            continue
        print(f"{name}: {n} process{'es' if n > 1 else ''} ...", flush=True)
        results.append(launch(name, args.out, recipe, n, args.device, args.batch))
    ran = [r for r in results if r["ran"]]
    for r in ran:  # against the unsharded run with as many processes
        ref = next((q for q in ran if q["config"] in ("single", "ddp") and q["processes"] == r["processes"]), None)
        r["reference"] = ref["config"] if ref else None
        r["max_diff_vs_reference"] = max_diff(ref["heads"], r["heads"]) if ref else None
    report = {"shape": args.shape, "device": args.device, "dtype": dtype, "kind": args.kind, "steps": args.steps,
              "batch": args.batch, "max_length": args.max_length, "results": results}
    import torch

    report["torch"] = torch.__version__
    if args.device == "cuda":
        report["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    (args.out / "sharded.json").write_text(json.dumps(report, indent=2) + "\n")
    print("| config | processes | target MiB held / whole | peak GiB (main process) | tokens/s | heads' max diff |\n"
          "|---|---|---|---|---|---|")
    for r in results:
        if not r["ran"]:
            print(f"| {r['config']} | {r['processes']} | not run: {r['why']} | | | |")
            continue
        held = f"{r['target_mib_here']} / {r['target_mib_whole']}" if r["target_mib_here"] is not None else "whole"
        diff = f"{r['max_diff_vs_reference']:.2e} vs {r['reference']}" if r["reference"] else "(no reference run)"
        print(f"| {r['config']} | {r['processes']} | {held} | {r['peak_memory_gib']} | {r['tokens_per_s']} | {diff} |")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
