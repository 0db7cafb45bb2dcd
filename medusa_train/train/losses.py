"""Per-head losses: KL to the target's own distribution (soft labels) and cross-entropy to the data.

Indexing (0-based head k, the docs' head k+1; docs/design.md): head k's state at position t has read x_{t+1}..x_{t+1+k}
and guesses x_{t+2+k}. It is scored against
  - the data token x_{t+2+k} (cross-entropy, `loss.ce_weight`), and
  - the target's distribution at position t+1+k, which is the target's own guess for x_{t+2+k}
    (KL(p_target || q_head), `loss.distill_weight`),
with weight `decay**k`, at positions where labels[t+2+k] != -100 (and t+2+k < T, and both ends attended).
Each head's loss is a mean over its supervised positions; the total is the weighted sum over heads.

Memory and compute: vocab-sized logits are computed per chunk of positions, and `FusedHeadLoss` turns
each head's chunk into its loss and its d-sized gradient at once, so no [chunk, V] tensor is kept for
backward or recomputed. The teacher's logits `lm_head(h)` are computed once per chunk and shared by all
heads (head k reads them shifted by k).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LossConfig
from ..kinds.heads import DraftHeads
from ..target.model import LogitTransform, chunk_positions

IGNORE = -100
# Columns of the per-head statistics tensor [K, len(STATS)]. All are sums over positions, so they add up
# across micro-steps and processes; divide by `count` at log time.
STATS = ("count", "kl", "ce", "top1_target", "top5_target", "top1_data", "top5_data", "ce_skipped", "tv", "conf_err")
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
    weight = heads.scoring_weight(k, lm_head) if heads.owns_lm_head else lm_head.weight
    return heads.logits(k, states.to(weight.dtype), lm_head).float()


def teacher_logits(lm_head: nn.Module, h: torch.Tensor, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The target's own logits at the given hidden states, in fp32 and without grad. With `weight` (and
    `bias`), the LM head's rows for some tokens, gathered once by the caller: only those columns, at that
    fraction of the cost."""
    with torch.no_grad():
        flat = h.reshape(-1, h.shape[-1]).to(lm_head.weight.dtype)  # 2-D: one matmul, not a batched one
        out = lm_head(flat) if weight is None else nn.functional.linear(flat, weight, bias)
        return out.float().view(*h.shape[:-1], out.shape[-1])


class FusedHeadLoss(torch.autograd.Function):
    """One head's logits, KL/CE loss and gradient in a single pass over a chunk of n positions.

    The gradient of the loss with respect to the logits is analytic,
        dL/dz = w * (distill_w * (q - p) + ce_w * (q - onehot(y))),
    so forward computes it right away and keeps only d-sized gradients for backward: the [n, V] logits
    live for the duration of this call and are never recomputed (2 vocab matmuls per head instead of the
    3 a checkpointed chunk needs, 3 when the head owns its LM head). A trainable weight's [V, d] gradient is not
    kept per chunk: pass the weight detached and `weight_grad`, a buffer every chunk adds its share into, which
    `AccumulatedGrad` hands the weight once (so memory does not grow with the chunks: 8 chunks x 4 heads x 1 GiB at a
    128k vocabulary and d 4096 in bfloat16, before).
    """

    @staticmethod
    def forward(ctx, states: torch.Tensor, weight: torch.Tensor, teacher_logp: torch.Tensor | None,
                target_idx: torch.Tensor, pos_weight: torch.Tensor, distill_w: float, ce_w: float,
                transform: LogitTransform | None = None, weight_grad: torch.Tensor | None = None, tv_w: float = 0.0,
                extra: torch.Tensor | None = None, extra_grad: torch.Tensor | None = None, rates: bool = False
                ) -> tuple[torch.Tensor, ...]:
        # states [n, d] (weight's dtype), or [n, d + r] with `extra` [V, r] scoring the last r columns (a kind's
        # logit bias, dspark's Markov head; its gradient is added to `extra_grad`); weight [V, d]; teacher_logp [n, V]
        # fp32 or None; target_idx [n] (-1: not in the scored vocab); pos_weight [n] = mask * decay**k / count;
        # transform: the target's final-logit transform (a scale, a soft cap), applied to the heads' logits too.
        # Returns the loss, the summed KL, CE and total variation (with tv_w or `rates`) over the real positions, the
        # top 5, and (`rates`) each position's acceptance rate sum_v min(p_v, q_v) = 1 - TV (else empty).
        d = weight.shape[1]
        z = (states[:, :d] @ weight.t()).float()  # [n, V]
        if extra is not None:
            z += (states[:, d:] @ extra.t()).float()
        dz = None
        if transform is not None and not transform.identity:
            z = transform(z)
            dz = transform.derivative(z)  # d z' / d z, for the chain rule below
        logq = torch.log_softmax(z, dim=-1)  # [n, V]
        del z
        top5 = logq.topk(min(5, logq.shape[-1]), dim=-1).indices  # [n, 5], for the metrics
        mask = (pos_weight != 0).float()
        in_vocab = (target_idx >= 0).float()
        y = target_idx.clamp_min(0).unsqueeze(-1)
        kl = ce = tv = logq.new_zeros(logq.shape[0])
        accept = logq.new_zeros(0)
        q = logq.exp()
        grad = q * (pos_weight * (distill_w + ce_w * in_vocab)).unsqueeze(-1)  # [n, V]; built in place below
        if teacher_logp is not None:
            p = teacher_logp.exp()
            if tv_w > 0 or rates:  # (an [n, V] temporary: only when asked)
                tv = 1.0 - torch.minimum(p, q).sum(-1)
                if rates:
                    accept = 1.0 - tv
            if tv_w > 0:  # d TV / d z = q (s - <s, q>) / 2 with s = sign(q - p)
                sign = torch.sign(q - p)
                sign.sub_((sign * q).sum(-1, keepdim=True)).mul_(q).mul_((0.5 * tv_w * pos_weight).unsqueeze(-1))
                grad.add_(sign)
                del sign
            if distill_w > 0:
                kl = (p * (teacher_logp - logq)).sum(-1)
                grad.sub_(p.mul_((pos_weight * distill_w).unsqueeze(-1)))
            del p
        if ce_w > 0:
            ce = -logq.gather(-1, y).squeeze(-1)
            grad.scatter_add_(-1, y, -(pos_weight * ce_w * in_vocab).unsqueeze(-1))
        del q, logq
        if dz is not None:
            grad.mul_(dz)
            del dz
        loss = (pos_weight * (distill_w * kl + ce_w * in_vocab * ce + tv_w * tv)).sum()
        needs_states, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_states = (grad.to(weight.dtype) @ weight) if needs_states else None  # [n, d]
        if needs_states and extra is not None:
            grad_states = torch.cat([grad_states, grad.to(extra.dtype) @ extra], dim=1)  # [n, d + r]
        grad_weight = (grad.t().to(states.dtype) @ states[:, :d]) if needs_weight else None  # [V, d]
        if weight_grad is not None:  # [V, d]: summed over chunks here, given to the weight once (AccumulatedGrad)
            weight_grad.addmm_(grad.t().to(weight_grad.dtype), states[:, :d].to(weight_grad.dtype))
        if extra_grad is not None:
            extra_grad.addmm_(grad.t().to(extra_grad.dtype), states[:, d:].to(extra_grad.dtype))
        ctx.save_for_backward(grad_states, grad_weight)
        ctx.mark_non_differentiable(top5, accept)
        return (loss, (kl * mask).sum().detach(), (ce * mask * in_vocab).sum().detach(), top5,
                (tv * mask).sum().detach(), accept.detach())

    @staticmethod
    def backward(ctx, grad_loss, _kl, _ce, _top5, _tv, _accept):
        grad_states, grad_weight = ctx.saved_tensors
        return (None if grad_states is None else grad_states * grad_loss,
                None if grad_weight is None else grad_weight * grad_loss, None, None, None, None, None, None, None,
                None, None, None, None)


class AccumulatedGrad(torch.autograd.Function):
    """A zero term of the loss whose backward gives `weight` the gradient its chunks summed into `acc` (each chunk's
    loss enters the total with weight 1, so one upstream gradient scales them all)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(acc)
        ctx.dtype = weight.dtype
        return acc.new_zeros(())

    @staticmethod
    def backward(ctx, grad_out):
        (acc,) = ctx.saved_tensors
        return (acc * grad_out).to(ctx.dtype), None


def grad_buffers(weights: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """One float32 gradient buffer per distinct trainable weight (by identity), when gradients are being taken."""
    if not torch.is_grad_enabled():
        return {}
    return {id(w): torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in weights if w.requires_grad}


def hand_over(loss: torch.Tensor, weights: list[torch.Tensor], buffers: dict[int, torch.Tensor]) -> torch.Tensor:
    """`loss` with each buffered weight's summed gradient attached (`AccumulatedGrad`), each weight once."""
    seen = {}
    for w in weights:
        seen.setdefault(id(w), w)
    for key, w in seen.items():
        if key in buffers:
            loss = loss + AccumulatedGrad.apply(w, buffers[key])
    return loss


def chunked_head_losses(heads: DraftHeads, states: torch.Tensor, h: torch.Tensor, greedy: torch.Tensor,
                        input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                        lm_head: nn.Module | None, cfg: LossConfig, transform: LogitTransform | None = None,
                        token_sums: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Total loss (a scalar) and per-head statistics [K, len(STATS)] (sums; see `STATS`). The loss is each head's
    mean over its supervised positions times decay**k; with `token_sums`, its sum over them (`HeadsObjective`).

    states [K, B, T, d] from `heads(h, input_ids, embed)`; h [B, T, d] the target's hidden states and greedy
    [B, T] its greedy token at every position (both from `TargetStates`); `lm_head` the target's frozen LM head
    (the teacher, and the heads' scorer unless they own one). Positions are processed in chunks of about
    `cfg.chunk_size` (over B x T); within a chunk the teacher's logits are computed once, over the heads'
    scored vocabulary only (a draft vocabulary's columns), and shared by all heads; each head's vocab-sized
    tensors exist only inside its `FusedHeadLoss` call. Accuracies compare against the greedy tokens. `transform`:
    the target's final-logit transform (`medusa_train.target.model.logit_transform`), applied to teacher and heads
    alike.
    """
    K, B, T, d = states.shape
    target_ids, valid = head_targets(input_ids, labels, attention_mask, K)  # [K, B, T]
    target_idx = draft_index(heads, target_ids)
    counts = valid.sum(dim=(1, 2)).float()  # [K]; stays on device
    decay = torch.tensor([cfg.decay ** k for k in range(K)], device=states.device)
    # each head's mean over its positions, or (`token_sums`) its sum, which the trainer divides by the step's count
    pos_weight = valid.float() * (decay if token_sums else decay / counts.clamp_min(1)).view(K, 1, 1)  # [K, B, T]
    # position u of these holds u+1's: the target's state and greedy token one ahead, padded for the last
    # chunk's heads (head k at position t reads the teacher at t+1+k)
    h_next = torch.cat([shift_left(h, 1, 0.0), h.new_zeros(B, K, h.shape[-1])], dim=1)
    greedy_next = torch.cat([shift_left(greedy, 1, 0), greedy.new_zeros(B, K)], dim=1)
    shared = not heads.owns_lm_head  # every head scores with the target's LM head: gather its rows once
    weights = [heads.scoring_weight(0, lm_head)] * K if shared else [heads.scoring_weight(k, lm_head) for k in range(K)]
    # the teacher's rows: the target's LM head over the heads' scored vocabulary (None: all of it, as is)
    teacher_w = teacher_b = None
    if heads.spec.draft_vocab_size:
        teacher_w = weights[0] if shared else lm_head.weight[heads.draft_ids]
        teacher_b = None if getattr(lm_head, "bias", None) is None else lm_head.bias[heads.draft_ids]

    step = chunk_positions(cfg.chunk_size, B, heads.spec.scored_vocab, states.device)
    loss = states.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(K, len(STATS), device=states.device)
    scored = scored_weights(heads, weights)
    buffers = grad_buffers(scored)
    for a in range(0, T, step):
        b = min(a + step, T)
        c = b - a
        teacher_logp = None
        if needs_teacher(heads, cfg):  # soft labels, normalised over the scored vocabulary
            teacher = teacher_logits(lm_head, h_next[:, a:b + K - 1], teacher_w, teacher_b)  # [B, c+K-1, V']
            if transform is not None and not transform.identity:
                teacher = transform(teacher)
            teacher_logp = torch.log_softmax(teacher, dim=-1)
            del teacher
        teacher_top = greedy_next[:, a:b + K - 1]  # the target's greedy token (a target id), for the accuracies
        for k in range(K):
            p_k = None if teacher_logp is None else teacher_logp[:, k:k + c].reshape(B * c, -1)
            loss = loss + _head_chunk(heads, k, states[k, :, a:b].reshape(B * c, d), weights[k], p_k,
                                      target_ids[k, :, a:b].reshape(-1), target_idx[k, :, a:b].reshape(-1),
                                      valid[k, :, a:b].reshape(-1), pos_weight[k, :, a:b].reshape(-1),
                                      teacher_top[:, k:k + c].reshape(-1), cfg, transform, stats, buffers)
    return hand_over(loss, scored, buffers), stats


def scored_weights(heads: DraftHeads, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The heads' scoring weights, and the kind's extra scoring matrix if it has one (each may take a buffer)."""
    extra = heads.extra_scoring_weight()
    return weights if extra is None else [*weights, extra]


def needs_teacher(heads: DraftHeads, cfg: LossConfig) -> bool:
    """Whether the loss reads the target's distribution: KL, total variation, or a confidence head's target."""
    return cfg.distill_weight > 0 or cfg.tv_weight > 0 or (heads.has_confidence and cfg.confidence_weight > 0)


def _head_chunk(heads: DraftHeads, k: int, s: torch.Tensor, w: torch.Tensor, teacher_logp: torch.Tensor | None,
                target_ids: torch.Tensor, target_idx: torch.Tensor, valid: torch.Tensor, pos_weight: torch.Tensor,
                greedy: torch.Tensor, cfg: LossConfig, transform: LogitTransform | None, stats: torch.Tensor,
                buffers: dict[int, torch.Tensor]) -> torch.Tensor:
    """Head k's loss over n positions (states s [n, d], scored by w, and by the kind's `extra_scoring_weight` past
    d; the teacher's log-probabilities, data tokens, their scored-vocabulary indices, validity, weights and the
    target's greedy tokens, each [n, ...]); its statistics are added to stats[k]. A weight with a buffer in `buffers`
    (`grad_buffers`) has its gradient added there instead of kept. A kind with a confidence head has it learn each
    position's acceptance rate sum_v min(p_v, q_v) (binary cross-entropy, `loss.confidence_weight`)."""
    extra = heads.extra_scoring_weight()
    conf = heads.confidence(k, s) if teacher_logp is not None and cfg.confidence_weight > 0 else None
    w_grad, e_grad = buffers.get(id(w)), None if extra is None else buffers.get(id(extra))
    head_loss, kl, ce, top5, tv, accept = FusedHeadLoss.apply(
        s.to(w.dtype), w if w_grad is None else w.detach(), teacher_logp, target_idx, pos_weight, cfg.distill_weight,
        cfg.ce_weight, transform, w_grad, cfg.tv_weight, None if extra is None else extra.detach(), e_grad,
        conf is not None)
    conf_err = head_loss.new_zeros(())
    if conf is not None:  # binary cross-entropy to the measured rate, weighted as the position's other terms
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
        head_loss = head_loss + (pos_weight * cfg.confidence_weight * bce).sum()
        conf_err = ((conf.detach().float().sigmoid() - accept).abs() * (pos_weight != 0)).sum()
    with torch.no_grad():  # accuracies as target ids, kept on device
        mask = valid.float()
        top5 = heads.to_target_ids(top5)
        greedy, data = greedy[:, None], target_ids[:, None]
        stats[k] += torch.stack([
            mask.sum(), kl, ce,
            ((top5[:, :1] == greedy).any(-1) * mask).sum(), ((top5 == greedy).any(-1) * mask).sum(),
            ((top5[:, :1] == data).any(-1) * mask).sum(), ((top5 == data).any(-1) * mask).sum(),
            (~(target_idx >= 0) * mask).sum(), tv, conf_err,
        ]).float()
    return head_loss


def anchored_head_losses(heads: DraftHeads, states: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                         h: torch.Tensor, greedy: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                         attention_mask: torch.Tensor | None, lm_head: nn.Module, cfg: LossConfig,
                         transform: LogitTransform | None = None, token_sums: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_head_losses` for states at some positions only: states [K, B, N, d] at positions `anchors` [B, N]
    (`anchor_valid` marks real ones), as dflash trains (`medusa_train.kinds.dflash`). Head k at position t is scored as
    there (data token x_{t+2+k}, the target's distribution at t+1+k, weight decay**k over its supervised positions);
    the teacher's logits (`lm_head`, the target's) are computed per head at the positions it reads."""
    K, B, N, d = states.shape
    T = input_ids.shape[1]
    ids_k, valid_k = head_targets(input_ids, labels, attention_mask, K)  # [K, B, T]: head k at t
    gather = anchors[None].expand(K, B, N)
    target_ids = ids_k.gather(2, gather)  # [K, B, N]
    valid = valid_k.gather(2, gather) & anchor_valid[None]
    target_idx = draft_index(heads, target_ids)
    counts = valid.sum(dim=(1, 2)).float()
    decay = torch.tensor([cfg.decay ** k for k in range(K)], device=states.device)
    pos_weight = valid.float() * (decay if token_sums else decay / counts.clamp_min(1)).view(K, 1, 1)
    teacher_at = (anchors[None] + 1 + torch.arange(K, device=anchors.device).view(K, 1, 1)).clamp_max(T - 1)
    teacher_w = teacher_b = None
    if heads.spec.draft_vocab_size:  # the teacher's rows: the target's LM head over the draft vocabulary, gathered once
        teacher_w = lm_head.weight[heads.draft_ids]
        teacher_b = None if getattr(lm_head, "bias", None) is None else lm_head.bias[heads.draft_ids]
    step = chunk_positions(cfg.chunk_size, B, heads.spec.scored_vocab, states.device)
    loss = states.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(K, len(STATS), device=states.device)
    weights = [heads.scoring_weight(k, lm_head) for k in range(K)]
    scored = scored_weights(heads, weights)
    buffers = grad_buffers(scored)
    for k in range(K):
        for a in range(0, N, step):
            b = min(a + step, N)
            at = teacher_at[k, :, a:b]  # [B, c]
            teacher_logp = None
            if needs_teacher(heads, cfg):
                hk = h.gather(1, at[..., None].expand(-1, -1, h.shape[-1]))
                teacher = teacher_logits(lm_head, hk, teacher_w, teacher_b)
                if transform is not None and not transform.identity:
                    teacher = transform(teacher)
                teacher_logp = torch.log_softmax(teacher, dim=-1).reshape(-1, teacher.shape[-1])
                del teacher
            loss = loss + _head_chunk(heads, k, states[k, :, a:b].reshape(-1, d), weights[k],
                                      teacher_logp, target_ids[k, :, a:b].reshape(-1),
                                      target_idx[k, :, a:b].reshape(-1), valid[k, :, a:b].reshape(-1),
                                      pos_weight[k, :, a:b].reshape(-1), greedy.gather(1, at).reshape(-1), cfg,
                                      transform, stats, buffers)
    return hand_over(loss, scored, buffers), stats


class HeadsObjective(nn.Module):
    """The trainable part of a training step as one module: heads forward plus their chunked loss.

    Accelerate wraps this (DDP/FSDP) so that everything touching head parameters runs inside one
    `forward`. The target's frozen embedding and LM head are passed per call, never registered here, so
    checkpoints and optimizers hold head parameters only.
    """

    def __init__(self, heads: DraftHeads, cfg: LossConfig, transform: LogitTransform | None = None,
                 token_sums: bool = False):
        super().__init__()
        self.heads = heads
        self.cfg = cfg
        self.transform = transform  # the target's final-logit transform (None: the identity)
        # the loss summed over positions, not averaged: the trainer divides a step's gradient by the positions of the
        # whole step (every micro-batch, every process), so that a token weighs the same in a short row's batch as in
        # a long row's (`trainer.micro_step`)
        self.token_sums = token_sums

    def forward(self, h: torch.Tensor, greedy: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None, embed: nn.Module, lm_head: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, stats [K, len(STATS)]) for a batch whose target features are h [B, T, feature_size] (h_t, then the
        states of the layers the heads read) and whose target greedy tokens are `greedy` [B, T] (`TargetStates`). The
        heads' kind says which positions a step trains (`training_states`: every one, or some, as dflash's anchors)."""
        dtype = next(self.heads.parameters()).dtype
        supervised = labels != IGNORE
        if attention_mask is not None:
            supervised &= attention_mask.bool()
        states, positions, valid = self.heads.training_states(h.to(dtype), input_ids, supervised, attention_mask, embed)
        h = h[..., :self.heads.spec.hidden_size]  # the teacher reads h_t
        if positions is not None:
            return anchored_head_losses(self.heads, states, positions, valid, h, greedy, input_ids, labels,
                                        attention_mask, lm_head, self.cfg, self.transform, self.token_sums)
        return chunked_head_losses(self.heads, states, h, greedy, input_ids, labels, attention_mask, lm_head,
                                   self.cfg, self.transform, self.token_sums)


def summarize(stats: torch.Tensor, cfg: LossConfig) -> dict[str, float]:
    """Per-head metrics from summed statistics [K, len(STATS)] (one host sync): loss, kl, ce, accuracies."""
    K = stats.shape[0]
    s = stats.double().cpu()
    count = s[:, COL["count"]].clamp_min(1)
    out: dict[str, float] = {}
    total = 0.0
    for k in range(K):
        terms = {c: (w, float(s[k, COL[c]] / count[k]))
                 for c, w in (("kl", cfg.distill_weight), ("ce", cfg.ce_weight), ("tv", cfg.tv_weight))}
        head_loss = sum(w * v for w, v in terms.values())
        total += cfg.decay ** k * head_loss
        name = f"head{k + 1}"
        out[f"{name}/loss"] = head_loss
        out |= {f"{name}/{c}": v for c, (w, v) in terms.items() if w > 0}
        if s[k, COL["conf_err"]] > 0:  # a confidence head's mean |predicted - measured| acceptance rate
            out[f"{name}/confidence_error"] = float(s[k, COL["conf_err"]] / count[k])
        for col in ("top1_target", "top5_target", "top1_data", "top5_data"):
            out[f"{name}/{col}"] = float(s[k, COL[col]] / count[k])
        if s[k, COL["ce_skipped"]] > 0:
            out[f"{name}/ce_skipped"] = float(s[k, COL["ce_skipped"]] / count[k])
    out["loss"] = total
    out["supervised_positions"] = float(s[0, COL["count"]])
    return out
