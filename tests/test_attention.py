"""The kinds' training attention (medusa_train/kinds/attention.py): on every kernel (the CPU's flash kernel, the one
a GPU runs, PyTorch ops), a causal or prefix base merged with each row's extra keys equals PyTorch's dense masked
attention, values and gradients, with grouped heads, padding and any chunking; eagle3's training-time test and
dflash's anchored blocks give today's states and gradients through it (float64); under bf16 autocast it is no
further from float64 than SDPA under the same autocast; it keeps no [T, S] tensor for backward and computes no
score the pattern masks out; and a private kernel that fails its check is replaced by PyTorch ops."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

import medusa_train.kinds.attention as attention
from medusa_train.kinds import DraftHeads
from medusa_train.kinds import dflash as dflash_module
from medusa_train.kinds import eagle3 as eagle3_module
from medusa_train.kinds.attention import Prefix

MODES = ["cpu", "torch", "cuda"]  # "cuda" on a CPU: CUDA's kernel emulated (gpu_flash below) where it applies


def dense(q, k, v, scale, base=None, extras=()):
    """The reference: the base and extra keys laid side by side with a dense [B, 1, T, S + T*E] mask, through SDPA."""
    base = base or Prefix()
    B, H, T, hd = q.shape
    S = k.shape[2]
    mask = base.mask(0, T, S, q.device).expand(B, 1, T, S)
    keys, values, masks = [k], [v], [mask]
    for ek, ev in extras:
        _, kv, n, E, _ = ek.shape
        keys.append(ek.reshape(B, kv, n * E, hd))
        values.append(ev.reshape(B, kv, n * E, -1))
        run = torch.arange(T, device=q.device) // (T // n)
        masks.append((run[:, None] == torch.arange(n * E, device=q.device)[None] // E).expand(B, 1, T, n * E))
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=torch.cat(masks, 3),
                                          scale=scale, enable_gqa=True)


def gpu_flash(monkeypatch, calls: list | None = None, wrong: bool = False):
    """CUDA's flash ops as the "cuda" kernel calls them (their signatures and return conventions), computed by the
    CPU's kernel, so the GPU's branch runs here: q, k, v [B, H, T, hd] in bf16/fp16, a float32 log-sum-exp."""
    aten = torch.ops.aten

    class Ops:
        @staticmethod
        def forward(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
            if calls is not None:
                calls.append("flash")
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
            if wrong:  # the planted fault: a kernel whose log-sum-exp is off
                lse = lse + 1
            empty = torch.empty(0)
            return out, lse.float(), empty, empty, q.shape[2], k.shape[2], empty, empty, empty

        @staticmethod
        def backward(dout, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, seed, offset, *, scale):
            assert lse.dtype == torch.float32 and mq == q.shape[2] and mk == k.shape[2]
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, dropout_p,
                                                                             is_causal, scale=scale)

    kernel = attention.KERNELS["cuda"]
    monkeypatch.setattr(kernel, "flash_forward", Ops.forward, raising=False)
    monkeypatch.setattr(kernel, "flash_backward", Ops.backward, raising=False)
    monkeypatch.setattr(attention, "_checked", {})


def eagle3_inputs(steps: int, dtype=torch.float64, B=2, H=6, kv=2, T=11, hd=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, hd, generator=g, dtype=dtype).requires_grad_()
    ks = [torch.randn(B, kv, T, hd, generator=g, dtype=dtype).requires_grad_() for _ in range(steps)]
    vs = [torch.randn(B, kv, T, hd, generator=g, dtype=dtype).requires_grad_() for _ in range(steps)]
    extras = [(k[:, :, :, None], v[:, :, :, None]) for k, v in zip(ks[1:], vs[1:])]
    return (q, ks[0], vs[0], None, extras), [q, *ks, *vs]


def dflash_inputs(dtype=torch.float64, B=2, H=6, kv=2, P=13, n=4, S=3, hd=8):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, n * S, hd, generator=g, dtype=dtype).requires_grad_()
    ck, cv, bk, bv = (torch.randn(B, kv, m, hd, generator=g, dtype=dtype).requires_grad_()
                      for m in (P, P, n * S, n * S))
    real = torch.ones(B, P, dtype=torch.bool)
    real[1, 9:] = False  # a padded row
    anchors = torch.sort(torch.randint(0, P, (B, n), generator=g), 1).values
    anchors[1] = anchors[1].clamp(max=8)
    real[0, :2] = False  # and a left-padded one, whose first block sees no context at all: only itself
    anchors[0, 0] = 0
    base = Prefix(limit=anchors.repeat_interleave(S, 1), keep=real)
    extras = [(bk.reshape(B, kv, n, S, hd), bv.reshape(B, kv, n, S, hd))]
    return (q, ck, cv, base, extras), [q, ck, cv, bk, bv]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
@pytest.mark.parametrize("pattern", ["causal", "eagle3 step 3", "dflash blocks"])
def test_attention_is_the_dense_masked_attention(pattern, chunk_rows, mode, monkeypatch):
    monkeypatch.setattr(attention, "MODE", mode)
    gpu_flash(monkeypatch)
    (q, k, v, base, extras), leaves = (dflash_inputs() if pattern == "dflash blocks" else
                                       eagle3_inputs(1 if pattern == "causal" else 3))
    monkeypatch.setattr(attention, "CHUNK_BYTES", 4 * q.shape[0] * q.shape[1] * k.shape[2] * chunk_rows)
    want = dense(q, k, v, 0.3, base, extras)
    got = attention.attention(q, k, v, 0.3, base, extras)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    for x, y in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
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


def states_and_grads(heads, model, h, ids, supervised):
    torch.manual_seed(2)  # dflash draws the same anchors every time
    states, _, _ = heads.training_states(h, ids, supervised, supervised.long(), model.get_input_embeddings())
    params = [p for p in heads.parameters() if p.requires_grad]
    return states, torch.autograd.grad(states.pow(2).sum(), [h, *params])


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_training_states_are_todays_on_every_kernel(kind, monkeypatch):
    """Today's = the dense masked attention the kinds ran before (reference `dense`), in float64: states and every
    gradient equal on each kernel, the GPU's included."""
    model, heads, h, ids, supervised = fitted_inputs(kind)
    module = eagle3_module if kind == "eagle3" else dflash_module
    with monkeypatch.context() as m:
        m.setattr(module, "attention", dense)
        want = states_and_grads(heads, model, h, ids, supervised)
    for mode in MODES:
        monkeypatch.setattr(attention, "MODE", mode)
        monkeypatch.setattr(attention, "CHUNK_BYTES", 4 * 2 * 4 * 40)  # a handful of rows a chunk
        got = states_and_grads(heads, model, h, ids, supervised)
        torch.testing.assert_close(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(a, b)


def autocast_errors(fn, inputs, leaves, g):
    """The largest error of fn's output and of each gradient under bf16 autocast against float64, each relative to
    the float64 value's largest magnitude."""
    want = fn(*inputs)
    wants = torch.autograd.grad(want, leaves, g)
    low = [t.detach().float().requires_grad_() for t in leaves]
    swap = dict(zip(map(id, leaves), low))

    def cast(x):
        if isinstance(x, torch.Tensor):
            base = x._base if x._base is not None else x
            t = swap.get(id(x)) if id(x) in swap else None
            if t is not None:
                return t
            if id(base) in swap:  # a view of a leaf (eagle3's extras): the same view of its float32 copy
                return swap[id(base)].view(x.shape)
            return x
        if isinstance(x, list):
            return [tuple(cast(t) for t in pair) for pair in x]
        return x

    with torch.autocast("cpu", dtype=torch.bfloat16):
        args = [cast(x) for x in inputs]
        args[:3] = [a.to(torch.bfloat16) for a in args[:3]]  # what the projections hand it under autocast
        if args[4]:
            args[4] = [(a.to(torch.bfloat16), b.to(torch.bfloat16)) for a, b in args[4]]
        got = fn(*args)
    gots = torch.autograd.grad(got, low, g.to(got.dtype))
    return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip([got, *gots], [want, *wants])]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", ["eagle3 step 3", "dflash blocks"])
def test_under_bf16_autocast_no_further_from_float64_than_sdpa(pattern, mode, monkeypatch, caplog):
    monkeypatch.setattr(attention, "MODE", mode)
    gpu_flash(monkeypatch)
    size = dict(B=2, H=8, kv=2, hd=32)
    inputs, leaves = (dflash_inputs(**size, P=96, n=8, S=8) if pattern == "dflash blocks" else
                      eagle3_inputs(3, **size, T=128))
    g = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ours = autocast_errors(lambda *a: attention.attention(a[0], a[1], a[2], 0.3, a[3], a[4]), inputs, leaves, g)
    sdpa = autocast_errors(lambda *a: dense(a[0], a[1], a[2], 0.3, a[3], a[4]), inputs, leaves, g)
    for what, a, b in zip(["output", "dq", "dk", "dv"] + ["extras"] * 8, ours, sdpa):
        assert a <= 1.25 * b + 1e-3, (what, a, b)
    assert "not usable" not in caplog.text  # the kernel asked for ran


def saved_elements(fn) -> int:
    """The largest tensor (elements) autograd keeps for backward while `fn` runs."""
    largest = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return largest[0]


@pytest.mark.parametrize("mode", ["cpu", "torch"])
@pytest.mark.parametrize("pattern", ["eagle3 step 3", "dflash blocks"])
def test_it_keeps_no_scores_or_masks_for_backward(pattern, mode, monkeypatch):
    """What it keeps is q, k, v, the extras, the output and a log-sum-exp a row; the dense masked call keeps its
    [B, 1, T, S] mask (and, in CUDA's math kernel, [B, H, T, S] probabilities)."""
    monkeypatch.setattr(attention, "MODE", mode)
    (q, k, v, base, extras), _ = (dflash_inputs(P=64, n=8, S=4) if pattern == "dflash blocks" else
                                  eagle3_inputs(3, T=64))
    ours = saved_elements(lambda: attention.attention(q, k, v, 0.3, base, extras))
    assert ours == max(q.numel(), k.numel())
    assert saved_elements(lambda: dense(q, k, v, 0.3, base, extras)) >= q.shape[2] * k.shape[2]


def attention_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = fn()
        out.backward(torch.ones_like(out))
    return counter.get_total_flops()


def test_no_score_is_computed_that_the_pattern_masks_out(monkeypatch):
    """eagle3's 3 steps on the kernel a GPU runs in float32 (PyTorch ops, counted op by op): the work of 3 causal passes
    and the diagonal, within 1.5x of the causal passes' own; the dense pattern (every step against every earlier
    step's T keys) does (1 + 2 + 3) T^2, twice as many as the 3 causal passes' ~T^2 / 2 each would need."""
    monkeypatch.setattr(attention, "MODE", "torch")
    B, H, T, hd, steps = 1, 4, 256, 16, 3
    monkeypatch.setattr(attention, "CHUNK_BYTES", 4 * B * H * T * 16)  # 16 rows a chunk
    (q, k, v, _, extras), _ = eagle3_inputs(steps, torch.float32, B=B, H=H, kv=2, T=T, hd=hd)
    causal = 2 * 7 * B * H * T * (T + 1) // 2 * hd  # a flash kernel's: 2 matmuls forward, 5 backward, T(T+1)/2 scores
    ours = sum(attention_flops(lambda e=extras[:s]: attention.attention(q, k, v, 0.3, None, e)) for s in range(steps))
    assert ours <= 1.5 * steps * causal, ours / (steps * causal)
    monkeypatch.setattr(attention, "_plan", lambda kernel, base, B, H, T, S: [(0, T, S)])  # planted: no skipping
    dense_work = sum(attention_flops(lambda e=extras[:s]: attention.attention(q, k, v, 0.3, None, e))
                     for s in range(steps))
    assert dense_work > 1.5 * steps * causal


def test_the_gpus_kernel_runs_flash_for_eagle3_under_autocast(monkeypatch):
    """eagle3 training under bf16 autocast on the GPU's branch: every step's attention is one flash call (causal,
    no mask), forward and backward; float32 (no tensor-core kernel) goes to PyTorch ops."""
    calls: list[str] = []
    monkeypatch.setattr(attention, "MODE", "cuda")
    gpu_flash(monkeypatch, calls)
    model, heads, h, ids, supervised = fitted_inputs("eagle3")
    heads, h = heads.float(), h.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        embed = model.float().get_input_embeddings()
        states, _, _ = heads.training_states(h, ids, supervised, supervised.long(), embed)
    states.float().pow(2).sum().backward()
    assert calls.count("flash") == 1 + heads.spec.num_heads  # the check's call, then one a step
    assert all(p.grad is not None and p.grad.isfinite().all() for p in heads.parameters() if p.requires_grad)
    calls.clear()
    heads.training_states(h, ids, supervised, supervised.long(), model.get_input_embeddings())
    assert calls == []


def test_a_private_kernel_that_disagrees_is_replaced_by_pytorch_ops(monkeypatch, caplog):
    monkeypatch.setattr(attention, "MODE", "cuda")
    gpu_flash(monkeypatch, wrong=True)
    (q, k, v, base, extras), leaves = eagle3_inputs(3, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        got = attention.attention(q, k, v, 0.3, base, extras)
    assert "the cuda kernel is not usable here" in caplog.text and "PyTorch ops instead" in caplog.text
    want = dense(*(t.double() for t in (q, k, v)), 0.3, base, [(a.double(), b.double()) for a, b in extras])
    assert (got.double() - want).abs().max() < 3e-2
    monkeypatch.setattr(attention.KERNELS["cuda"], "flash_forward", None)  # a torch build without the op
    monkeypatch.setattr(attention, "_checked", {})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        again = attention.attention(q, k, v, 0.3, base, extras)
    assert "TypeError" in caplog.text
    torch.testing.assert_close(again, got)


def saved_bytes(fn) -> int:
    """What autograd keeps for backward while `fn` runs, in bytes (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_recomputed_layers_give_the_same_gradients_and_keep_less(kind, monkeypatch):
    """train.activation_checkpointing (heads.recompute): states and every gradient as without it (float64), and
    what autograd keeps for the heads' forward is smaller."""
    model, heads, h, ids, supervised = fitted_inputs(kind, T=40)
    want = states_and_grads(heads, model, h, ids, supervised)
    kept = saved_bytes(lambda: states_and_grads(heads, model, h, ids, supervised))
    heads.recompute = True
    got = states_and_grads(heads, model, h, ids, supervised)
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)
    assert saved_bytes(lambda: states_and_grads(heads, model, h, ids, supervised)) < 0.7 * kept


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_meta_device_runs_it_as_gpu_sizing_counts_it(kind):
    """scripts/gpu_sizing.py counts a step on the meta device (no values, no autocast): the training attention runs
    there, forward and backward, on the kernel a GPU's float32 takes."""
    model, heads, h, ids, supervised = fitted_inputs(kind)
    meta = lambda t: t.detach().to("meta").requires_grad_(t.requires_grad)  # noqa: E731
    heads = heads.to("meta")
    states, _, _ = heads.training_states(meta(h), ids.to("meta"), supervised.to("meta"), supervised.long().to("meta"),
                                         model.get_input_embeddings().to("meta"))
    states.sum().backward()
    assert states.device.type == "meta" and states.shape[0] == heads.spec.num_heads
