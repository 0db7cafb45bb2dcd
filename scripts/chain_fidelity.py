"""Does the engine accept what the heads predict? Generate with a top-1 chain (one draft per head, heads alone)
on chat prompts, then run the heads' training forward once over each final sequence and predict every step's
accept length from its teacher-forced top-1 guesses at that step's position. Prints how many steps disagree
(0 when drafting is right), the mean accept length at the engine's steps, and the chain's expected accept
length over every position of the same sequences (what held-out evaluation reports; steps start after a
miss more often than a random position does, so the two differ). docs/history.md,
"Where the held-out tau goes"; tests/test_context_heads.py checks the same on tiny models.

    python scripts/chain_fidelity.py --heads runs/s19/heads-wd --target $(python -m medusa_train.target.prepare) \\
        --prompts question.jsonl [--stride 1] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json

import torch

from inference.bench import load_bench_prompts
from inference.engine.generator import SpeculativeGenerator
from medusa_train.target.model import target_hidden


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True)
    p.add_argument("--target", default=None)
    p.add_argument("--prompts", required=True, help="JSONL with `prompt` or MT-Bench `turns` (first turn)")
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()

    gen = SpeculativeGenerator.from_pretrained(args.heads, target=args.target, dtype="float32", lookup_nodes=0)
    model, heads = gen.target, gen.drafter.heads
    K = gen.drafter.max_depth
    chain = [[0] * d for d in range(1, K + 1)]
    engine, predicted, every = [], [], []
    torch.set_grad_enabled(False)
    for prompt in load_bench_prompts(args.prompts, stride=args.stride):
        ids = gen.encode(prompt, chat=True)
        out = gen.generate(ids, max_new_tokens=args.max_new_tokens, tree=chain, tree_budget=K)
        seq = torch.cat([ids[0], out.token_ids.to(ids.device)])[None]
        states = heads(target_hidden(model, seq, torch.ones_like(seq)).float(), seq, model.get_input_embeddings())
        top = torch.stack([heads.to_target_ids(heads.logits(k, states[k], model.get_output_embeddings()).argmax(-1))[0]
                           for k in range(K)])  # [K, L]: head k at position t guesses seq[t + 2 + k]
        L = seq.shape[1]

        def accept(n: int) -> int:  # committed length n: root seq[n-1], s_0 from h at n-2, head k guesses seq[n+k]
            a = 1
            while a <= K and n + a - 1 < L and top[a - 1, n - 2] == seq[0, n + a - 1]:
                a += 1
            return a

        n = ids.shape[1] + 1
        for a in out.stats.accept_lengths:
            if n + K < L:  # steps not cut short by max_new_tokens
                engine.append(a)
                predicted.append(accept(n))
            n += a
        every += [accept(n) for n in range(ids.shape[1] + 1, L - K)]
    print(json.dumps({"steps": len(engine), "steps_disagreeing": sum(a != b for a, b in zip(engine, predicted)),
                      "mean_accept_at_engine_steps": round(sum(engine) / len(engine), 4),
                      "teacher_forced_at_engine_steps": round(sum(predicted) / len(predicted), 4),
                      "teacher_forced_every_position": round(sum(every) / len(every), 4), "positions": len(every)}))


if __name__ == "__main__":
    main()
