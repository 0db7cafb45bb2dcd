"""The acceptance statistics (`acceptance.json`, which shapes the engine's static trees and its auto budget) and
the target's greedy tokens the loss and the statistics compare against, each checked against a reference
written position by position here, on data where the data token and the target's greedy token often disagree.
"""

from __future__ import annotations

import pytest
import torch
from test_inference_greedy import float64_model, greedy_reference

from medusa_train.config import LossConfig
from medusa_train.train.evaluate import MAX_RANK, acceptance_from_hits, conditional_rank_hits, evaluate
from medusa_train.kinds.heads import DraftHeads
from medusa_train.target.model import target_hidden
from medusa_train.target.states import TargetStates

K = 3


def fitted_heads(model, seq: torch.Tensor, mask: torch.Tensor) -> DraftHeads:
    """Chained heads fitted to the target's greedy tokens of these rows until head 1 is right about half the
    time: right paths of every length, and misses, both occur."""
    heads = DraftHeads.for_target(model, "chained", K).double()
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.no_grad():
        h = target_hidden(model, seq, mask)
        greedy = model(input_ids=seq, attention_mask=mask).logits.argmax(-1)
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0), dtype=p.dtype))
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    for _ in range(300):
        states = heads(h, seq, embed)
        logits = [heads.logits(k, states[k], lm_head)[:, :-1 - k] for k in range(K)]
        if (logits[0].argmax(-1) == greedy[:, 1:]).double().mean() >= 0.5:
            break
        loss = sum(torch.nn.functional.cross_entropy(logits[k].flatten(0, 1), greedy[:, 1 + k:].flatten())
                   for k in range(K))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


def reference_hits(heads, model, ids, labels, mask) -> torch.Tensor:
    """[K, MAX_RANK + 1] summed over the batch, straight from the definition: head k (0-based) at position t is
    scored when x_{t+2+k} is supervised and attended (and t attended), and every head j < k was scored there
    and right, its top-1 equal to the target's greedy token g_{t+1+j} *and* to the data token x_{t+2+j} (what
    the engine would have fed head j+1). Column r counts g_{t+1+k} being exactly head k's (r+1)-th candidate."""
    with torch.no_grad():
        h = target_hidden(model, ids, mask)
        greedy = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)  # g_u: the target's token after u
        states = heads(h, ids, model.get_input_embeddings())
        ranked = [torch.argsort(heads.logits(k, states[k], model.get_output_embeddings()), -1, descending=True)
                  for k in range(K)]
    B, T = ids.shape
    hits = torch.zeros(K, MAX_RANK + 1)
    for b in range(B):
        for t in range(T):
            right_so_far = True
            for k in range(K):
                u = t + 2 + k
                if not right_so_far or u >= T or not (mask[b, t] and mask[b, u] and labels[b, u] != -100):
                    break
                g = int(greedy[b, t + 1 + k])
                candidates = heads.to_target_ids(ranked[k][b, t]).tolist()
                hits[k, MAX_RANK] += 1
                if g in candidates[:MAX_RANK]:
                    hits[k, candidates.index(g)] += 1
                right_so_far = candidates[0] == g and int(ids[b, u]) == g
    return hits


def test_acceptance_statistics_equal_the_position_by_position_reference():
    """Planted in `conditional_rank_hits`, each fails this test: a path that stays right when the data token
    differs from the target's token (only the head's top-1 checked), a greedy token one position off, and
    head k counted where head k-1 was not scored."""
    model = float64_model("llama", seed=6)
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, 256, (3, 6), generator=gen)
    rows = [torch.cat([p, greedy_reference(model, p[None], 26, eos_token_id=[])]) for p in prompts]
    ids = torch.stack(rows)  # [3, 32]: the target's own continuations ...
    flip = torch.rand(ids.shape, generator=gen) < 0.25
    ids = torch.where(flip, torch.randint(0, 256, ids.shape, generator=gen), ids)  # ... a quarter replaced
    mask = torch.ones_like(ids)
    mask[2, 27:] = 0  # a padded row
    labels = ids.clone()
    labels[:, :6] = -100  # the prompts are not supervised
    labels[1, 15:18] = -100  # nor a span in the middle (a later turn's prompt)
    labels[mask == 0] = -100
    heads = fitted_heads(model, ids, mask)
    want = reference_hits(heads, model, ids, labels, mask)

    h, greedy = TargetStates(model, model.get_output_embeddings())({"input_ids": ids, "attention_mask": mask})
    states = heads(h, ids, model.get_input_embeddings())
    got = conditional_rank_hits(heads, states, greedy, ids, labels, mask, model.get_output_embeddings(),
                                chunk_size=7).sum(0)
    assert torch.equal(got, want)
    assert want[K - 1, MAX_RANK] > 0 and want[0, 0] < want[0, MAX_RANK]  # deep paths and misses both occur

    # and through `evaluate`, the function the trainer writes acceptance.json with
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    _, acceptance = evaluate(heads, model, [batch], LossConfig())
    reference = acceptance_from_hits(want, budgets=(4, 8, 64))  # evaluate's default budgets
    assert {k: acceptance[k] for k in reference} == reference
    p = [float(want[k, 0]) / float(want[k, MAX_RANK]) for k in range(K)]
    assert acceptance["expected_tau"] == pytest.approx(1 + p[0] + p[0] * p[1] + p[0] * p[1] * p[2], rel=1e-12)


def test_greedy_tokens_are_the_targets_with_and_without_the_cache():
    """`TargetStates` gives the target's argmax at every attended position (0 past a row's end), computed or
    read back from the hidden-state cache in a later epoch: the accuracies and a draft vocabulary's soft
    labels rest on them."""
    model = float64_model("qwen2", seed=8)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    want = model(input_ids=ids, attention_mask=mask).logits.argmax(-1) * mask
    lm_head = model.get_output_embeddings()
    for states in (TargetStates(model, lm_head), TargetStates(model, lm_head, cache=True)):
        for _ in range(2):  # the second call reads the cache when there is one
            h, greedy = states(batch)
            assert torch.equal(greedy, want)
            assert torch.allclose(h[mask.bool()], target_hidden(model, ids, mask)[mask.bool()])
