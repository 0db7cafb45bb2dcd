"""Continuous batching for distillation (`medusa_train.data.batch_decode`): rows leave when they stop and prompts join
as slots free up, over one left-padded cache, and every prompt still gets what the model generates for it alone."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_model
from transformers import DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from medusa_train.data.batch_decode import _sample, _top_p, decode

STOPS = list(range(3, 40))  # about one token in seven stops a row: rows end at every step, slots refill


def _prompts(n: int = 13, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(40, 250) for _ in range(rng.randrange(2, 20))] for _ in range(n)]


def _alone(model, prompt: list[int], max_new: int) -> tuple[list[int], bool]:
    seq = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=STOPS, pad_token_id=0)[0, len(prompt):].tolist()
    stop = next((k for k, t in enumerate(seq) if t in STOPS), None)
    return (seq if stop is None else seq[:stop]), stop is not None


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])  # mistral: a sliding-window cache, generate() batches
def test_greedy_rows_are_what_the_model_writes_for_each_prompt_alone(arch):
    model = tiny_model(arch, seed=1)
    prompts = _prompts()
    got = {i: (t, s) for i, t, s in decode(model, prompts, max_new_tokens=12, stops=STOPS, pad_id=0, batch_size=4)}
    assert sorted(got) == list(range(len(prompts)))
    assert {i: _alone(model, p, 12) for i, p in enumerate(prompts)} == got
    stopped = sum(s for _, s in got.values())
    assert 0 < stopped < len(prompts)  # both endings occur: the stop token and the length limit


def test_rows_join_and_leave_a_spliced_cache():
    """The plain-cache path really splices: prompts join a batch in flight (a prefill while others decode) and
    columns no row attends to are cut, with the same tokens as each prompt alone."""
    model = tiny_model("llama", seed=1)
    assert all(type(layer).__name__ == "DynamicLayer" for layer in DynamicCache(config=model.config).layers)
    prompts = _prompts(24, seed=2)
    calls = []
    forward = model.forward

    def spy(*a, **kw):
        cache = kw.get("cache", kw.get("past_key_values"))
        calls.append((kw["input_ids"].shape, cache.get_seq_length()))
        return forward(*a, **kw)

    model.forward = spy
    got = {i: (t, s) for i, t, s in decode(model, prompts, max_new_tokens=10, stops=STOPS, pad_id=0, batch_size=8)}
    model.forward = forward
    assert got == {i: _alone(model, p, 10) for i, p in enumerate(prompts)}
    prefills = [shape for shape, _ in calls if shape[1] > 1]
    assert len(prefills) > 2 and max(b for b, _ in prefills) <= 8  # refills, never more than the slots
    lengths = [n for shape, n in calls if shape[1] == 1]
    assert any(b < a for a, b in zip(lengths, lengths[1:]))  # the cache got shorter: padding columns were cut


def test_a_sampled_row_does_not_depend_on_its_batch():
    """Each prompt samples from a generator of its own: alone or among others, it draws the same tokens."""
    model = tiny_model("llama", seed=1)
    prompts = _prompts(9, seed=3)
    seeds = [100 + i for i in range(len(prompts))]
    kw = dict(max_new_tokens=10, stops=STOPS, pad_id=0, temperature=0.9, top_p=0.9, seeds=seeds)
    together = {i: t for i, t, _ in decode(model, prompts, batch_size=4, **kw)}
    alone = {i: t for i, t, _ in decode(model, prompts, batch_size=1, **kw)}
    assert together == alone
    other = {i: t for i, t, _ in decode(model, prompts, batch_size=4, **kw | {"seeds": [s + 1 for s in seeds]})}
    assert other != together
    with pytest.raises(ValueError, match="one seed per prompt"):
        next(decode(model, prompts, max_new_tokens=2, stops=STOPS, pad_id=0, temperature=1.0))


@pytest.mark.parametrize("vocab,scale", [(50, 3.0), (5000, 6.0), (5000, 0.5)])  # small; peaked; flat (full sort)
def test_nucleus_probabilities_match_transformers(vocab, scale):
    torch.manual_seed(0)
    logits = torch.randn(5, vocab) * scale
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (1.0, 0.95), (1.0, 0.01)]:
        warped = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
        mine, theirs = _top_p(logits, temperature, top_p), torch.softmax(warped, -1)
        # the same nucleus; over thousands of near-equal tokens the two cumulative sums (ascending there, descending
        # here) may round the boundary token differently: one token at most, a negligible mass
        assert int(((mine > 0) ^ (theirs > 0)).sum(-1).max()) <= (1 if scale < 1 else 0)
        assert float((mine - theirs).abs().sum(-1).max()) < 2e-3


def test_draws_follow_the_nucleus_distribution():
    """40,000 rows, each with its own generator, drawn from one distribution: the counts fit the `_top_p`
    probabilities (chi-square at p = 0.001; a draw that ignored the nucleus, the temperature or the generator's
    uniform would fail), and no token outside the nucleus is ever drawn."""
    torch.manual_seed(1)
    logits = torch.randn(1, 30) * 2
    n = 40_000
    for temperature, top_p in [(0.8, 0.9), (1.0, 1.0)]:
        gens = [torch.Generator().manual_seed(10_000 + i) for i in range(n)]
        tokens = _sample(logits.expand(n, -1), temperature, top_p, gens)
        want = _top_p(logits, temperature, top_p)[0]
        counts = torch.bincount(tokens, minlength=30).double()
        assert counts[want == 0].sum() == 0
        live = want > 0
        expected = want[live].double() * n
        chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
        df = int(live.sum()) - 1
        z = 3.09  # the 0.999 quantile of the normal, through the Wilson-Hilferty approximation of chi-square
        assert chi2 < df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3, (temperature, top_p, chi2, df)
