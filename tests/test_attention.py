"""The kinds' training attention (medusa_train/kinds/attention.py): the chunked attention equals PyTorch's dense masked
attention, values and gradients, with grouped heads and any chunking; eagle3's training-time test and dflash's
anchored blocks give the same states and gradients through it; it keeps no [T, S] scores for backward; and on a
device that is not a CPU no training attention call is one that CUDA could only run in its math kernel (a mask with
grouped heads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

import medusa_train.kinds.attention as attention
from medusa_train.kinds import DraftHeads
from medusa_train.kinds.attention import ChunkedAttention


def ttt_mask(T: int, steps: int) -> torch.Tensor:
    idx = torch.arange(T)
    return torch.cat([idx[:, None] >= idx[None]] + [idx[:, None] == idx[None]] * (steps - 1), dim=1)[None, None]


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("pattern", ["ttt", "random per row"])
def test_chunked_attention_is_the_dense_masked_attention(chunk, pattern):
    torch.manual_seed(0)
    B, H, Hkv, T, hd = 2, 6, 2, 11, 8
    S = 3 * T
    q = torch.randn(B, H, T, hd, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, S, hd, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, S, hd, dtype=torch.float64, requires_grad=True)
    if pattern == "ttt":
        mask = ttt_mask(T, 3)
    else:
        mask = torch.rand(B, 1, T, S) < 0.3
        mask[..., 0] = True  # every row sees a key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    got = ChunkedAttention.apply(q, k, v, lambda a, b: mask[:, :, a:b], 0.3, chunk)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    for x, y in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(x, y)


def fitted_inputs(kind: str, T: int = 13):
    torch.manual_seed(1)
    model = tiny_model("llama", dtype=torch.float64)
    heads = DraftHeads.for_target(model, kind, 3).double()
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    h = torch.randn(2, T, heads.feature_size, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 250, (2, T))
    supervised = torch.ones(2, T, dtype=torch.bool)
    supervised[1, 9:] = False
    return model, heads, h, ids, supervised


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_training_states_are_the_same_through_either_attention(kind, monkeypatch):
    model, heads, h, ids, supervised = fitted_inputs(kind)
    mask = supervised.long()
    embed = model.get_input_embeddings()
    runs = []
    for mode in ("sdpa", "chunked"):
        monkeypatch.setattr(attention, "MODE", mode)
        monkeypatch.setattr(attention, "CHUNK_BYTES", 4 * 2 * 4 * 40)  # a handful of rows a chunk
        torch.manual_seed(2)  # dflash draws the same anchors in both
        states, _, _ = heads.training_states(h, ids, supervised, mask, embed)
        grads = torch.autograd.grad(states.pow(2).sum(), [h, *[p for p in heads.parameters() if p.requires_grad]])
        runs.append((states, grads))
    torch.testing.assert_close(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b)


def saved_elements(fn) -> int:
    """The largest tensor (elements) autograd keeps for backward while `fn` runs."""
    largest = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return largest[0]


def test_chunked_attention_keeps_no_scores_for_backward():
    """What it keeps is q, k, v, the output and a log-sum-exp a row; PyTorch's math kernel (what CUDA runs for a mask
    with grouped heads) keeps [B, H, T, S] probabilities."""
    B, H, Hkv, T, hd = 1, 4, 2, 64, 8
    S = 4 * T
    q = torch.randn(B, H, T, hd, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, hd, requires_grad=True) for _ in range(2))
    mask = ttt_mask(T, 4)
    chunked = saved_elements(lambda: ChunkedAttention.apply(q, k, v, lambda a, b: mask[:, :, a:b], 0.3, 8))
    assert chunked == max(q.numel(), k.numel())
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        math = saved_elements(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    assert math >= B * H * T * S


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_off_a_cpu_no_training_attention_call_is_left_to_cudas_math_kernel(kind, monkeypatch):
    """On the meta device (standing in for CUDA: not a CPU), a training step's attention calls: every SDPA call left
    would run in a kernel CUDA has without the math fallback (flash: no mask; memory-efficient: no grouped heads)."""
    model, heads, h, ids, supervised = fitted_inputs(kind)
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append("flash" if attn_mask is None else "efficient" if q.shape[1] == k.shape[1] else "math")
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    meta = lambda t: t.detach().to("meta").requires_grad_(t.requires_grad)  # noqa: E731
    heads = heads.to("meta")
    states, _, _ = heads.training_states(meta(h), ids.to("meta"), supervised.to("meta"), supervised.long().to("meta"),
                                         model.get_input_embeddings().to("meta"))
    states.sum().backward()
    assert "math" not in calls
    monkeypatch.setattr(attention, "MODE", "sdpa")  # the planted fault: the dense masked call off a CPU
    calls.clear()
    heads.training_states(meta(h), ids.to("meta"), supervised.to("meta"), supervised.long().to("meta"),
                          model.get_input_embeddings().to("meta"))
    assert "math" in calls
