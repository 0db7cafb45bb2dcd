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
    form a group of their own first, marked `muon: True`."""
    params = [p for p in module.parameters() if p.requires_grad]
    hidden = muon_matrices(module) if muon else []
    params = [p for p in params if all(p is not h for h in hidden)]
    if not weight_decay:
        groups = [{"params": params, "weight_decay": 0.0}]
    else:
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if muon:
        groups = [{"params": hidden, "weight_decay": weight_decay, "muon": True},
                  *(g | {"muon": False} for g in groups)]
    return [g for g in groups if g["params"]]


def muon_matrices(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights Muon trains: those of the linear layers inside the heads, trainable matrices (both sides > 1).
    Vocabulary projections (`lm_head`, `lm_heads.k`) and embeddings stay with AdamW, as in Muon's own practice: a
    row of them is one token's, and orthogonalizing the whole update mixes tokens."""
    return [m.weight for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and "lm_head" not in name
            and m.weight.requires_grad and min(m.weight.shape) > 1]


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon`, AdamW on the others, as one optimizer: one state dict, one lr a group, what
    Accelerate, checkpoints and LambdaLR take. The updates are torch's own: a torch.optim.Muon (its lr matched to
    AdamW's update RMS, `match_rms_adamw`, so one lr serves both) and a torch.optim.AdamW, built over this optimizer's
    group dicts (the schedule's lr reaches them) and keeping their state in this optimizer's `state`; they are rebuilt
    whenever the groups are (load_state_dict)."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, momentum: float = MUON_MOMENTUM):
        super().__init__(groups, {"lr": lr, "muon": False, "muon_momentum": momentum})
        self._link()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._link()

    def _link(self) -> None:
        muon = [g for g in self.param_groups if g["muon"]]
        adamw = [g for g in self.param_groups if not g["muon"]]
        self.parts: list[torch.optim.Optimizer] = []
        if muon:
            self.parts.append(torch.optim.Muon(muon, lr=muon[0]["lr"], momentum=muon[0]["muon_momentum"],
                                               adjust_lr_fn="match_rms_adamw"))
        if adamw:
            self.parts.append(torch.optim.AdamW(adamw, lr=adamw[0]["lr"]))
        for part in self.parts:
            part.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss


def build_optimizer(cfg: Config, heads: torch.nn.Module, adapters: torch.nn.Module | None, total_steps: int):
    """(AdamW or MuonAdamW, LambdaLR) for the heads and, in joint training, the adapters (their own lr, no decay,
    AdamW's, the last group); the schedule counts optimizer steps."""
    muon = cfg.train.optimizer == "muon"
    groups = param_groups(heads, cfg.train.weight_decay, muon)
    if adapters is not None:
        groups.append({"params": list(adapters.parameters()), "lr": cfg.target.lora.lr, "weight_decay": 0.0}
                      | ({"muon": False} if muon else {}))
    optimizer = MuonAdamW(groups, lr=cfg.train.lr) if muon else torch.optim.AdamW(groups, lr=cfg.train.lr)
    shape = dict(warmup_steps=cfg.train.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.train.min_lr_ratio)
    schedules = [partial(warmup_cosine, **shape)] * len(groups)
    if adapters is not None:  # the adapters' group is the last
        schedules[-1] = partial(adapter_schedule, heads_warmup_steps=cfg.train.heads_warmup_steps, **shape)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
