"""The `generate` command line: one prompt through the engine, greedy output equal to the target's.

    python -m inference.generate --heads runs/x --prompt "def fib(n):" --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Literal

from inference.engine.generator import SpeculativeGenerator
from medusa_train.base.errors import ArgumentParser


def parse_tree_budget(value: str, flag: str = "--tree-budget") -> Literal["auto"] | int:
    """`auto` or a number of draft nodes >= 0; ValueError naming `flag` otherwise."""
    if value == "auto":
        return value
    try:
        budget = int(value)
    except ValueError:
        budget = -1
    if budget < 0:
        raise ValueError(f"{flag} must be 'auto' or a number of draft nodes >= 0, got {value!r}")
    return budget


def check_cli_args(args: argparse.Namespace) -> Literal["auto"] | int:
    """Check the generate CLI's arguments (ValueError naming the flag) before any model loads; returns the
    tree budget."""
    from medusa_train.kinds.heads import load_spec

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.lookup_nodes < 0:
        raise ValueError(f"--lookup-nodes must be >= 0 (0: heads only), got {args.lookup_nodes}")
    load_spec(args.heads)  # FileNotFoundError unless it is a heads directory
    return parse_tree_budget(args.tree_budget)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m inference.generate",
                                     description="Generate with trained draft heads (greedy output = the target's).")
    parser.add_argument("--heads", required=True, help="heads directory (config.json + model.safetensors)")
    parser.add_argument("--target", default=None, help="target model path or name (default: the heads' config)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--acceptance", choices=("exact", "typical"), default="exact")
    parser.add_argument("--tree", choices=("auto", "static", "dynamic"), default="auto")
    parser.add_argument("--tree-budget", default="auto", help="draft nodes per step, or 'auto'")
    parser.add_argument("--lookup-nodes", type=int, default=4,
                        help="draft nodes per step n-gram prompt lookup may take from the heads' budget (at most "
                             "half of it; 0: heads only)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    args = parser.parse_args(argv)
    try:  # every argument is checked before the model loads
        budget = check_cli_args(args)
        gen = SpeculativeGenerator.from_pretrained(args.heads, target=args.target, device=args.device,
                                                   lookup_nodes=args.lookup_nodes)
        streamer = None
        if args.stream:
            from transformers import TextStreamer

            streamer = TextStreamer(gen.tokenizer, skip_prompt=True, skip_special_tokens=True)
        out = gen.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, acceptance=args.acceptance, tree=args.tree, tree_budget=budget,
                           streamer=streamer, seed=args.seed, chat=args.chat)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.stream:
        print(out.text)
    print(out.stats.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
