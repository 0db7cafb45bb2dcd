"""Where a speculative step's time goes: drafting, trimming, the verify forward, acceptance, the calibrator's
update, cache compaction, and the drafter's history (`observe`).

Two modes:
- random (default): a random Llama shaped like SmolLM2-135M (hidden 576, 30 layers, vocab 49152) built
  in-process, random heads, one synthetic prompt, up to `--steps` new tokens;
- real (`--target DIR --heads DIR`): a model and trained heads loaded as the benchmark loads them (float32
  linear layers on oneDNN on a CPU), greedy generation on `--prompts` (default: the held-out split of the
  offline default pool, never trained on), stopping at EOS or `--max-new-tokens` as `generate` does.

Each phase of `SpeculativeGenerator.speculative_step` is timed by the step itself (a `PhaseClock` passed in,
which on CUDA synchronises between phases so each phase is charged its own kernels); whole steps are then timed
without the clock. `--budget auto` uses the generator's auto budget and, on a CPU, its calibrated trim.

    python -m inference.profile_step [--device cuda] [--budget 8] [--tree static] [--steps 40] \\
        [--context-layers 1] [--lookup-nodes 4]
    python -m inference.profile_step --target $(python -m medusa_train.target.prepare) --heads runs/x --budget auto
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from inference.engine.drafters import HeadsDrafter, HybridDrafter
from inference.engine.generator import PHASES, PhaseClock, Sampling, SpeculativeGenerator
from inference.engine.kernels import use_onednn_linear
from medusa_train.kinds import KINDS
from medusa_train.target.model import default_device

def smollm2_like(device: str, dtype: torch.dtype, layers: int = 30):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def small_like(device: str, dtype: torch.dtype):
    """The shape of scripts/small_target.py's model (Qwen2, 6 layers, d 384, vocabulary 8192, 12.6M parameters):
    the fast target, where drafting is a large share of a step."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


SHAPES = {"smollm2": smollm2_like, "small": small_like}


def profile_generator(gen: SpeculativeGenerator, prompts: Sequence[torch.Tensor], tree="static",
                      budget: int | str = "auto", max_new_tokens: int = 128, eos: set[int] | None = None,
                      temperature: float = 0.0) -> dict[str, float]:
    """Mean milliseconds per step of each phase and of whole steps, rows verified per step, tau (new tokens
    per target forward) and the budget used, over greedy (or sampled) generation on `prompts`."""
    device = gen.device
    eos = set() if eos is None else eos

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def sampling():
        return Sampling(temperature=temperature,
                        generator=torch.Generator(device=device).manual_seed(0) if temperature else None)

    budget, costs = gen.step_budget(tree, budget)

    def run(ids: torch.Tensor, step) -> tuple[int, int, float]:
        """(steps, new tokens, seconds of the steps) for one prompt."""
        gen.drafter.reset()
        samp = sampling()
        with torch.inference_mode():
            state = gen.prefill(ids.to(device), samp)
            out, steps = 1, 0
            sync()
            t0 = time.perf_counter()
            while out < max_new_tokens and state.tokens[-1] not in eos:
                new = step(state, samp)
                steps, out = steps + 1, out + len(new)
            sync()
        return steps, out, time.perf_counter() - t0

    run(prompts[0], lambda s, samp: gen.speculative_step(s, tree, budget, samp, costs))  # warm-up
    clock = PhaseClock(device)
    timed_steps = 0
    for ids in prompts:
        timed_steps += run(ids, lambda s, samp: gen.speculative_step(s, tree, budget, samp, costs, clock=clock))[0]
    steps, tokens, seconds = 0, 0, 0.0
    for ids in prompts:
        n, out, dt = run(ids, lambda s, samp: gen.speculative_step(s, tree, budget, samp, costs))
        steps, tokens, seconds = steps + n, tokens + out, seconds + dt
    result = {name: 1e3 * clock.seconds[name] / max(timed_steps, 1) for name in PHASES}
    result["step"] = 1e3 * seconds / max(steps, 1)
    result["rows"] = clock.rows / max(timed_steps, 1)
    result["tau"] = tokens / max(steps + len(prompts), 1)  # the prefill decides the first token
    result["budget"] = budget
    result["engine_share_of_verify"] = sum(result[p] for p in PHASES if p != "verify") / max(result["verify"], 1e-9)
    return result


def profile(device: str = "cpu", budget: int | str = 8, tree: str = "static", steps: int = 40, num_heads: int = 4,
            prompt_len: int = 128, temperature: float = 0.0, kind: str = "chained",
            draft_vocab: int = 0, dtype: torch.dtype | None = None, context_layers: int = 0,
            lookup_nodes: int = 0, onednn: bool = True, shape: str = "smollm2") -> dict[str, float]:
    """The random mode: a random model shaped like SmolLM2 (or, `shape="small"`, like the small fast target) and
    random heads, `steps` steps after one synthetic prompt. draft_vocab > 0 gives the heads a reduced scored
    vocabulary (the first draft_vocab ids, standing in for the most frequent tokens); context_layers > 0 gives them
    a context encoder; lookup_nodes > 0 grafts n-gram lookup onto their tree (`HybridDrafter`)."""
    from medusa_train.kinds.heads import DraftHeads

    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    model = SHAPES[shape](device, dtype)
    if onednn:
        use_onednn_linear(model)
    heads = DraftHeads.for_target(model, kind=kind, num_heads=num_heads, context_layers=context_layers,
                                  draft_ids=torch.arange(draft_vocab) if draft_vocab else None)
    drafter = HeadsDrafter(heads, model)
    gen = SpeculativeGenerator(model, None, HybridDrafter(drafter, lookup_nodes=lookup_nodes) if lookup_nodes
                               else drafter)
    ids = (torch.arange(prompt_len, device=device) * 37 + 11)[None] % model.config.vocab_size
    return profile_generator(gen, [ids], tree, budget, max_new_tokens=steps, temperature=temperature)


def profile_trained(target: str, heads: str, prompts: str = "default", limit: int = 8, budget: int | str = "auto",
                    tree: str = "static", max_new_tokens: int = 128, lookup_nodes: int = 4,
                    device: str | None = None, temperature: float = 0.0) -> dict[str, float]:
    """The real mode: `target` and trained `heads` loaded as the benchmark loads them, the first `limit`
    prompts of `prompts` (a benchmark prompt file, or `default`) rendered with the chat template."""
    from inference.bench import load_bench_prompts, render

    gen = SpeculativeGenerator.from_pretrained(heads, target=target, device=device, lookup_nodes=lookup_nodes)
    ids = [render(gen.tokenizer, text) for text in load_bench_prompts(prompts, limit)]
    return profile_generator(gen, ids, tree, budget, max_new_tokens, gen.eos_ids(None), temperature)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--budget", nargs="+", default=["8"], help="draft nodes per step, or `auto`")
    parser.add_argument("--tree", nargs="+", default=["static"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--lookup-nodes", type=int, default=None,
                        help="graft n-gram lookup onto the heads' tree (default: 0 random, 4 real, as generate)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="random mode: model and heads dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    random = parser.add_argument_group("random mode")
    random.add_argument("--steps", type=int, default=40)
    random.add_argument("--shape", default="smollm2", choices=tuple(SHAPES),
                        help="the random model's shape: SmolLM2-135M, or the small fast target (12.6M)")
    random.add_argument("--kind", default="chained", choices=tuple(KINDS))
    random.add_argument("--draft-vocab", type=int, default=0, help="heads score only this many tokens (0: all)")
    random.add_argument("--context-layers", type=int, default=0, help="heads with a context encoder of N layers")
    random.add_argument("--cpu-linear", default="onednn", choices=("onednn", "default"))
    real = parser.add_argument_group("real mode")
    real.add_argument("--target", default=None, help="a model directory or name (with --heads)")
    real.add_argument("--heads", default=None, help="a trained heads directory")
    real.add_argument("--prompts", default="default", help="benchmark prompts (JSONL) or `default`")
    real.add_argument("--limit", type=int, default=8, help="profile the first N prompts")
    real.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    if (args.target is None) != (args.heads is None):
        parser.error("--target and --heads go together (the real mode); give both or neither")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = default_device(args.device)
    for tree in args.tree:
        for b in args.budget:
            budget = b if b == "auto" else int(b)
            if args.heads:
                lookup_nodes = 4 if args.lookup_nodes is None else args.lookup_nodes
                r = profile_trained(args.target, args.heads, args.prompts, args.limit, budget, tree,
                                    args.max_new_tokens, lookup_nodes, device, args.temperature)
                what = f"{args.heads} lookup_nodes={lookup_nodes}"
            else:
                r = profile(device, budget, tree, args.steps, temperature=args.temperature, kind=args.kind,
                            draft_vocab=args.draft_vocab, dtype=getattr(torch, args.dtype) if args.dtype else None,
                            context_layers=args.context_layers, lookup_nodes=args.lookup_nodes or 0,
                            onednn=args.cpu_linear == "onednn", shape=args.shape)
                what = (f"random {args.shape} {args.dtype or 'default dtype'} {args.kind} "
                        f"draft_vocab={args.draft_vocab or 'full'}")
            print(f"{device} {what} tree={tree} budget={b} ({r['budget']}) T={args.temperature}: "
                  + " ".join(f"{k}={r[k]:.2f}ms" for k in PHASES + ("step",))
                  + f" rows={r['rows']:.2f} tau={r['tau']:.2f} engine/verify={100 * r['engine_share_of_verify']:.1f}%",
                  flush=True)


if __name__ == "__main__":
    main()
