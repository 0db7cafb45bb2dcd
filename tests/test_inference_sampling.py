"""Lossless sampling through `generate`: the first generated tokens follow the target's own distribution.

An integration check of the whole loop (prefill, drafting, tree verify, acceptance, cache compaction, the next
root): a tiny Llama with a 4-token vocabulary makes the exact joint distribution of the first three new tokens
(64 outcomes) cheap to enumerate; we draw it 1,500 times through `generate` with different seeds and run a
chi-square goodness-of-fit test at p = 1e-5 (fixed seeds, so deterministic). At this sample size it catches
gross errors, such as Medusa's typical acceptance (more than 5x the threshold) or a loop that drops or repeats
tokens, not a sampler off by a few percent: the acceptance rule and `sample_token` are proven exactly, and with
high-powered batched draws, in test_acceptance_exact.py.

The drafts come from a tree whose siblings cover most of the vocabulary, so every branch of the rejection
sampler runs: accepting the 1st, 2nd or 3rd candidate, accepting at depth 1..3, rejecting all siblings and
sampling the residual, and (with duplicate candidates) a repeated sibling.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from inference import HeadsDrafter, HybridDrafter, NGramDrafter, SpeculativeGenerator, TreeDrafter
from medusa_train.kinds.heads import DraftHeads

V = 4
N_TOKENS = 3
PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]
PROMPT = torch.tensor([[1, 3, 0, 2, 2]])



def small_vocab_model(seed: int = 0, logit_scale: float = 6.0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config).eval().double()
    with torch.no_grad():  # spread the logits so outcomes range from rare to common
        model.lm_head.weight.mul_(logit_scale)
    return model


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The target's sampling distribution, computed with transformers' own warpers."""
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].float())
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1)[0].double()


@torch.no_grad()
def exact_joint(model, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """p(x1, x2, x3 | prompt) by enumeration: [V, V, V]."""
    def dist(prefix: list[int]) -> torch.Tensor:
        ids = torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long)], 1) if prefix else PROMPT
        return warp(model(ids).logits[0, -1], temperature, top_p)

    joint = torch.zeros(V, V, V, dtype=torch.float64)
    p1 = dist([])
    for a in range(V):
        p2 = dist([a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * dist([a, b])
    return joint


def empirical_counts(gen: SpeculativeGenerator, n: int, tree=PATHS, tree_budget: int = 0, **kw) -> torch.Tensor:
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for seed in range(n):
        out = gen.generate(PROMPT, max_new_tokens=N_TOKENS, seed=seed, tree=tree, tree_budget=tree_budget,
                           eos_token_id=[], **kw)
        a, b, c = out.token_ids.tolist()
        counts[a, b, c] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, threshold at p = 1e-5). Outcomes expected fewer than 5 times are pooled into one bin."""
    n = counts.sum()
    expected, observed = (probs * n).flatten(), counts.flatten()
    small = expected < 5
    e = torch.cat([expected[~small], expected[small].sum().view(1)])
    o = torch.cat([observed[~small], observed[small].sum().view(1)])
    keep = e > 0
    assert not (o[~keep] > 0).any(), "an outcome of probability 0 was generated"
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    z = 4.265  # standard normal quantile at 1 - 1e-5; Wilson-Hilferty approximation of the chi2 quantile
    threshold = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, threshold


class FixedCandidates(TreeDrafter):
    """Proposes the same ranked candidates after every node, repeats included ([2, 2, 0] has a duplicate)."""

    def __init__(self, candidates: list[int], max_depth: int = 3):
        super().__init__()
        self.candidates, self.max_depth = candidates, max_depth

    def propose(self, k, tokens, states, num):
        cand = torch.tensor(self.candidates[:num], device=tokens.device).expand(tokens.shape[0], -1)
        return cand, torch.zeros(cand.shape, device=tokens.device), None


def heads_generator(model, kind: str = "chained") -> SpeculativeGenerator:
    heads = DraftHeads.for_target(model, kind=kind, num_heads=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return SpeculativeGenerator(model, None, HeadsDrafter(heads, model))


def test_lossless_sampling_matches_target_distribution():
    model = small_vocab_model()
    probs = exact_joint(model)
    gen = heads_generator(model)
    counts = empirical_counts(gen, 1500, temperature=1.0)
    stat, threshold = chi_square(counts, probs)
    assert stat < threshold, (stat, threshold)


def test_lossless_sampling_with_eagle3_heads():
    """eagle3 heads: their own attention over committed positions and tree paths, fed the sampled tokens."""
    model = small_vocab_model(seed=3)
    probs = exact_joint(model)
    counts = empirical_counts(heads_generator(model, "eagle3"), 1500, tree="static", tree_budget=5, temperature=1.0)
    stat, threshold = chi_square(counts, probs)
    assert stat < threshold, (stat, threshold)


def test_lossless_sampling_with_dflash_heads():
    """dflash heads: one block forward per step over their own context cache, the block read as every depth's
    distribution, fed the sampled tokens; a dynamic tree."""
    model = small_vocab_model(seed=4)
    probs = exact_joint(model)
    counts = empirical_counts(heads_generator(model, "dflash"), 1500, tree="dynamic", tree_budget=5, temperature=1.0)
    stat, threshold = chi_square(counts, probs)
    assert stat < threshold, (stat, threshold)


def test_lossless_sampling_with_dspark_heads():
    """dspark heads: dflash's block, then each node's Markov bias from its own (sampled) parent token; a static tree,
    so siblings' children differ."""
    model = small_vocab_model(seed=5)
    probs = exact_joint(model)
    counts = empirical_counts(heads_generator(model, "dspark"), 1500, tree="static", tree_budget=5, temperature=1.0)
    stat, threshold = chi_square(counts, probs)
    assert stat < threshold, (stat, threshold)


def test_lossless_with_temperature_top_p_and_repeated_candidates():
    model = small_vocab_model(seed=1)
    probs = exact_joint(model, temperature=0.7, top_p=0.8)
    assert (probs == 0).sum() > 8  # top_p really cuts something
    gen = SpeculativeGenerator(model, None, FixedCandidates([2, 2, 0]))
    counts = empirical_counts(gen, 1500, temperature=0.7, top_p=0.8)
    stat, threshold = chi_square(counts, probs)
    assert stat < threshold, (stat, threshold)


def test_lossless_with_lookup_grafted_onto_the_heads_tree():
    """HybridDrafter: n-gram continuations (which depend on what was sampled so far) hang under the root
    next to, and merged with, the heads' candidates; the distribution stays the target's."""
    model = small_vocab_model(seed=2)
    probs = exact_joint(model)
    gen = heads_generator(model)
    gen.drafter = HybridDrafter(gen.drafter, NGramDrafter(max_ngram=2, max_depth=3, branches=2), lookup_nodes=3)
    primary_budgets = []
    draft = gen.drafter.primary.draft
    gen.drafter.primary.draft = lambda ctx: primary_budgets.append(ctx.budget) or draft(ctx)
    counts = empirical_counts(gen, 1500, tree="static", tree_budget=6, temperature=1.0)
    stat, threshold = chi_square(counts, probs)
    assert stat < threshold, (stat, threshold)
    assert min(primary_budgets) < 6  # the lookup took part of the budget on some steps


def test_typical_acceptance_is_lossy():
    """Medusa's typical acceptance takes any drafted token that is likely enough, so drafted tokens are
    over-represented: the same test rejects its distribution by a wide margin."""
    model = small_vocab_model()
    probs = exact_joint(model)
    gen = heads_generator(model)
    counts = empirical_counts(gen, 500, temperature=1.0, acceptance="typical")
    stat, threshold = chi_square(counts, probs)
    assert stat > 5 * threshold, (stat, threshold)


def test_same_seed_same_sample_and_seeds_differ():
    model = small_vocab_model()
    gen = heads_generator(model)
    kw = dict(max_new_tokens=8, temperature=1.0, eos_token_id=[], tree="static", tree_budget=6)
    a = gen.generate(PROMPT, seed=7, **kw).token_ids
    b = gen.generate(PROMPT, seed=7, **kw).token_ids
    assert a.tolist() == b.tolist()
    assert len({tuple(gen.generate(PROMPT, seed=s, **kw).token_ids.tolist()) for s in range(8)}) > 1


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_trees_never_ask_for_more_candidates_than_the_vocabulary(tree):
    model = small_vocab_model()
    gen = heads_generator(model)
    out = gen.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=0, tree=tree, tree_budget=40, eos_token_id=[])
    assert len(out.token_ids) == 6
    with pytest.raises(ValueError, match="rank 5.*at most 4"):
        gen.generate(PROMPT, max_new_tokens=6, tree=[(5,)])


def capped_or_scaled_model(model_type: str):
    """A 4-token Gemma-2 whose soft cap (final_logit_softcapping) squashes its logits to +-1.5, or a Cohere whose
    logit_scale multiplies them by 0.25: the model's own logits are far from `lm_head(h)`, so a sampler that forgets
    the transform draws from another distribution."""
    from transformers import CohereConfig, Gemma2Config

    torch.manual_seed(4)
    common = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=False)
    config = (Gemma2Config(head_dim=8, final_logit_softcapping=1.5, **common) if model_type == "gemma2"
              else CohereConfig(logit_scale=0.25, **common))
    model = AutoModelForCausalLM.from_config(config).eval().double()
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)
    return model


@pytest.mark.parametrize("model_type", ["gemma2", "cohere"])
def test_lossless_sampling_applies_the_models_final_logit_transform(model_type):
    model = capped_or_scaled_model(model_type)
    h = model.model(PROMPT).last_hidden_state[0, -1]
    raw, own = model.lm_head(h), model(PROMPT).logits[0, -1]
    # the transform is far from the identity here: the next token's distribution moves by more than 0.15 (total
    # variation), which 1,500 draws tell apart many times over
    assert (torch.softmax(raw, -1) - torch.softmax(own, -1)).abs().sum() / 2 > 0.15
    probs = exact_joint(model)  # from the model's own logits
    counts = empirical_counts(heads_generator(model), 1500, temperature=1.0)
    stat, threshold = chi_square(counts, probs)
    assert stat < threshold, (stat, threshold)
