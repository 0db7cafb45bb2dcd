"""Held-out evaluation: per-head top-k acceptance along a chain, and the expected tau it implies.

For head k (1-based) at position t the reference is the target's greedy token at position t+k (its guess
for x_{t+1+k}). Head k is counted only where the path before it is right: for every j < k, head j's
top-1 equals the target's greedy token at t+j *and* the data token x_{t+1+j} equals it too, so that the
teacher-forced tokens head k has read are exactly what the engine would feed it after accepting heads
1..k-1. `topk_accuracy[k][r]` is the probability that the target's token is exactly head k's (r+1)-th
candidate given a right path (not cumulative), and the expected tau of a chain (one candidate per head,
the bonus token included) is

    tau = 1 + sum_k prod_{j <= k} topk_accuracy[j][0].

`acceptance.json` in the output directory holds these numbers; the inference engine builds its static
tree from them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from .config import LossConfig
from .heads import DraftHeads
from .losses import (STATS, chunk_positions, chunked_head_losses, head_logits, head_targets, shift_left, summarize,
                     teacher_logits)
from .target import target_hidden

MAX_RANK = 10
ACCEPTANCE_NAME = "acceptance.json"


@torch.no_grad()
def conditional_rank_hits(heads: DraftHeads, states: torch.Tensor, h: torch.Tensor, input_ids: torch.Tensor,
                          labels: torch.Tensor, attention_mask: torch.Tensor | None, lm_head: nn.Module | None,
                          chunk_size: int = 1024, max_rank: int = MAX_RANK) -> torch.Tensor:
    """Per-sequence counts [B, K, max_rank + 1]: column r < max_rank counts positions where the target's
    greedy token is exactly head k's (r+1)-th candidate, given a right path; the last column counts the
    positions where head k was scored (valid and right path)."""
    K, B, T, _ = states.shape
    target_ids, valid = head_targets(input_ids, labels, attention_mask, K)  # [K, B, T]
    h_next = shift_left(h, 1, 0.0)
    h_next = torch.cat([h_next, h_next.new_zeros(B, K, h.shape[-1])], dim=1)
    out = torch.zeros(B, K, max_rank + 1, device=states.device)
    step = chunk_positions(chunk_size, B, heads.spec.vocab_size, states.device)
    for a in range(0, T, step):
        b = min(a + step, T)
        c = b - a
        greedy_all = teacher_logits(lm_head, h_next[:, a:b + K - 1]).argmax(-1)  # [B, c+K-1] target ids
        path_right = torch.ones(B, c, dtype=torch.bool, device=states.device)
        for k in range(K):
            greedy = greedy_all[:, k:k + c]  # the target's token at t+1+k for x_{t+2+k}
            logits = head_logits(heads, k, states[k, :, a:b], lm_head)  # [B, c, Vs]
            top = heads.to_target_ids(logits.topk(min(max_rank, logits.shape[-1]), dim=-1).indices)
            counted = valid[k, :, a:b] & path_right
            hits = (top == greedy.unsqueeze(-1)) & counted.unsqueeze(-1)  # [B, c, R]
            out[:, k, :hits.shape[-1]] += hits.sum(1).float()
            out[:, k, max_rank] += counted.sum(1).float()
            data = target_ids[k, :, a:b]
            path_right = counted & (top[..., 0] == greedy) & (data == greedy)
    return out


def acceptance_from_hits(hits: torch.Tensor) -> dict[str, Any]:
    """{"topk_accuracy": [[p(rank r) for r in 1..R] per head], "expected_tau", "positions"} from summed
    hits [K, R + 1] (the last column: positions counted per head)."""
    hits = hits.double().cpu()
    counted = hits[:, -1]
    acc = [[float(x) for x in hits[k, :-1] / max(float(counted[k]), 1.0)] for k in range(hits.shape[0])]
    tau, chain = 1.0, 1.0
    for row in acc:
        chain *= row[0]
        tau += chain
    return {"topk_accuracy": acc, "expected_tau": tau, "positions": int(counted[0]),
            "positions_per_head": [int(x) for x in counted]}


@torch.no_grad()
def evaluate(heads: DraftHeads, target: nn.Module, batches: Iterable[dict[str, torch.Tensor]],
             loss_cfg: LossConfig, max_batches: int = 0, accelerator=None) -> tuple[dict[str, float], dict[str, Any]]:
    """Run the heads over held-out batches: (metrics, acceptance).

    metrics: eval loss, per-head accuracies (as in training) and `expected_tau`; acceptance: the contents
    of acceptance.json. With an `accelerator`, per-sequence counts are gathered across processes with
    `gather_for_metrics`, so duplicated padding samples are dropped.
    """
    was_training = heads.training
    heads.eval()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    dtype = next(heads.parameters()).dtype
    K = heads.spec.num_heads
    stats = torch.zeros(K, len(STATS))
    hits = torch.zeros(K, MAX_RANK + 1)
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        h = target_hidden(target, ids, mask)
        states = heads(h.to(dtype), ids, embed)
        # per-sequence loss statistics, so that gather_for_metrics can drop duplicated samples
        per_seq = torch.stack([chunked_head_losses(heads, states[:, b:b + 1], h[b:b + 1], ids[b:b + 1],
                                                   labels[b:b + 1], mask[b:b + 1], lm_head, loss_cfg)[1]
                               for b in range(ids.shape[0])])  # [B, K, S]
        seq_hits = conditional_rank_hits(heads, states, h, ids, labels, mask, lm_head, loss_cfg.chunk_size)
        if accelerator is not None:
            per_seq, seq_hits = accelerator.gather_for_metrics((per_seq, seq_hits))
        stats += per_seq.sum(0).cpu()
        hits += seq_hits.sum(0).cpu()
    heads.train(was_training)
    acceptance = acceptance_from_hits(hits)
    metrics = summarize(stats, loss_cfg)
    metrics["expected_tau"] = acceptance["expected_tau"]
    for k, row in enumerate(acceptance["topk_accuracy"]):
        metrics[f"head{k + 1}/accept_top1"] = row[0]
    return metrics, acceptance


def save_acceptance(directory: str | os.PathLike, acceptance: dict[str, Any], split: str) -> Path:
    """Write acceptance.json (temp file, then rename) and return its path."""
    path = Path(directory) / ACCEPTANCE_NAME
    tmp = path.with_name(f".{ACCEPTANCE_NAME}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(acceptance | {"split": split}, indent=2) + "\n")
    os.replace(tmp, path)
    return path
