"""The oracle benchmark: how much of the ideal speedup the engine keeps, with no trained heads at all.

An oracle drafter proposes the target's own greedy continuation (known from a plain run first), so every drafted
token is accepted and a chain of B draft nodes yields B + 1 tokens per verify. Were the engine free, a step would
cost one verify forward over B + 1 rows, and plain decoding one forward over 1 row, so the speedup could reach

    ceiling(B) = tau x t_verify(1) / t_verify(B + 1)

with tau the measured tokens per target forward and t_verify the target's forward times after a prefix, both
measured in the same run. The efficiency is the measured speedup over plain `generate` divided by that ceiling:
what drafting, acceptance, cache compaction and the rest of the loop leave of it (1.0: nothing lost). Plain
`generate` has costs of its own beyond one forward, so the efficiency can pass 1; `verify_share`, the verify
forward's share of an engine step (t_verify(B + 1) over the measured seconds per step), reads the engine alone.

    python -m inference.oracle --target $(python -m medusa_train.target.prepare) --budgets 1,2,4,8 --limit 4
    python -m inference.oracle --shape smollm2 --budgets 1,2,4,8            # random weights, any machine
    python -m inference.oracle --shape llama-8b --device cuda --dtype bfloat16 --budgets 1,2,4,8,16,32

Random-weight targets (`--shape`) need no download: their greedy text is meaningless, which changes nothing
here. Every output is checked against plain decoding token for token (`exact_match`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

from inference.engine.drafters import DraftContext, TreeDrafter
from medusa_train.base.errors import ArgumentParser

SHAPES = {  # name: (LlamaConfig fields) of random-weight targets shaped like real ones
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0),
    "small": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                     rope_theta=500000.0),
}


class OracleDrafter(TreeDrafter):
    """Proposes the target's greedy continuation: after a node at depth k on the true path, the true next token
    at rank 0 (and, for wider trees, wrong fillers after it). `truths` maps each prompt (a tuple of ids) to its
    full greedy sequence, prompt included; the generated text is the target's, so the committed tokens are
    always a prefix of one of them."""

    def __init__(self, truths: dict[tuple[int, ...], list[int]], vocab: int, max_depth: int):
        super().__init__()
        self.truths, self.vocab, self.max_depth = truths, vocab, max_depth
        self.truth: list[int] = []
        self.base = 0

    def draft(self, ctx: DraftContext):
        if not self.truth or self.truth[:len(ctx.tokens)] != ctx.tokens:
            self.truth = next(t for p, t in self.truths.items() if list(p) == ctx.tokens[:len(p)])
        self.base = len(ctx.tokens)  # truth[base + k] follows a depth-k node on the true path
        return super().draft(ctx)

    def propose(self, k, tokens, states, num):
        pos = self.base + k
        true = self.truth[pos] if pos < len(self.truth) else 0
        cand = torch.tensor([true] + [(true + 1 + j) % self.vocab for j in range(num - 1)], device=tokens.device)
        m = tokens.shape[0]
        logq = -torch.arange(num, dtype=torch.float32, device=tokens.device)
        return cand.expand(m, num), logq.expand(m, num), None


def random_target(shape: str, device: torch.device, dtype: torch.dtype, max_positions: int = 4096) -> nn.Module:
    """A random-weight Llama-architecture model shaped like `shape` (SHAPES)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=max_positions, **SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def chain(budget: int) -> list[tuple[int, ...]]:
    """The rank paths of a chain of `budget` draft nodes, all rank 0."""
    return [(0,) * d for d in range(1, budget + 1)]


def run_oracle(target: nn.Module, prompts: Sequence[torch.Tensor], budgets: Sequence[int], max_new_tokens: int,
               tokenizer=None, pad_token_id: int | None = None, repeats: int = 1, log=None,
               compile: bool | str = False) -> dict:
    """Plain `generate` first (the reference and each prompt's truth), then the engine with the oracle at every
    budget, interleaved per prompt. Returns {"budgets": {B: {tau, tokens_per_s, speedup, ceiling, efficiency,
    verify_share, exact_match}}, "ar_tokens_per_s", "t_verify_ms": {rows: ms}}. `compile`: the engine verifies
    through its compiled path, and plain decoding runs compiled too (`ar-compiled`, transformers' static cache and
    torch.compile): the efficiency is then against that, the fastest plain decoding, and `speedup_eager` is over
    eager `generate`."""
    from inference.bench import engine_runner, hf_runner, run_benchmark
    from inference.engine.generator import SpeculativeGenerator

    vocab = target.get_output_embeddings().weight.shape[0]
    device = target.get_output_embeddings().weight.device
    ar = hf_runner(target, pad_token_id)
    truths: dict[tuple[int, ...], list[int]] = {}
    for ids in prompts:
        # the truth runs past max_new_tokens by the deepest chain, so the last step's drafts are right too
        out = ar(ids, max_new_tokens + max(budgets) + 1)
        truths[tuple(ids[0].tolist())] = ids[0].tolist() + out.tokens
    runners = {"ar": ar}
    if compile:
        runners["ar-compiled"] = hf_runner(target, pad_token_id, compiled=True)
    generators = {}
    for b in budgets:
        gen = SpeculativeGenerator(target, tokenizer, OracleDrafter(truths, vocab, b), compile=compile)
        generators[b] = gen
        runners[f"oracle-{b}"] = engine_runner(gen, chain(b), b)
    summary = run_benchmark(runners, [p.to(device) for p in prompts], max_new_tokens, repeats, 1, log)
    costs = generators[budgets[0]].verify_costs()  # [rows] seconds, measured once per target
    base = "ar-compiled" if compile else "ar"
    result = {"ar_tokens_per_s": summary["ar"]["tokens_per_s"], "budgets": {},
              "t_verify_ms": {n: 1e3 * costs[n] for n in range(1, len(costs))}}
    if compile:
        result["ar_compiled_tokens_per_s"] = summary[base]["tokens_per_s"]
        result["ar_compiled_exact_match"] = summary[base]["exact_match"]
    for b in budgets:
        m = summary[f"oracle-{b}"]
        t_tree = costs[min(b + 1, len(costs) - 1)]
        ceiling = m["tau"] * costs[1] / t_tree
        step_seconds = m["tau"] / m["tokens_per_s"]  # one target forward per step (the prefill counted as one)
        speedup = m["tokens_per_s"] / summary[base]["tokens_per_s"]
        result["budgets"][b] = {"tau": m["tau"], "tokens_per_s": m["tokens_per_s"], "speedup": round(speedup, 3),
                                "ceiling": round(ceiling, 3), "efficiency": round(speedup / ceiling, 3),
                                "verify_share": round(t_tree / step_seconds, 3), "exact_match": m["exact_match"]}
        if compile:
            result["budgets"][b]["speedup_eager"] = m["speedup"]
    return result


def format_table(result: dict) -> str:
    lines = [f"{'budget':>6} {'tau':>6} {'tokens/s':>9} {'speedup':>8} {'ceiling':>8} {'efficiency':>10} "
             f"{'verify share':>12}  exact"]
    for b, m in result["budgets"].items():
        lines.append(f"{b:>6} {m['tau']:>6.2f} {m['tokens_per_s']:>9.1f} {m['speedup']:>7.2f}x {m['ceiling']:>7.2f}x "
                     f"{m['efficiency']:>10.2f} {m['verify_share']:>12.2f}  {'yes' if m['exact_match'] else 'NO'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m inference.oracle", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="a model directory or hub name (else --shape)")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="a random-weight target of this shape")
    p.add_argument("--budgets", default="1,2,4,8", help="comma list of chain lengths (draft nodes per step)")
    p.add_argument("--prompts", default="default", help="real targets: benchmark prompts (as inference.bench)")
    p.add_argument("--limit", type=int, default=4, help="prompts (random targets: random prompts of --prompt-len)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--compile", action="store_true", help="the engine's compiled path against transformers' compiled "
                                                          "plain decoding (static cache, torch.compile)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    try:  # every argument checked before a model loads
        if (args.target is None) == (args.shape is None):
            raise ValueError("give exactly one of --target (a model) and --shape (random weights)")
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        if not budgets or min(budgets) < 1:
            raise ValueError(f"--budgets must be a comma list of integers >= 1, got {args.budgets!r}")
        for flag, value in (("--limit", args.limit), ("--prompt-len", args.prompt_len),
                            ("--max-new-tokens", args.max_new_tokens), ("--repeats", args.repeats)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from inference.bench import describe_prompts, load_bench_prompts, machine_description, render
    from inference.engine.kernels import use_onednn_linear
    from medusa_train.base.files import write_json
    from medusa_train.target.model import default_device, pad_id, resolve_dtype

    device = default_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    tokenizer, pad = None, None
    if args.shape:
        target = random_target(args.shape, device, dtype)
        g = torch.Generator().manual_seed(0)
        vocab = SHAPES[args.shape]["vocab_size"]
        prompts = [torch.randint(0, vocab, (1, args.prompt_len), generator=g) for _ in range(args.limit)]
        what = f"random {args.shape}-shaped target"
        prompt_set = f"{args.limit} random prompts of {args.prompt_len} tokens"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
        texts = load_bench_prompts(args.prompts, args.limit)
        prompts = [render(tokenizer, t) for t in texts]
        pad = pad_id(tokenizer)
        what, prompt_set = str(args.target), describe_prompts(args.prompts, len(prompts))
    use_onednn_linear(target)  # float32 on a CPU: what the benchmark uses for every method
    with torch.inference_mode():
        result = run_oracle(target, prompts, budgets, args.max_new_tokens, tokenizer, pad, args.repeats, log,
                            compile=args.compile)
    result = {"machine": machine_description(device), "target": what, "dtype": str(dtype).removeprefix("torch."),
              "prompt_set": prompt_set, "max_new_tokens": args.max_new_tokens, "compiled": args.compile} | result
    compiled = f", compiled {result['ar_compiled_tokens_per_s']:.1f}" if args.compile else ""
    print(f"\n{result['machine']}\n{what}, {result['dtype']}; {prompt_set}; {args.max_new_tokens} new tokens; "
          f"plain generate {result['ar_tokens_per_s']:.1f} tokens/s{compiled}\n")
    print(format_table(result))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
