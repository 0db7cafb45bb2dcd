"""The optimizer and its schedule: AdamW over parameter groups (weight decay on matrices only), warm-up then cosine
for the heads, and for the adapters of joint training (target.lora) the same shape after the heads' warm-up."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from ..config import Config


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """lr multiplier: linear warmup from 0 to 1 over warmup_steps, then cosine down to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def adapter_schedule(step: int, heads_warmup_steps: int, warmup_steps: int, total_steps: int,
                     min_lr_ratio: float) -> float:
    """The adapters' lr multiplier (target.lora): 0 through the heads' warm-up, then `warmup_cosine` over the rest."""
    if step < heads_warmup_steps:
        return 0.0
    return warmup_cosine(step - heads_warmup_steps, warmup_steps, total_steps - heads_warmup_steps, min_lr_ratio)


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: weight decay on matrices only. Biases and norm scales (1-D) are
    not pulled towards 0, which for a norm scale would shrink everything after it. With no decay, one
    group, as checkpoints written before the split hold."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not weight_decay:
        return [{"params": params, "weight_decay": 0.0}]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg: Config, heads: torch.nn.Module, adapters: torch.nn.Module | None, total_steps: int):
    """(AdamW, LambdaLR) for the heads and, in joint training, the adapters (their own lr, no decay, the last
    group); the schedule counts optimizer steps."""
    groups = param_groups(heads, cfg.train.weight_decay)
    if adapters is not None:
        groups.append({"params": list(adapters.parameters()), "lr": cfg.target.lora.lr, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr)
    shape = dict(warmup_steps=cfg.train.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.train.min_lr_ratio)
    schedules = [partial(warmup_cosine, **shape)] * len(groups)
    if adapters is not None:  # the adapters' group is the last
        schedules[-1] = partial(adapter_schedule, heads_warmup_steps=cfg.train.heads_warmup_steps, **shape)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
