"""The optimizer and its schedule: AdamW (or Muon on the hidden weight matrices and AdamW on the rest, train.optimizer)
over parameter groups (weight decay on matrices only), warm-up then cosine for the heads, and for the adapters of joint
training (target.lora) the same shape after the heads' warm-up."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from ..config import Config

MUON_MOMENTUM = 0.95  # speculators' and Muon's own default


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """lr multiplier: linear warmup from 0 to 1 over warmup_steps, then cosine down to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_steps(warmup: int | float, total_steps: int) -> int:
    """`train.warmup_steps` in steps: a fraction below 1 is that share of the run (at least one step when not 0)."""
    return int(warmup) if warmup >= 1 or not warmup else max(1, round(warmup * total_steps))


def adapter_schedule(step: int, heads_warmup_steps: int, warmup_steps: int, total_steps: int,
                     min_lr_ratio: float) -> float:
    """The adapters' lr multiplier (target.lora): 0 through the heads' warm-up, then `warmup_cosine` over the rest."""
    if step < heads_warmup_steps:
        return 0.0
    return warmup_cosine(step - heads_warmup_steps, warmup_steps, total_steps - heads_warmup_steps, min_lr_ratio)


def param_groups(module: torch.nn.Module, weight_decay: float, muon: bool = False) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: weight decay on matrices only. Biases and norm scales (1-D) are
    not pulled towards 0, which for a norm scale would shrink everything after it. With no decay, one
    group, as checkpoints written before the split hold. With `muon`, the hidden weight matrices (`muon_matrices`)
    form a group of their own first, marked `muon: True` (MuonAdamW marks every other group False)."""
    hidden = muon_matrices(module) if muon else []
    params = [p for p in module.parameters() if p.requires_grad and all(p is not h for h in hidden)]
    if not weight_decay:
        groups = [{"params": params, "weight_decay": 0.0}]
    else:
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if muon:
        groups.insert(0, {"params": hidden, "weight_decay": weight_decay, "muon": True})
    return [g for g in groups if g["params"]]


def muon_matrices(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights Muon trains: those of the linear layers inside the heads, trainable matrices (both sides > 1).
    Vocabulary projections (`lm_head`, `lm_heads.k`) and embeddings stay with AdamW, as in Muon's own practice: a
    row of them is one token's, and orthogonalizing the whole update mixes tokens."""
    return [m.weight for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and "lm_head" not in name
            and m.weight.requires_grad and min(m.weight.shape) > 1]


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Muon's Newton-Schulz iteration (Keller Jordan's quintic, torch.optim.Muon's coefficients): the update with its
    singular values pushed towards 1, its shape and directions kept."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.to(dtype)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x if wide else x.T).to(update.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon`, AdamW on the others, as one optimizer: one state dict, one lr a group, what
    Accelerate, checkpoints and LambdaLR take. Muon's update is torch.optim.Muon's (Nesterov momentum 0.95, 5
    Newton-Schulz steps, decoupled weight decay, lr scaled by 0.2 sqrt(max(rows, cols)) to match AdamW's update RMS,
    so one lr serves both), with its iteration in bfloat16 on a GPU as torch's and in float32 elsewhere (a CPU without
    AMX runs bfloat16 matrix products ~20x slower than float32 ones); AdamW's is a torch.optim.AdamW built over this
    optimizer's group dicts (the schedule's lr reaches it), its state kept in this optimizer's `state`, rebuilt
    whenever the groups are (load_state_dict)."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, momentum: float = MUON_MOMENTUM,
                 ns_steps: int = 5, ns_dtype: torch.dtype | None = None):
        super().__init__(groups, {"lr": lr, "muon": False, "momentum": momentum, "ns_steps": ns_steps})
        self.ns_dtype = ns_dtype
        self._link()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._link()

    def _link(self) -> None:
        adamw = [g for g in self.param_groups if not g["muon"]]
        self.adamw = torch.optim.AdamW(adamw, lr=adamw[0]["lr"]) if adamw else None
        if self.adamw is not None:
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["muon"]:
                continue
            lr, wd, m = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - m)
                update = p.grad.lerp(buf, m)  # Nesterov
                dtype = self.ns_dtype or (torch.bfloat16 if p.is_cuda else torch.float32)
                update = orthogonalize(update, group["ns_steps"], dtype)
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
        if self.adamw is not None:
            self.adamw.step()
        return loss


def build_optimizer(cfg: Config, heads: torch.nn.Module, adapters: torch.nn.Module | None, total_steps: int):
    """(AdamW or MuonAdamW, LambdaLR) for the heads and, in joint training, the adapters (their own lr, no decay,
    AdamW's, the last group); the schedule counts optimizer steps."""
    muon = cfg.train.optimizer == "muon"
    groups = param_groups(heads, cfg.train.weight_decay, muon)
    for group in groups:
        if group.get("muon") and cfg.train.muon_lr:
            group["lr"] = cfg.train.muon_lr
    if adapters is not None:
        groups.append({"params": list(adapters.parameters()), "lr": cfg.target.lora.lr, "weight_decay": 0.0})
    optimizer = MuonAdamW(groups, lr=cfg.train.lr) if muon else torch.optim.AdamW(groups, lr=cfg.train.lr)
    shape = dict(warmup_steps=warmup_steps(cfg.train.warmup_steps, total_steps), total_steps=total_steps,
                 min_lr_ratio=cfg.train.min_lr_ratio)
    schedules = [partial(warmup_cosine, **shape)] * len(groups)
    if adapters is not None:  # the adapters' group is the last
        schedules[-1] = partial(adapter_schedule, heads_warmup_steps=cfg.train.heads_warmup_steps, **shape)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
