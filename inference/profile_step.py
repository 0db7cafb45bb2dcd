"""Where a speculative step's time goes: drafting, the verify forward, acceptance, cache compaction.

Builds a random Llama shaped like SmolLM2-135M (hidden 576, 30 layers, vocab 49152) in-process, random
chained heads, and times each phase of `speculative_step` over many steps (synchronising the device
between phases so each phase is charged its own kernels), plus whole steps without the extra syncs.
On a CPU the float32 linear layers run on oneDNN, as in the benchmark (`--cpu-linear default`: MKL).

    python -m inference.profile_step [--device cuda] [--budget 8] [--tree static] [--steps 40] \
        [--context-layers 1] [--lookup-nodes 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from inference.drafters import DraftContext, HeadsDrafter, HybridDrafter
from inference.generate import Sampling, SpeculativeGenerator
from inference.kernels import use_onednn_linear
from inference.kv import cache_length, compact_cache
from inference.verify import verify_tree


def smollm2_like(device: str, dtype: torch.dtype, layers: int = 30):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def profile(device: str = "cpu", budget: int = 8, tree: str = "static", steps: int = 40, num_heads: int = 4,
            prompt_len: int = 128, temperature: float = 0.0, kind: str = "chained",
            draft_vocab: int = 0, dtype: torch.dtype | None = None, context_layers: int = 0,
            lookup_nodes: int = 0, onednn: bool = True) -> dict[str, float]:
    """Mean milliseconds per step of each phase, and of whole steps. draft_vocab > 0 gives the heads a
    reduced scored vocabulary (the first draft_vocab ids, standing in for the most frequent tokens);
    context_layers > 0 gives them a context encoder (its `observe` is timed as a phase); lookup_nodes > 0
    grafts n-gram lookup onto their tree (`HybridDrafter`)."""
    from medusa_train.heads import DraftHeads

    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model = smollm2_like(device, dtype)
    if onednn:
        use_onednn_linear(model)
    heads = DraftHeads.for_target(model, kind=kind, num_heads=num_heads, context_layers=context_layers,
                                  draft_ids=torch.arange(draft_vocab) if draft_vocab else None)
    drafter = HeadsDrafter(heads, model)
    gen = SpeculativeGenerator(model, None, HybridDrafter(drafter, lookup_nodes=lookup_nodes) if lookup_nodes
                               else drafter)
    sampling = Sampling(temperature=temperature,
                        generator=torch.Generator(device=device).manual_seed(0) if temperature else None)
    ids = (torch.arange(prompt_len, device=device) * 37 + 11)[None] % 49152

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    phases = dict(draft=0.0, verify=0.0, accept=0.0, compact=0.0, observe=0.0)
    with torch.inference_mode():
        state = gen.prefill(ids, sampling)
        for _ in range(3):  # warm up
            gen.speculative_step(state, tree, budget, sampling)
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            draft = gen.drafter.draft(DraftContext(state.root, state.hidden, state.tokens, tree, budget))
            sync()
            t1 = time.perf_counter()
            prefix_len = cache_length(state.cache)
            logits, h = verify_tree(model, state.cache, draft)
            sync()
            t2 = time.perf_counter()
            acc = gen.accept(draft, logits, sampling)
            n, new = acc.to_host(draft)
            t3 = time.perf_counter()
            compact_cache(state.cache, prefix_len, acc.path[:n])
            state.root, state.hidden = acc.bonus.view(1), h[acc.best]
            sync()
            t4 = time.perf_counter()
            if gen.drafter.needs_history:
                gen.drafter.observe(h[acc.path[:n]], torch.cat([draft.tokens[acc.path[1:n]], state.root]))
            state.tokens.extend(new)
            sync()
            t5 = time.perf_counter()
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                phases[name] += dt
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            gen.speculative_step(state, tree, budget, sampling)
        sync()
        whole = time.perf_counter() - t0
    out = {name: 1e3 * total / steps for name, total in phases.items()}
    out["step"] = 1e3 * whole / steps
    out["engine_share_of_verify"] = (out["draft"] + out["accept"] + out["compact"] + out["observe"]) / out["verify"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=int, nargs="+", default=[8])
    parser.add_argument("--tree", nargs="+", default=["static"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--kind", default="chained", choices=("chained", "parallel"))
    parser.add_argument("--draft-vocab", type=int, default=0, help="heads score only this many tokens (0: all)")
    parser.add_argument("--context-layers", type=int, default=0, help="heads with a context encoder of N layers")
    parser.add_argument("--lookup-nodes", type=int, default=0, help="graft n-gram lookup onto the heads' tree")
    parser.add_argument("--cpu-linear", default="onednn", choices=("onednn", "default"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="model and heads dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for tree in args.tree:
        for budget in args.budget:
            r = profile(args.device, budget, tree, args.steps, temperature=args.temperature, kind=args.kind,
                        draft_vocab=args.draft_vocab, dtype=getattr(torch, args.dtype) if args.dtype else None,
                        context_layers=args.context_layers, lookup_nodes=args.lookup_nodes,
                        onednn=args.cpu_linear == "onednn")
            print(f"{args.device} {args.dtype or 'default dtype'} {args.kind} draft_vocab={args.draft_vocab or 'full'} tree={tree} budget={budget} "
                  f"T={args.temperature}: "
                  + " ".join(f"{k}={v:.2f}ms" for k, v in r.items() if k != "engine_share_of_verify")
                  + f" engine/verify={100 * r['engine_share_of_verify']:.1f}%", flush=True)


if __name__ == "__main__":
    main()
