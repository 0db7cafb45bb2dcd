"""After every speculative step the cache equals, entry for entry, the cache of plain decoding over the
same committed tokens (float64 models, so "equal" can be tight)."""

from __future__ import annotations

import pytest
import torch
from test_inference_greedy import PlantedDrafter, float64_model, greedy_reference, random_heads
from tiny import VOCAB

from inference import HeadsDrafter, SpeculativeGenerator
from inference.engine.generator import Sampling
from inference.engine.kv import cache_length, cache_tensors, compact_cache, new_cache
from inference.engine.verify import target_forward



def plain_cache(model, tokens: list[int]):
    cache = new_cache()
    with torch.inference_mode():
        target_forward(model, torch.tensor([tokens]), cache)
    return cache


def assert_same_cache(got, want):
    assert cache_length(got) == cache_length(want)
    for (k1, v1), (k2, v2) in zip(cache_tensors(got), cache_tensors(want), strict=True):
        torch.testing.assert_close(k1, k2, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(v1, v2, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("drafter_kind", ["planted", "heads"])
def test_cache_after_every_step_equals_plain_decoding(arch, drafter_kind):
    model = float64_model(arch, seed=4)
    input_ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(9))
    truth = input_ids[0].tolist() + greedy_reference(model, input_ids, 60, eos_token_id=[]).tolist()
    if drafter_kind == "planted":
        # truth at rank 1 for 2 levels: accepted paths go through non-first siblings, so compaction must move
        drafter = PlantedDrafter(truth, VOCAB, 3, true_rank=1, good_depth=2)
    else:
        drafter = HeadsDrafter(random_heads(model, "chained", 3), model)
    gen = SpeculativeGenerator(model, None, drafter)
    sampling = Sampling()
    accepted_beyond_root = 0
    with torch.inference_mode():
        state = gen.prefill(input_ids, sampling)
        for _ in range(8):
            new = gen.speculative_step(state, [(0,), (1,), (2,), (1, 0), (1, 1), (1, 1, 0), (0, 0)], 0, sampling)
            accepted_beyond_root += len(new) - 1
            # the cache holds every committed token except the decided root
            assert_same_cache(state.cache, plain_cache(model, state.tokens[:-1]))
            assert state.tokens == truth[:len(state.tokens)]
    if drafter_kind == "planted":
        assert accepted_beyond_root == 16


def test_compact_cache_moves_the_kept_entries_and_crops():
    model = float64_model("llama")
    cache = plain_cache(model, list(range(12)))
    before = [(k.clone(), v.clone()) for k, v in cache_tensors(cache)]
    with torch.inference_mode():  # the cache's tensors are inference tensors
        compact_cache(cache, 5, torch.tensor([0, 3, 4, 6]))  # tree of 7 nodes after a 5-token prefix
    assert cache_length(cache) == 9
    for (k, v), (k0, v0) in zip(cache_tensors(cache), before):
        src = torch.tensor([0, 1, 2, 3, 4, 5, 8, 9, 11])
        assert torch.equal(k, k0[:, :, src]) and torch.equal(v, v0[:, :, src])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_the_cache_goes_in_by_the_keyword_the_model_takes(arch):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns, and goes in
    5.40); older versions (the GPU machines' 5.17) know only `past_key_values`. The engine asks the signature."""
    import inspect
    import warnings

    from medusa_train.target.model import cache_kwargs

    model = float64_model(arch)
    takes = "cache" if "cache" in inspect.signature(type(model.base_model).forward).parameters else "past_key_values"
    assert list(cache_kwargs(model.base_model, new_cache())) == [takes]
    gen = SpeculativeGenerator(model, None, HeadsDrafter(random_heads(model, "chained", 2), model))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        gen.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=8, tree_budget=3)
