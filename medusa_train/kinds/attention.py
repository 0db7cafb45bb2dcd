"""Masked attention for training the kinds' own layers (eagle3's training-time test, dflash's anchored blocks), whose
patterns are neither causal nor full: memory that grows with the queries times the keys, not with their product kept
for backward.

`masked_attention(q, k, v, mask_of, scale)` is `scaled_dot_product_attention` with a boolean mask given by
`mask_of(a, b)` for query rows a..b-1 (True: attend). On a CPU it is that call (PyTorch's CPU flash kernel takes masks
and grouped heads, keeping no scores). Elsewhere it is `ChunkedAttention`: CUDA's flash kernel takes no mask and its
memory-efficient kernel no grouped heads, so a masked grouped call would run the math kernel and keep fp32 scores
[B, H, T, S] for backward (for an 8B target's eagle3 heads at 4 x 2048 tokens, ~2 GiB for each of the K steps).
`ChunkedAttention` computes the same softmax attention a chunk of query rows at a time and keeps only q, k, v, the
output and each row's log-sum-exp; backward recomputes each chunk's probabilities (FlashAttention's scheme, in
PyTorch ops). `MODE` overrides the choice (tests, and measuring one against the other on one machine).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

MaskOf = Callable[[int, int], torch.Tensor]  # (a, b) -> bool [B or 1, 1, b - a, S]: rows a..b-1 may attend where True
CHUNK_BYTES = 128 << 20  # the fp32 scores of one chunk of rows, across the batch and every head (two such live at once)
MODE = "auto"  # "auto": sdpa on a CPU, chunked elsewhere; "sdpa"; "chunked"


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_of: MaskOf, scale: float
                     ) -> torch.Tensor:
    """Softmax attention of q [B, H, T, hd] over k, v [B, Hkv, S, hd] (Hkv divides H), row t attending where
    `mask_of` says (every row must see at least one key): [B, H, T, hd]."""
    mode = MODE if MODE != "auto" else ("sdpa" if q.device.type == "cpu" else "chunked")
    if mode == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_of(0, q.shape[2]), scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    B, H, T, _ = q.shape
    chunk = max(1, CHUNK_BYTES // (4 * B * H * k.shape[2]))
    return ChunkedAttention.apply(q, k, v, mask_of, scale, chunk)


def _work(t: torch.Tensor) -> torch.dtype:
    """The dtype scores are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(qg: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores [B, Hkv, G, c, S] (float32 at least) of grouped queries qg [B, Hkv, G, c, hd], masked ones -inf."""
    s = torch.einsum("bkgcd,bksd->bkgcs", qg.to(_work(qg)), k.to(_work(qg)))
    return s.mul_(scale).masked_fill_(~mask[:, :, None], float("-inf"))


class ChunkedAttention(torch.autograd.Function):
    """`masked_attention` a chunk of query rows at a time; saves q, k, v, the output and the rows' log-sum-exp only."""

    @staticmethod
    def forward(ctx, q, k, v, mask_of: MaskOf, scale: float, chunk: int):
        B, H, T, hd = q.shape
        kv = k.shape[1]
        qg = q.view(B, kv, H // kv, T, hd)
        out = torch.empty(B, kv, H // kv, T, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(B, kv, H // kv, T, dtype=_work(q), device=q.device)
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            s = _scores(qg[:, :, :, a:b], k, mask_of(a, b), scale)
            lse[..., a:b] = torch.logsumexp(s, dim=-1)
            p = s.sub_(lse[..., a:b, None]).exp_()  # in place: one [.., c, S] tensor a chunk
            out[:, :, :, a:b] = torch.einsum("bkgcs,bksd->bkgcd", p, v.to(p.dtype)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask_of, ctx.scale, ctx.chunk = mask_of, scale, chunk
        return out.view(B, H, T, -1)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, T, hd = q.shape
        kv = k.shape[1]
        qg = q.view(B, kv, H // kv, T, hd)
        work = _work(q)
        dog = grad_out.reshape(out.shape).to(work)  # [B, Hkv, G, T, hd_v]
        delta = (dog * out.to(work)).sum(-1)  # [B, Hkv, G, T]: the softmax's backward term
        dq = torch.empty(qg.shape, dtype=work, device=q.device)
        dk = torch.zeros(k.shape, dtype=work, device=k.device)
        dv = torch.zeros(v.shape, dtype=work, device=v.device)
        kf, vf = k.to(work), v.to(work)
        for a in range(0, T, ctx.chunk):
            b = min(a + ctx.chunk, T)
            qc = qg[:, :, :, a:b].to(work)
            p = _scores(qc, k, ctx.mask_of(a, b), ctx.scale).sub_(lse[..., a:b, None]).exp_()  # [B, Hkv, G, c, S]
            do = dog[:, :, :, a:b]
            dv += torch.einsum("bkgcs,bkgcd->bksd", p, do)
            ds = torch.einsum("bkgcd,bksd->bkgcs", do, vf).sub_(delta[..., a:b, None]).mul_(p)  # two live a chunk
            dq[:, :, :, a:b] = torch.einsum("bkgcs,bksd->bkgcd", ds, kf) * ctx.scale
            dk += torch.einsum("bkgcs,bkgcd->bksd", ds, qc) * ctx.scale
        return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
