"""The CPU kernel choices (inference/engine/kernels.py). oneDNN linears: same numbers as F.linear up to float32
rounding, packed or not, packed weights follow weight changes, gradients and other dtypes keep F.linear, and
greedy speculation stays exact when every method uses it. Tree attention: grouped-query heads read in place
give the logits of transformers' own sdpa path, and the model's attention setting is restored."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_inference_greedy import greedy_reference, random_heads
from tiny import tiny_model, tiny_tokenizer

from inference import HeadsDrafter, NGramDrafter, SpeculativeGenerator
from inference.engine import kernels
from inference.engine.kernels import TREE_SDPA, tree_attention, use_onednn_linear, uses_onednn_linear
from inference.engine.kv import cache_length, crop_cache, new_cache
from inference.engine.tree import tree_attention_mask, tree_from_parents, tree_position_ids
from inference.engine.verify import target_forward, verify_tree


@pytest.mark.parametrize("pack", [True, False])
def test_swapped_layers_compute_what_f_linear_computes(pack):
    model = tiny_model("llama", seed=1).eval()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert use_onednn_linear(model, pack=pack) == n_linear > 0 and uses_onednn_linear(model)
    assert use_onednn_linear(model, pack=pack) == n_linear  # idempotent
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_packed_weights_follow_the_weight():
    """Every row count, then the weight changed in place, replaced, and the module deep-copied: the packed
    copy must never serve a stale weight."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(48, 40, bias=True)
    use_onednn_linear(lin)
    assert lin in kernels._PACKED
    with torch.no_grad():
        for rows in (1, 3, 9, 17):
            x = torch.randn(rows, 48, generator=g)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        x = torch.randn(5, 48, generator=g)
        lin.weight.mul_(-2.0)  # in place (as load_state_dict or a LoRA merge does)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        lin.weight = torch.nn.Parameter(torch.randn(40, 48, generator=g))  # replaced
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        twin = copy.deepcopy(lin)
        twin.weight.add_(1.0)
        torch.testing.assert_close(twin(x), F.linear(x, twin.weight, twin.bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_a_drafters_layers_take_the_kernel_this_machine_times_faster(monkeypatch):
    """use_fastest_linear routes each layer by the timing of its shape (times planted here: oneDNN faster for the
    block's shape, MKL for the projection's), measures a shape once, and a later choice undoes an earlier one."""
    if not kernels.onednn_linear_available():
        pytest.skip("this PyTorch has no oneDNN linear")
    timed = []
    planted = {(8, 4): True, (4, 16): False}

    def fake(layer, rows, calls=40):
        key = (layer.in_features, layer.out_features, layer.bias is not None, rows)
        if key not in kernels._FASTER_ONEDNN:
            timed.append(key)
            kernels._FASTER_ONEDNN[key] = planted[(layer.in_features, layer.out_features)]
        return kernels._FASTER_ONEDNN[key]

    monkeypatch.setattr(kernels, "_FASTER_ONEDNN", {})
    monkeypatch.setattr(kernels, "_onednn_is_faster", fake)
    model = torch.nn.ModuleList([torch.nn.Linear(8, 4), torch.nn.Linear(4, 16, bias=False), torch.nn.Linear(8, 4)])
    assert kernels.use_fastest_linear(model, rows=3) == 2
    assert [uses_onednn_linear(m) for m in model] == [True, False, True]
    assert len(timed) == 2  # one timing per shape
    with torch.no_grad():
        for layer in model:  # the same float32 math either way
            x = torch.randn(3, layer.in_features)
            assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-6)
    planted[(8, 4)] = False
    kernels._FASTER_ONEDNN.clear()
    assert kernels.use_fastest_linear(model, rows=3) == 0 and not uses_onednn_linear(model)


def test_gradients_and_float64_keep_f_linear():
    lin = torch.nn.Linear(8, 4)
    use_onednn_linear(lin)
    x = torch.randn(3, 8, requires_grad=True)
    lin(x).square().sum().backward()
    want = torch.autograd.grad(F.linear(x, lin.weight, lin.bias).square().sum(), x)[0]
    torch.testing.assert_close(x.grad, want)
    assert lin.weight.grad is not None
    model64 = tiny_model("llama").double()
    assert use_onednn_linear(model64) == 0 and not uses_onednn_linear(model64)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("pack", [True, False])
def test_greedy_speculation_is_exact_with_onednn_kernels(arch, pack):
    """float32 (the kernels only serve float32): the target's own generate and the engine both run on them."""
    model = tiny_model(arch, seed=2).eval()
    use_onednn_linear(model, pack=pack)
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    want = greedy_reference(model, ids, 40, eos_token_id=[])
    for drafter in (HeadsDrafter(random_heads(model, "chained", 3, seed=4, context_layers=1), model),
                    NGramDrafter(max_depth=3)):
        gen = SpeculativeGenerator(model, tiny_tokenizer(), drafter)
        for tree in ("static", "dynamic"):
            out = gen.generate(ids, max_new_tokens=40, tree=tree, tree_budget=6, eos_token_id=[])
            assert out.token_ids.tolist() == want.tolist(), (arch, type(drafter).__name__, tree)


def test_tree_attention_reads_grouped_heads_in_place_with_the_same_logits(monkeypatch):
    """A tree verify (4D mask, several query rows, 4 query / 2 KV heads) under `tree_attention` calls PyTorch's
    kernel with enable_gqa instead of transformers' repeat_kv copy, and gets the same logits; the model's
    attention setting is back to sdpa afterwards, also when the forward raises."""
    model = tiny_model("llama", seed=5).eval()
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < 4
    tokens = torch.tensor([7, 8, 9, 10, 11])
    tree = tree_from_parents(tokens, torch.tensor([0, 0, 0, 1, 3]), torch.tensor([0, 1, 1, 2, 3]), 3)
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.inference_mode():
        cache = new_cache()
        target_forward(model, torch.arange(20, 40)[None], cache)
        got, _ = verify_tree(model, cache, tree)
        assert calls[-2:] == [True, True] and model.config._attn_implementation == "sdpa"
        crop_cache(cache, 20)
        calls.clear()  # the same forward outside `tree_attention`: transformers' own sdpa path
        mask = tree_attention_mask(tree.ancestors, 20, torch.float32)
        h = target_forward(model, tree.tokens[None], cache, mask, tree_position_ids(tree.depth, 20))[0]
        want = model.get_output_embeddings()(h)
        assert calls == [False, False] and cache_length(cache) == 25
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", broken)
    with pytest.raises(RuntimeError, match="boom"), torch.inference_mode():
        verify_tree(model, new_cache(), tree)
    assert model.config._attn_implementation == "sdpa" != TREE_SDPA
    eager = tiny_model("llama", seed=5, attn_implementation="eager")
    assert not tree_attention(eager).active
