"""Per-head losses: KL to the target's own distribution (soft labels) and cross-entropy to the data.

Indexing (0-based head k, DESIGN.md's head k+1): head k's state at position t has read x_{t+1}..x_{t+1+k}
and guesses x_{t+2+k}. It is scored against
  - the data token x_{t+2+k} (cross-entropy, `loss.ce_weight`), and
  - the target's distribution at position t+1+k, which is the target's own guess for x_{t+2+k}
    (KL(p_target || q_head), `loss.distill_weight`),
with weight `decay**k`, at positions where labels[t+2+k] != -100 (and t+2+k < T, and both ends attended).
Each head's loss is a mean over its supervised positions; the total is the weighted sum over heads.

Memory: vocab-sized logits are computed per chunk of positions inside `torch.utils.checkpoint`, so the
forward keeps only the [K, B, chunk, d] states; a chunk's logits (teacher included) exist only while that
chunk is being computed or recomputed in backward. The teacher's logits `lm_head(h)` are computed once per
chunk and shared by all heads (head k reads them shifted by k).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import LossConfig
from .heads import DraftHeads

IGNORE = -100
# Columns of the per-head statistics tensor [K, len(STATS)]. All are sums over positions, so they add up
# across micro-steps and processes; divide by `count` at log time.
STATS = ("count", "kl", "ce", "top1_target", "top5_target", "top1_data", "top5_data", "ce_skipped")
COL = {name: i for i, name in enumerate(STATS)}


def shift_left(x: torch.Tensor, n: int, fill: int | float) -> torch.Tensor:
    """x[:, n:] padded at the end with `fill` to the same length: out[:, t] = x[:, t+n]. x: [B, T, ...]."""
    pad = x.new_full((x.shape[0], n) + tuple(x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def head_targets(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                 num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data targets and supervision mask for every head.

    Returns `target_ids` [K, B, T] (x_{t+2+k}) and `valid` [K, B, T] bool: labels[t+2+k] != -100,
    t+2+k < T and positions t and t+2+k attended.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    supervised = (labels != IGNORE) & attention_mask.bool()
    target_ids, valid = [], []
    for k in range(num_heads):
        target_ids.append(shift_left(input_ids, 2 + k, 0))
        valid.append(shift_left(supervised, 2 + k, False) & attention_mask.bool())
    return torch.stack(target_ids), torch.stack(valid)


def draft_index(heads: DraftHeads, target_ids: torch.Tensor) -> torch.Tensor:
    """Target token ids -> indices into the heads' scored vocabulary; -1 where a token is not in it."""
    if not heads.spec.draft_vocab_size:
        return target_ids
    inverse = torch.full((heads.spec.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
    inverse[heads.draft_ids] = torch.arange(heads.spec.draft_vocab_size, device=target_ids.device)
    return inverse[target_ids]


def head_logits(heads: DraftHeads, k: int, states: torch.Tensor, lm_head: nn.Module | None) -> torch.Tensor:
    """Head k's logits in fp32, casting states to the dtype of whichever LM head scores them."""
    weight = heads.lm_heads[k].weight if heads.lm_heads is not None else lm_head.weight
    return heads.logits(k, states.to(weight.dtype), lm_head).float()


def teacher_logits(lm_head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The target's own logits at the given hidden states, in fp32 and without grad."""
    with torch.no_grad():
        return lm_head(h.to(lm_head.weight.dtype)).float()


def _chunk_loss(heads: DraftHeads, lm_head: nn.Module | None, cfg: LossConfig, states: torch.Tensor,
                h_next: torch.Tensor, target_idx: torch.Tensor, target_ids: torch.Tensor, valid: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and statistics for one chunk of c positions.

    states [K, B, c, d]; h_next [B, c+K-1, d] (target hidden states at t+1 .. t+c+K-1);
    target_idx / target_ids / valid [K, B, c]; scale [K] = decay**k / supervised count of head k.
    """
    K, _, c, _ = states.shape
    teacher = teacher_logits(lm_head, h_next)  # [B, c+K-1, V]
    teacher_top = teacher.argmax(-1)  # the target's greedy token, as a target id
    if heads.spec.draft_vocab_size:  # soft labels renormalised over the draft vocabulary
        teacher = teacher[..., heads.draft_ids]
    teacher_logp = torch.log_softmax(teacher, dim=-1)
    del teacher
    if cfg.distill_weight > 0:
        # KL(p || q) = sum p log p - sum p log q; the first term is shared by all heads (no grad)
        teacher_p = teacher_logp.exp()
        neg_entropy = (teacher_p * teacher_logp).sum(-1)  # [B, c+K-1]

    loss = states.new_zeros((), dtype=torch.float32)
    stats = []
    for k in range(K):
        logq = torch.log_softmax(head_logits(heads, k, states[k], lm_head), dim=-1)  # [B, c, Vs]
        mask = valid[k].float()
        kl = ce = mask.new_zeros(())
        if cfg.distill_weight > 0:
            # KL(p || q) per position, p = the target's distribution at t+1+k
            kl = ((neg_entropy[:, k:k + c] - (teacher_p[:, k:k + c] * logq).sum(-1)) * mask).sum()
        in_vocab = target_idx[k] >= 0
        if cfg.ce_weight > 0:
            nll = -logq.gather(-1, target_idx[k].clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [B, c]
            ce = (nll * (mask * in_vocab)).sum()
        loss = loss + scale[k] * (cfg.distill_weight * kl + cfg.ce_weight * ce)

        with torch.no_grad():  # accuracies as target ids, kept on device
            top5 = heads.to_target_ids(logq.topk(min(5, logq.shape[-1]), dim=-1).indices)  # [B, c, 5]
            greedy = teacher_top[:, k:k + c].unsqueeze(-1)
            data = target_ids[k].unsqueeze(-1)
            stats.append(torch.stack([
                mask.sum(), kl.detach(), ce.detach(),
                ((top5[..., :1] == greedy).any(-1) * mask).sum(), ((top5 == greedy).any(-1) * mask).sum(),
                ((top5[..., :1] == data).any(-1) * mask).sum(), ((top5 == data).any(-1) * mask).sum(),
                (~in_vocab * mask).sum(),
            ]).float())
    return loss, torch.stack(stats)


def chunked_head_losses(heads: DraftHeads, states: torch.Tensor, h: torch.Tensor, input_ids: torch.Tensor,
                        labels: torch.Tensor, attention_mask: torch.Tensor | None, lm_head: nn.Module | None,
                        cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Total loss (a scalar) and per-head statistics [K, len(STATS)] (sums; see `STATS`).

    states [K, B, T, d] from `heads(h, input_ids, embed)`; h [B, T, d] the target's hidden states;
    `lm_head` the target's frozen LM head (the teacher, and the heads' scorer unless they own one).
    Positions are processed in chunks of about `cfg.chunk_size` (over B x T); each chunk is checkpointed,
    so its vocab-sized tensors are freed after its forward and rebuilt one chunk at a time in backward.
    """
    K, B, T, _ = states.shape
    target_ids, valid = head_targets(input_ids, labels, attention_mask, K)  # [K, B, T]
    target_idx = draft_index(heads, target_ids)
    counts = valid.sum(dim=(1, 2)).float()  # [K]; stays on device
    decay = torch.tensor([cfg.decay ** k for k in range(K)], device=states.device)
    scale = decay / counts.clamp_min(1)
    h_next = shift_left(h, 1, 0.0)  # h_next[:, u] = h[:, u+1]
    h_next = torch.cat([h_next, h_next.new_zeros(B, K, h.shape[-1])], dim=1)  # room for the last chunk's heads

    step = max(1, cfg.chunk_size // B)  # positions along T per chunk
    loss = states.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(K, len(STATS), device=states.device)
    for a in range(0, T, step):
        b = min(a + step, T)
        args = (states[:, :, a:b], h_next[:, a:b + K - 1], target_idx[:, :, a:b], target_ids[:, :, a:b],
                valid[:, :, a:b], scale)
        if torch.is_grad_enabled() and states.requires_grad:
            chunk_loss, chunk_stats = checkpoint(_chunk_loss, heads, lm_head, cfg, *args, use_reentrant=False)
        else:
            chunk_loss, chunk_stats = _chunk_loss(heads, lm_head, cfg, *args)
        loss = loss + chunk_loss
        stats = stats + chunk_stats
    return loss, stats


class HeadsObjective(nn.Module):
    """The trainable part of a training step as one module: heads forward plus their chunked loss.

    Accelerate wraps this (DDP/FSDP) so that everything touching head parameters runs inside one
    `forward`. The target's frozen embedding and LM head are passed per call, never registered here, so
    checkpoints and optimizers hold head parameters only.
    """

    def __init__(self, heads: DraftHeads, cfg: LossConfig):
        super().__init__()
        self.heads = heads
        self.cfg = cfg

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None, embed: nn.Module, lm_head: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, stats [K, len(STATS)]) for a batch whose target hidden states are h [B, T, d]."""
        dtype = next(self.heads.parameters()).dtype
        states = self.heads(h.to(dtype), input_ids, embed)  # [K, B, T, d]
        return chunked_head_losses(self.heads, states, h, input_ids, labels, attention_mask, lm_head, self.cfg)


def summarize(stats: torch.Tensor, cfg: LossConfig) -> dict[str, float]:
    """Per-head metrics from summed statistics [K, len(STATS)] (one host sync): loss, kl, ce, accuracies."""
    K = stats.shape[0]
    s = stats.double().cpu()
    count = s[:, COL["count"]].clamp_min(1)
    out: dict[str, float] = {}
    total = 0.0
    for k in range(K):
        kl, ce = float(s[k, COL["kl"]] / count[k]), float(s[k, COL["ce"]] / count[k])
        head_loss = cfg.distill_weight * kl + cfg.ce_weight * ce
        total += cfg.decay ** k * head_loss
        name = f"head{k + 1}"
        out[f"{name}/loss"] = head_loss
        if cfg.distill_weight > 0:
            out[f"{name}/kl"] = kl
        if cfg.ce_weight > 0:
            out[f"{name}/ce"] = ce
        for col in ("top1_target", "top5_target", "top1_data", "top5_data"):
            out[f"{name}/{col}"] = float(s[k, COL[col]] / count[k])
        if s[k, COL["ce_skipped"]] > 0:
            out[f"{name}/ce_skipped"] = float(s[k, COL["ce_skipped"]] / count[k])
    out["loss"] = total
    out["supervised_positions"] = float(s[0, COL["count"]])
    return out
