"""Peak host memory of each process of a 2-process sharded run (`accelerate launch --config_file
recipes/accelerate/{fsdp2,deepspeed_zero3}.yaml --num_processes 2 train.py ...`, one training step) on a random
Llama-shaped target of about 1.1 GB in float32: what loading a sharded target costs a host.

    python scripts/sharded_load_memory.py --out docs/results/sharded-load-memory.json
    python scripts/sharded_load_memory.py --tree OTHER_CHECKOUT    # the same runs with another version's train.py

Each process reports its peak resident memory (ru_maxrss) when it exits, through a sitecustomize module put on its
path, so any version of the trainer is measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = '''import atexit, json, os, resource
def _report():
    rank = os.environ.get("RANK")
    if rank is not None:
        with open(os.path.join(os.environ["PEAK_DIR"], f"rank{rank}.json"), "w") as f:
            json.dump({"rank": int(rank), "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)
atexit.register(_report)
'''


def make_target(path: Path, layers: int, hidden: int) -> int:
    """A random Llama (grouped-query attention, vocabulary 8192) and the tests' tiny tokenizer; returns its bytes."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from tiny import tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose train.py runs")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--configs", nargs="+", default=["fsdp2", "deepspeed_zero3"],
                        help="recipes/accelerate/CONFIG.yaml launch configs to run")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        size = make_target(tmp / "model", args.layers, args.hidden)
        sys.path.insert(0, str(ROOT / "tests"))
        from runs import write_text_data

        write_text_data(tmp / "text.jsonl")
        (tmp / "recipe.yaml").write_text(
            f"target: {{model: {tmp / 'model'}}}\nheads: {{num_heads: 2}}\n"
            f"data: {{dataset: {tmp / 'text.jsonl'}, format: text, max_length: 24, eval_size: 0}}\n"
            "train: {batch_size: 2, max_steps: 1, keep_best: last}\neval: {every: 0}\n")
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(REPORT)
        by_config = {}
        for config in args.configs:
            peaks = run(args.tree, config, tmp)
            if peaks is None:
                return 1
            by_config[config] = peaks
    result = {"target_bytes": size, "layers": args.layers, "hidden": args.hidden, "tree": args.tree,
              "peak_bytes_by_process": by_config}
    for config, peaks in by_config.items():
        print(f"{config}: target {size / 2 ** 30:.2f} GiB (float32); peak host memory by process, " + "; ".join(
            f"{when.replace('_', ' ')}: " + ", ".join(f"{b / 2 ** 30:.2f} GiB" for b in values)
            for when, values in peaks.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def run(tree: str, config: str, tmp: Path) -> dict[str, list[int]] | None:
    """One step under recipes/accelerate/CONFIG.yaml on 2 processes: each process's peak resident bytes once the
    target is loaded and sharded (what the run records), and over the whole run."""
    peaks_dir = tmp / f"peaks-{config}"
    peaks_dir.mkdir()
    env = os.environ | {"PYTHONPATH": f"{tmp / 'site'}:{tree}", "PEAK_DIR": str(peaks_dir), "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(ROOT / "recipes" / "accelerate" / f"{config}.yaml"), "--num_processes", "2", "--mixed_precision", "no",
           "--dynamo_backend", "no", str(Path(tree) / "train.py"), str(tmp / "recipe.yaml"),
           f"output_dir={tmp / ('out-' + config)}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return None
    peaks = sorted((json.loads(p.read_text()) for p in peaks_dir.glob("rank*.json")), key=lambda r: r["rank"])
    metrics = [json.loads(line) for line in (tmp / f"out-{config}" / "metrics.jsonl").read_text().splitlines()]
    loaded = next(r["target/host_peak_bytes_by_process"] for r in metrics if "target/host_peak_bytes_by_process" in r)
    return {"after_loading": loaded, "whole_run": [r["peak_bytes"] for r in peaks]}


if __name__ == "__main__":
    sys.exit(main())
