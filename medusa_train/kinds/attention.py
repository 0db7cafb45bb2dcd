"""Training attention for the kinds' own layers (eagle3's training-time test, dflash's anchored blocks): a *base*
pattern that a fused kernel runs (causal, or each query row seeing a prefix of the keys), merged with a few *extra*
keys of each query row's own (eagle3 step k: the row's keys of steps 1..k; dflash: its block's own keys), so no
[T, S] mask is ever built or kept and no score is computed that the pattern masks out.

    attention(q, k, v, scale, base, extras)

`base` is a `Prefix`: row r sees base key j when j <= limit[b, r] and keep[b, j] (`Prefix()`: causal, query and
key rows aligned). `extras` is a list of (keys, values) pairs, each [B, Hkv, N, E, hd]: the T query rows fall into
N runs of R = T / N rows, and every row of run n also sees the E keys [:, :, n] (eagle3: R = 1, E = 1 a step;
dflash: R = E = the block size). Queries [B, H, T, hd]; base keys [B, Hkv, S, hd] (Hkv divides H).

How it is computed (FlashAttention's log-sum-exp merge): the kernel runs the base pattern and returns its output o
and log-sum-exp l per row; the extras' scores e (a handful a row) join them as
    L = logaddexp(l, logsumexp(e)),  out = exp(l - L) o + sum_i exp(e_i - L) v_i,
and backward hands the kernel's own backward the *merged* output and L: it then computes exactly the merged
softmax's gradient for the base keys (its P = exp(s - L) and rowsum(dout * out) are the merged ones), and the
extras' part is a few [B, H, T, E] products. Scores and the merge are in float32 (float64 for float64 inputs) with
autocast off, so bf16 autocast rounds no more than PyTorch's own SDPA does.

Kernels (`MODE`, "auto" by device): "cpu" is PyTorch's CPU flash kernel in float32 (causal, or a float mask a
chunk of rows at a time); "cuda" is CUDA's flash kernel for a causal base in bf16/fp16 (eagle3 under autocast), and
"torch" for anything else; "torch" is the same algorithm in PyTorch ops, a chunk of rows at a time over only the
keys the chunk can see, on any device. The private ops behind "cpu" and "cuda" are checked against "torch" on a small input the first time a
device, dtype and head size use them; one that fails or disagrees is replaced by "torch" with a warning.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MODE = "auto"  # "auto": cpu on a CPU, cuda on CUDA, torch elsewhere; or force "cpu", "cuda", "torch"
CHUNK_BYTES = 128 << 20  # the fp32 scores of one chunk of rows, across the batch and every head (two live at once)
CHUNKS = 8  # the fewest chunks of rows PyTorch ops run a causal or prefix base in (see _plan)
Extras = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, eq=False)
class Prefix:
    """The base pattern: query row r sees base key j when j <= limit[b, r] and keep[b, j]. `limit` None: causal
    (limit[b, r] = r); `keep` None: every key kept."""

    limit: torch.Tensor | None = None  # [B, T] long
    keep: torch.Tensor | None = None  # [B, S] bool
    limit_on_host: torch.Tensor | None = None  # `limit` on the CPU, read to plan the chunks (else one sync a call)

    @property
    def causal(self) -> bool:
        return self.limit is None and self.keep is None

    def mask(self, a: int, b: int, end: int, device: torch.device) -> torch.Tensor:
        """bool [B or 1, 1, b - a, end]: what rows a..b-1 see of keys 0..end-1."""
        j = torch.arange(end, device=device)
        if self.limit is None:
            m = (j[None, :] <= torch.arange(a, b, device=device)[:, None])[None]
        else:
            m = j[None, None, :] <= self.limit[:, a:b, None]
        if self.keep is not None:
            m = m & self.keep[:, None, :end]
        return m[:, None]

    def sees_any(self) -> torch.Tensor | None:
        """bool [B, T]: rows that see at least one base key (None: all of them)."""
        if self.keep is None:
            return None
        first = torch.where(self.keep.any(1), self.keep.float().argmax(1), self.keep.shape[1])  # first kept key
        limit = self.limit if self.limit is not None else torch.arange(self.keep.shape[1], device=self.keep.device)
        return limit >= first[:, None]


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype where it is on for this device type, else None (the meta device has no autocast)."""
    try:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except RuntimeError:
        return None


def _no_autocast(device_type: str):
    return torch.autocast(device_type, enabled=False) if device_type in ("cpu", "cuda", "xpu", "mps") else \
        contextlib.nullcontext()


def _work(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and the merge are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Kernels: forward(q, k, v, scale, causal, mask) -> (out in q's dtype or float32, lse in _work), backward(dout, q, k,
# v, out, lse, scale, causal, mask) -> (dq, dk, dv). `mask` is None (causal or everything) or bool [B or 1, 1, Tq, Tk].


class TorchKernel:
    """Softmax attention in PyTorch ops, float32 at least: any device, any mask."""

    name = "torch"
    fused_causal = False  # causal rows are chunked like any mask, each chunk over only the keys it sees

    @staticmethod
    def _scores(q, k, scale, causal, mask):
        B, H, T, hd = q.shape
        kv = k.shape[1]
        work = _work(q.dtype)
        s = torch.einsum("bkgtd,bksd->bkgts", q.reshape(B, kv, H // kv, T, hd).to(work), k.to(work)).mul_(scale)
        if causal:
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - T)[None, None]
        if mask is not None:
            s.masked_fill_(~mask[:, :, None], float("-inf"))
        return s  # [B, Hkv, G, T, S]

    def forward(self, q, k, v, scale, causal, mask):
        s = self._scores(q, k, scale, causal, mask)
        lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(lse[..., None]).nan_to_num_(nan=float("-inf")).exp_()  # a row that sees nothing: p 0, lse -inf
        out = torch.einsum("bkgts,bksd->bkgtd", p, v.to(p.dtype))
        B, H, T, _ = q.shape
        return out.reshape(B, H, T, -1), lse.reshape(B, H, T)  # float32: the merge rounds once

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask):
        B, H, T, hd = q.shape
        kv = k.shape[1]
        work = _work(q.dtype)
        s = self._scores(q, k, scale, causal, mask)
        p = s.sub_(lse.reshape(B, kv, H // kv, T, 1)).exp_()
        do = dout.reshape(B, kv, H // kv, T, -1).to(work)
        delta = (do * out.reshape(do.shape).to(work)).sum(-1, keepdim=True)
        dv = torch.einsum("bkgts,bkgtd->bksd", p, do)
        ds = torch.einsum("bkgtd,bksd->bkgts", do, v.to(work)).sub_(delta).mul_(p)
        dq = torch.einsum("bkgts,bksd->bkgtd", ds, k.to(work)).mul_(scale).reshape(B, H, T, hd)
        dk = torch.einsum("bkgts,bkgtd->bksd", ds, q.reshape(B, kv, H // kv, T, hd).to(work)).mul_(scale)
        return dq, dk, dv


def _float_mask(mask, dtype):
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


class CpuFlashKernel:
    """PyTorch's CPU flash kernel (grouped heads, causal or a float mask; keeps no scores)."""

    name = "cpu"
    fused_causal = True

    def forward(self, q, k, v, scale, causal, mask):
        work = _work(q.dtype)  # bf16 inputs run in float32: the output is rounded once, after the merge
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.to(work), k.to(work), v.to(work), 0.0, causal, attn_mask=_float_mask(mask, work), scale=scale)

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask):
        work = _work(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(work), q.to(work), k.to(work), v.to(work), out.to(work), lse.to(work), 0.0, causal,
            attn_mask=_float_mask(mask, work), scale=scale)


class CudaFlashKernel:
    """CUDA's flash kernel for a causal base in bf16/fp16 (grouped heads); anything else goes to the torch kernel."""

    name = "cuda"
    fused_causal = True

    def __init__(self):
        aten = torch.ops.aten
        self.flash_forward = aten._scaled_dot_product_flash_attention
        self.flash_backward = aten._scaled_dot_product_flash_attention_backward

    def forward(self, q, k, v, scale, causal, mask):
        out, lse, *_ = self.flash_forward(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse[..., :q.shape[2]].float()

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask):
        empty = torch.empty(0, dtype=torch.long, device=q.device)
        rng = torch.zeros(2, dtype=torch.long, device=q.device)  # no dropout: the generator state is not read
        return tuple(g.float() for g in self.flash_backward(
            dout.to(q.dtype).contiguous(), q, k, v, out, lse.float().contiguous(), empty, empty, q.shape[2],
            k.shape[2], 0.0, causal, rng, empty, scale=scale))

    @staticmethod
    def takes(q: torch.Tensor, causal: bool) -> bool:
        hd = q.shape[-1]
        return causal and q.dtype in (torch.float16, torch.bfloat16) and hd % 8 == 0 and hd <= 256


TORCH = TorchKernel()
KERNELS = {"torch": TORCH, "cpu": CpuFlashKernel(), "cuda": CudaFlashKernel()}
_checked: dict[tuple, bool] = {}


def _kernel(q: torch.Tensor, causal: bool):
    """The kernel for this call: MODE's (or the device's), the torch one where it cannot run or failed its check."""
    mode = MODE if MODE != "auto" else {"cpu": "cpu", "cuda": "cuda"}.get(q.device.type, "torch")
    kernel = KERNELS[mode]
    if kernel is TORCH or (kernel.name == "cuda" and not CudaFlashKernel.takes(q, causal)):
        return TORCH
    key = (kernel.name, q.device.type, q.dtype, q.shape[-1], causal)
    if key not in _checked:
        _checked[key] = _self_check(kernel, q, causal)
    return kernel if _checked[key] else TORCH


def _self_check(kernel, like: torch.Tensor, causal: bool) -> bool:
    """Does `kernel` (a private op of this torch build) give the torch kernel's output and gradients on a small
    input of `like`'s device, dtype and head size?"""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, kv, T, hd = 1, 4, 2, 37, like.shape[-1]
    q, k, v, dout = (torch.randn(B, n, T, hd, generator=g).to(like.device, like.dtype) for n in (H, kv, kv, H))
    mask = None if causal else (torch.rand(B, 1, T, T, generator=g) < 0.5).to(like.device)
    if mask is not None:
        mask[..., 0] = True
    tol = 1e-5 if like.dtype in (torch.float32, torch.float64) else 3e-2
    try:
        with torch.no_grad(), _no_autocast(like.device.type):
            got = kernel.forward(q, k, v, 0.3, causal, mask)
            want = TORCH.forward(q, k, v, 0.3, causal, mask)
            out = want[0].to(q.dtype)
            grads = kernel.backward(dout, q, k, v, out, want[1], 0.3, causal, mask)
            wants = TORCH.backward(dout, q, k, v, out, want[1], 0.3, causal, mask)
        ok = torch.allclose(got[1].float(), want[1].float(), atol=1e-4, rtol=1e-4) and all(  # lse: float32 both
            torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in zip((got[0], *grads),
                                                                                     (want[0], *wants)))
        why = "its output or gradients differ from PyTorch ops'"
    except Exception as e:  # noqa: BLE001 - a private op missing or with another signature in this torch build
        ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not ok:
        log.warning("training attention: the %s kernel is not usable here (%s, %s, head size %d): %s; using PyTorch "
                    "ops instead (same result, slower)", kernel.name, like.device.type, like.dtype, hd, why)
    return ok


# ---------------------------------------------------------------------------------------------------
# The merge


def _plan(kernel, base: Prefix, B: int, H: int, T: int, S: int) -> list[tuple[int, int, int]]:
    """Query chunks (a, b, end): rows a..b-1 over keys 0..end-1 (end: the last key any of them sees, plus one)."""
    if base.causal and kernel.fused_causal:
        return [(0, T, S)]
    # at most CHUNK_BYTES of scores, and at least CHUNKS chunks: a chunk computes its rows against every key up to
    # the last any of them sees, so causal rows in n chunks cost (n + 1) / 2n of the square, 9/16 at n = 8
    chunk = max(1, min(CHUNK_BYTES // (4 * B * H * max(S, 1)), -(-T // CHUNKS)))
    bounds = [(a, min(a + chunk, T)) for a in range(0, T, chunk)]
    if base.limit is None:
        return [(a, b, min(b, S)) for a, b in bounds]
    limit = base.limit_on_host if base.limit_on_host is not None else base.limit
    if limit.device.type == "meta":  # sizing on the meta device (scripts/gpu_sizing.py): no values to read
        return [(a, b, S) for a, b in bounds]
    ends = torch.stack([limit[:, a:b].amax() for a, b in bounds]).clamp(0, S - 1).add(1).tolist()
    return [(a, b, e) for (a, b), e in zip(bounds, ends)]


def _pattern(kernel, base: Prefix, a: int, b: int, end: int, device: torch.device
             ) -> tuple[bool, torch.Tensor | None]:
    """(causal, mask) for the kernel's call on rows a..b-1 over keys 0..end-1: built again in backward, never kept."""
    causal = base.causal and kernel.fused_causal
    return causal, None if causal else base.mask(a, b, end, device)


def _grouped(x: torch.Tensor, kv: int, n: int) -> torch.Tensor:
    """[B, H, T, d] -> [B, Hkv, G, N, R, d]."""
    B, H, T, d = x.shape
    return x.reshape(B, kv, H // kv, n, T // n, d)


def _extra_scores(qg: torch.Tensor, extras: Extras, scale: float) -> torch.Tensor:
    """[B, Hkv, G, N, R, E]: every row's scores of its run's extra keys."""
    work = qg.dtype
    return torch.cat([torch.einsum("bkgnrd,bkned->bkgnre", qg, ek.to(work)) for ek, _ in extras], -1).mul_(scale)


class MergedAttention(torch.autograd.Function):
    """`attention`: saves q, k, v, the extras (views of tensors autograd keeps anyway), the output and L a row."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, base: Prefix, n_extras: int, *flat):
        extras = [(flat[2 * i], flat[2 * i + 1]) for i in range(n_extras)]
        B, H, T, _ = q.shape
        kernel = _kernel(q, base.causal)
        plan = _plan(kernel, base, B, H, T, k.shape[2])
        work = _work(q.dtype)
        with _no_autocast(q.device.type):
            k, v = k.to(q.dtype), v.to(q.dtype)
            out = torch.empty(B, H, T, v.shape[-1], dtype=work, device=q.device)
            lse = torch.empty(B, H, T, dtype=work, device=q.device)
            for a, b, end in plan:
                causal, mask = _pattern(kernel, base, a, b, end, q.device)
                o, l = kernel.forward(q[:, :, a:b], k[:, :, :end], v[:, :, :end], scale, causal, mask)
                out[:, :, a:b], lse[:, :, a:b] = o, l
            sees = base.sees_any()
            if sees is not None:  # a row that sees no base key: the kernels say lse 0, output 0
                lse.masked_fill_(~sees[:, None], float("-inf"))
            if extras:
                kv = k.shape[1]
                n = extras[0][0].shape[2]
                qg = _grouped(q.to(work), kv, n)
                s = _extra_scores(qg, extras, scale)
                total = torch.logaddexp(lse, torch.logsumexp(s, -1).reshape(B, H, T))
                p = s.sub_(_grouped(total[..., None], kv, n)).exp_()
                w = (lse - total).exp_().nan_to_num_(0.0)
                merged = torch.where(w[..., None] > 0, out * w[..., None], 0.0)
                e0 = 0
                for ek, ev in extras:
                    E = ek.shape[3]
                    part = torch.einsum("bkgnre,bkned->bkgnrd", p[..., e0:e0 + E], ev.to(work))
                    merged += part.reshape(merged.shape)
                    e0 += E
                out, lse = merged, total
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *flat)
        ctx.scale, ctx.base, ctx.n_extras, ctx.kernel, ctx.plan = scale, base, n_extras, kernel, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *flat = ctx.saved_tensors
        extras = [(flat[2 * i], flat[2 * i + 1]) for i in range(ctx.n_extras)]
        scale, base, kernel = ctx.scale, ctx.base, ctx.kernel
        work = _work(q.dtype)
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        dk = torch.zeros(k.shape, dtype=work, device=k.device)
        dv = torch.zeros(v.shape, dtype=work, device=v.device)
        for a, b, end in ctx.plan:
            causal, mask = _pattern(kernel, base, a, b, end, q.device)
            g = kernel.backward(dout[:, :, a:b], q[:, :, a:b], k[:, :, :end], v[:, :, :end], out[:, :, a:b],
                                lse[:, :, a:b], scale, causal, mask)
            dq[:, :, a:b] += g[0]
            dk[:, :, :end] += g[1]
            dv[:, :, :end] += g[2]
        grads = []
        if extras:
            kv = k.shape[1]
            n = extras[0][0].shape[2]
            qg = _grouped(q.to(work), kv, n)
            do = _grouped(dout.to(work), kv, n)
            delta = (do * _grouped(out.to(work), kv, n)).sum(-1, keepdim=True)
            p = _extra_scores(qg, extras, scale).sub_(_grouped(lse[..., None], kv, n)).exp_()
            dqg = torch.zeros_like(qg)
            e0 = 0
            for ek, ev in extras:
                E = ek.shape[3]
                pe = p[..., e0:e0 + E]
                ds = torch.einsum("bkgnrd,bkned->bkgnre", do, ev.to(work)).sub_(delta).mul_(pe).mul_(scale)
                dqg += torch.einsum("bkgnre,bkned->bkgnrd", ds, ek.to(work))
                grads += [torch.einsum("bkgnre,bkgnrd->bkned", ds, qg).to(ek.dtype),
                          torch.einsum("bkgnre,bkgnrd->bkned", pe, do).to(ev.dtype)]
                e0 += E
            dq += dqg.reshape(dq.shape)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, *grads)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, base: Prefix | None = None,
              extras: Extras = ()) -> torch.Tensor:
    """Softmax attention of q [B, H, T, hd] over the base keys k, v [B, Hkv, S, hd] as `base` lets each row see
    them (default causal) and over each row's `extras` (see the module's docstring): [B, H, T, hd]. Every row must
    see at least one key."""
    base = base if base is not None else Prefix()
    if extras:
        n = extras[0][0].shape[2]
        if q.shape[2] % n or any(ek.shape[2] != n or ev.shape[:4] != ek.shape[:4] for ek, ev in extras):
            raise ValueError(f"extras must be [B, Hkv, N, E, hd] with one N dividing the {q.shape[2]} query rows")
    low = _autocast_dtype(q.device.type)
    if low is not None:  # as SDPA under autocast: every input in its dtype (eagle3's later steps would bring float32
        q, k, v = q.to(low), k.to(low), v.to(low)  # queries, rotated by float32 cos/sin)
        extras = [(ek.to(low), ev.to(low)) for ek, ev in extras]
    flat = [t for pair in extras for t in pair]
    return MergedAttention.apply(q, k, v, scale, base, len(extras), *flat)
