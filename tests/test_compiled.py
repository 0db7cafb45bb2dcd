"""The compiled path (`compile=...`, `inference.engine.compiled`): a static KV cache, trees padded to fixed row counts,
the verify forward compiled per row count. Its output must be the target's greedy output token for token, as the
eager engine's is. Most tests trace with torch.compile's `aot_eager` backend (the whole graph, no code generation:
seconds); one compiles with inductor, the default, which generates C++ on the CPU (about 15 s)."""

from __future__ import annotations

import pytest
import torch
from test_inference_cache import plain_cache
from test_inference_greedy import ARCHS, PlantedDrafter, float64_model, greedy_reference, random_heads
from tiny import VOCAB

from inference import HeadsDrafter, HybridDrafter, SpeculativeGenerator
from inference.engine.compiled import BUCKETS, StaticVerifier, bucket, static_mask
from inference.engine.generator import Sampling
from inference.engine.kv import cache_tensors
from inference.engine.tree import tree_attention_mask, tree_from_parents


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_greedy_equals_target_generate(arch):
    """Heads with lookup grafted on (trees of every size up to 13 rows, padded to 1, 2, 4, 8 or 16), a planted
    drafter whose right tokens sit at rank 1 (so accepted paths run through later siblings and the compaction
    moves entries), static and dynamic trees; then a request longer than the cache reserved before."""
    model = float64_model(arch, seed=1)
    ids = prompt(9, 3)
    ids = torch.cat([ids, ids[:, :4]], dim=1)  # something for the lookup to find
    want = greedy_reference(model, ids, 40, eos_token_id=[])
    heads = HybridDrafter(HeadsDrafter(random_heads(model, "chained", 3, seed=2), model), lookup_nodes=3)
    gen = SpeculativeGenerator(model, None, heads, compile="aot_eager")
    for tree, budget in (("static", 3), ("dynamic", 6), ("static", 10)):
        out = gen.generate(ids, max_new_tokens=40, tree=tree, tree_budget=budget, eos_token_id=[])
        assert out.token_ids.tolist() == want.tolist(), (tree, budget)
    truth = ids[0].tolist() + greedy_reference(model, ids, 300, eos_token_id=[]).tolist()
    planted = SpeculativeGenerator(model, None, PlantedDrafter(truth, VOCAB, 3, true_rank=1, good_depth=2),
                                   compile="aot_eager")
    out = planted.generate(ids, max_new_tokens=40, tree=[(0,), (1,), (1, 0), (1, 1), (1, 1, 0)], eos_token_id=[])
    assert out.token_ids.tolist() == want.tolist()
    assert out.stats.accept_lengths[:-1] == [3] * (len(out.stats.accept_lengths) - 1)
    first_capacity = planted.static.capacity
    out = planted.generate(ids, max_new_tokens=290, tree=[(0,), (1,), (1, 0), (1, 1), (1, 1, 0)], eos_token_id=[])
    assert planted.static.capacity > first_capacity  # a new, larger cache, compiled again
    assert out.token_ids.tolist() == truth[ids.shape[1]:ids.shape[1] + 290]


def test_compiled_with_inductor_equals_target_generate():
    model = float64_model("llama", seed=5)
    ids = prompt(11, 6)
    want = greedy_reference(model, ids, 24, eos_token_id=[])
    truth = ids[0].tolist() + greedy_reference(model, ids, 40, eos_token_id=[]).tolist()
    gen = SpeculativeGenerator(model, None, PlantedDrafter(truth, VOCAB, 3, true_rank=0, good_depth=2),
                               compile=True)
    out = gen.generate(ids, max_new_tokens=24, tree=[(0,), (1,), (0, 0), (0, 0, 0)], eos_token_id=[])
    assert out.token_ids.tolist() == want.tolist()
    assert out.stats.accept_lengths[:-1] == [3] * (len(out.stats.accept_lengths) - 1)  # 3 of 4 drafts: good_depth 2


def test_compile_from_pretrained_on_a_cpu(tmp_path):
    """The public path, as a user calls it: `from_pretrained(heads_dir, compile=True)` with a float32 target on a CPU
    (whose linear layers the eager engine routes through packed oneDNN kernels, which inductor cannot lower: it
    crashed with a 100-line InductorError). Output equals the target's greedy output."""
    from tiny import save_tiny

    model = save_tiny(tmp_path / "target", "llama", seed=7)
    heads = random_heads(model, "chained", 2, seed=1)
    heads.spec.target_name = str(tmp_path / "target")
    heads.save_pretrained(tmp_path / "heads")
    gen = SpeculativeGenerator.from_pretrained(tmp_path / "heads", device="cpu", dtype="float32", lookup_nodes=0,
                                               compile=True)
    ids = prompt(9, 3)
    out = gen.generate(ids, max_new_tokens=12, tree=[(0,), (0, 0)], tree_budget=2, eos_token_id=[])
    assert out.token_ids.tolist() == greedy_reference(model, ids, 12, eos_token_id=[]).tolist()


def test_static_cache_after_every_step_holds_plain_decoding():
    """The first `prefix` entries of the static cache equal plain decoding's cache over the committed tokens."""
    model = float64_model("qwen2", seed=4)
    ids = prompt(10, 9)
    truth = ids[0].tolist() + greedy_reference(model, ids, 60, eos_token_id=[]).tolist()
    gen = SpeculativeGenerator(model, None, PlantedDrafter(truth, VOCAB, 3, true_rank=1, good_depth=2),
                               compile="aot_eager")
    with torch.inference_mode():
        state = gen.prefill(ids, Sampling(), max_new_tokens=60)
        for _ in range(6):
            gen.speculative_step(state, [(0,), (1,), (2,), (1, 0), (1, 1), (1, 1, 0), (0, 0)], 0, Sampling())
            committed = state.tokens[:-1]
            want = cache_tensors(plain_cache(model, committed))
            for (k, v), (k2, v2) in zip(cache_tensors(state.cache), want, strict=True):
                torch.testing.assert_close(k[..., :len(committed), :], k2, rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(v[..., :len(committed), :], v2, rtol=1e-9, atol=1e-9)
            assert state.tokens == truth[:len(state.tokens)]


def test_padded_verify_equals_the_eager_verify_whatever_the_pad_rows_hold():
    """A 5-node tree verified at 8 rows: the real rows' logits equal the eager verify's, and the pad rows'
    tokens change nothing (no real row sees them)."""
    model = float64_model("llama", seed=7)
    ids = prompt(13, 2)
    tree = tree_from_parents(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 0, 0, 1, 3]),
                             torch.tensor([0, 1, 1, 2, 3]), 3)
    with torch.inference_mode():
        cache = plain_cache(model, ids[0].tolist())
        from inference.engine.verify import verify_tree
        want, _ = verify_tree(model, cache, tree)
        verifier = StaticVerifier(model, backend="aot_eager")
        verifier.reserve(64)
        verifier.prefill(ids)
        got, h = verifier.verify(tree, ids.shape[1])
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        assert got.shape == (5, VOCAB) and h.shape[0] == 5
        verifier.prefill(ids)
        padded = tree_from_parents(torch.tensor([5, 6, 7, 8, 9, 200, 201, 202]),
                                   torch.tensor([0, 0, 0, 1, 3, 0, 0, 0]), torch.tensor([0, 1, 1, 2, 3, 0, 0, 0]), 3)
        again, _ = verifier.verify(padded, ids.shape[1])
        torch.testing.assert_close(again[:5], want, rtol=1e-9, atol=1e-9)


def test_static_mask_matches_the_eager_tree_mask_on_the_written_columns():
    anc = tree_from_parents(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 2, 2]),
                            2).ancestors
    mask = static_mask(anc, torch.tensor(6), 16, torch.float32)[0, 0]  # [4, 16]
    eager = tree_attention_mask(anc, 6, torch.float32)[0, 0]  # [4, 10]
    assert torch.equal(mask[:, :10], eager)
    assert (mask[:, 10:] == torch.finfo(torch.float32).min).all()  # never-written and stale columns


def test_bucket_sizes():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 32]
    with pytest.raises(ValueError, match="lower tree_budget"):
        bucket(BUCKETS[-1] + 1)


def test_compile_argument_is_checked():
    model = float64_model("llama")
    with pytest.raises(ValueError, match="compile must be"):
        SpeculativeGenerator(model, None, HeadsDrafter(random_heads(model, "chained", 2), model), compile=3)


def test_the_compiled_verify_is_not_guarded_on_other_models():
    """Models made or collected between two calls (the weak-keyed cache of logit transforms grows and shrinks) leave
    the compiled verify as it was: dynamo once traced that cache and guarded on its size, so a garbage collection
    between building a frame and checking it failed the run ("Guard failed on the same frame it was created")."""
    import gc

    from medusa_train.target.model import final_logits

    model = float64_model("llama", seed=1)
    ids = prompt(9, 3)
    want = greedy_reference(model, ids, 12, eos_token_id=[])
    gen = SpeculativeGenerator(model, None, HeadsDrafter(random_heads(model, "chained", 3, seed=2), model),
                               compile="aot_eager")
    assert gen.generate(ids, max_new_tokens=12, tree_budget=3, eos_token_id=[]).token_ids.tolist() == want.tolist()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    other = float64_model("llama", seed=3)  # of the same class: transformers guards its own per-class registry
    final_logits(other, torch.zeros(1, other.config.hidden_size, dtype=torch.float64))  # one more cached transform
    assert gen.generate(ids, max_new_tokens=12, tree_budget=3, eos_token_id=[]).token_ids.tolist() == want.tolist()
    del other
    gc.collect()  # and one fewer
    assert gen.generate(ids, max_new_tokens=12, tree_budget=3, eos_token_id=[]).token_ids.tolist() == want.tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
