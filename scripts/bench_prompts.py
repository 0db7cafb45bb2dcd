"""The first turns of a benchmark prompt file rendered through the target's chat template, as a JSON list of token
ids: what `scripts/vllm_serve_bench.py` feeds vLLM, so it and our engine (`inference.bench`) see the same tokens.

    python scripts/bench_prompts.py PROMPTS.jsonl LIMIT TARGET OUT.json [STRIDE]

STRIDE keeps every STRIDE-th prompt before LIMIT (`inference.bench --stride`): MT-Bench is ordered by category.
"""

import json
import sys

from transformers import AutoTokenizer

from inference.bench import load_bench_prompts, render

source, limit, target, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
stride = int(sys.argv[5]) if len(sys.argv) > 5 else 1
tok = AutoTokenizer.from_pretrained(target)
json.dump([render(tok, t)[0].tolist() for t in load_bench_prompts(source, limit, stride)], open(out, "w"))
