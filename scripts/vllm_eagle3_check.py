"""On a GPU machine with vLLM: serve an eagle3 export (`python -m medusa_train.export ... --format speculators`) as
vLLM's EAGLE-3 drafter and check what a user relies on: greedy output identical to vLLM without speculation, and the
drafts accepted (vLLM's own counters), with tokens/s of both.

    python scripts/vllm_eagle3_check.py --target meta-llama/Llama-3.1-8B-Instruct --draft runs/llama8b-eagle3-vllm \\
        --prompts question.jsonl --limit 80 --max-new-tokens 256

Prints how many outputs are identical token for token (vLLM's bf16 kernels are not batch-invariant, so a rare
difference from rounding is possible even for exact speculation; many differences mean a broken export). Not run in
CI (no GPU, no vLLM); docs/results.md records where it was run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def prompts_from(path: str, limit: int) -> list[str]:
    out = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            out.append(row["turns"][0] if "turns" in row else row["prompt"])
    return out[:limit]


def run(llm, prompts: list[str], max_new_tokens: int) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    outs = llm.chat(messages, params)
    seconds = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="the speculators export of eagle3 heads")
    p.add_argument("--prompts", required=True, help="JSONL with MT-Bench `turns` or `prompt`")
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    args = p.parse_args()

    from vllm import LLM

    prompts = prompts_from(args.prompts, args.limit)
    plain = LLM(model=args.target, enforce_eager=False)
    want, plain_s = run(plain, prompts, args.max_new_tokens)
    del plain
    spec = LLM(model=args.target, speculative_config={"method": "eagle3", "model": args.draft,
                                                      "num_speculative_tokens": args.num_speculative_tokens},
               disable_log_stats=False)
    got, spec_s = run(spec, prompts, args.max_new_tokens)
    metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in spec.get_metrics()
               if "spec_decode" in m.name}
    tokens = sum(len(t) for t in got)
    same = sum(a == b for a, b in zip(got, want))
    print(json.dumps({"prompts": len(prompts), "identical_outputs": same, "tokens": tokens,
                      "plain_tokens_per_s": sum(len(t) for t in want) / plain_s, "eagle3_tokens_per_s": tokens / spec_s,
                      "spec_decode_metrics": metrics}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
