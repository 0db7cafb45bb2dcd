"""Heads fitted for a few seconds to a tiny target's own greedy continuations, and the exactness check run on them:
the kinds that read the target's layers (eagle3, dflash) share both (`tests/test_eagle3.py`, `tests/test_dflash.py`)."""

from __future__ import annotations

import torch
from test_inference_greedy import greedy_reference
from tiny import tiny_tokenizer

from inference import HeadsDrafter, HybridDrafter, SpeculativeGenerator
from medusa_train.config import LossConfig
from medusa_train.kinds.heads import DraftHeads
from medusa_train.train.losses import HeadsObjective
from medusa_train.target.model import target_hidden


def fitted(model, heads: DraftHeads, iters: int, lr: float = 3e-3) -> tuple[DraftHeads, torch.Tensor]:
    """`heads` trained `iters` steps (soft labels, a block after every position for dflash) on the model's greedy
    continuations of six random prompts (returned with them), so that drafting after those prompts is accepted often
    and the exactness checks cross accepted paths, not only roots."""
    torch.manual_seed(0)
    prompts = torch.randint(0, 256, (6, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        rows = model.generate(prompts, do_sample=False, max_new_tokens=40, min_new_tokens=40,
                              attention_mask=torch.ones_like(prompts), pad_token_id=259, eos_token_id=[])
    feats = target_hidden(model, rows, None, heads.target_layers)
    labels = rows.clone()
    labels[:, :4] = -100
    objective = HeadsObjective(heads, LossConfig(distill_weight=1.0, ce_weight=0.0, decay=0.8, chunk_size=512))
    opt = torch.optim.Adam(heads.parameters(), lr=lr)
    greedy = model.get_output_embeddings()(feats[..., :model.config.hidden_size]).argmax(-1)
    for _ in range(iters):
        loss, _ = objective(feats, greedy, rows, labels, None, model.get_input_embeddings(),
                            model.get_output_embeddings())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return heads, prompts


def exact_on_every_tree(model, heads: DraftHeads, prompt: torch.Tensor, max_new: int = 40) -> list[float]:
    """Greedy output equal to the model's own with these heads alone and with lookup grafted on, over static, dynamic,
    one-node, auto and explicit trees (asserted); the tau of each run."""
    want = greedy_reference(model, prompt, max_new, eos_token_id=[])
    taus = []
    for drafter in (HeadsDrafter(heads, model), HybridDrafter(HeadsDrafter(heads, model), lookup_nodes=2)):
        gen = SpeculativeGenerator(model, tiny_tokenizer(), drafter)
        for tree, budget in (("static", 6), ("dynamic", 6), ("static", 1), ("static", "auto"), ([(0,), (0, 0)], 2)):
            out = gen.generate(prompt, max_new_tokens=max_new, tree=tree, tree_budget=budget, eos_token_id=[])
            assert out.token_ids.tolist() == want.tolist(), (tree, budget)
            taus.append(out.stats.tau)
    return taus
