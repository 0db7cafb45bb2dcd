"""What a run reports: the metrics of each logging window (kept on the device, read with one host sync), the
rows of `metrics.jsonl`, and the W&B tracker."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from .checkpoints import METRICS_NAME
from ..config import Config
from .losses import COL, STATS, summarize

COUNT = COL["count"]


class Meter:
    """Training metrics since the last log, kept on device so that a step makes no host sync; `row` reduces
    them across processes and reads them with one transfer."""

    def __init__(self, num_heads: int, device: torch.device, joint: bool = False) -> None:
        self.stats = torch.zeros(num_heads, len(STATS), device=device)  # summed per-head stats (losses.STATS)
        self.lm_kl = torch.zeros(2, device=device) if joint else None  # target.lora: KL sum and positions
        self.loss = torch.zeros((), device=device)  # summed over positions (the objective's token sums)
        self.positions = torch.zeros((), device=device)  # the supervised positions the loss was summed over
        self.step_positions = torch.zeros((), device=device)  # those of the optimizer step under way, this process
        self.tokens = torch.zeros((), device=device, dtype=torch.long)
        self.grad_norm = torch.zeros((), device=device)  # of the last optimizer step
        self.micro_steps = 0
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient norm, since the run started
        self.nonfinite_in_a_row = 0
        self.best_loss = math.inf  # the lowest mean loss of a logging window so far (`train.max_loss_growth`)
        self.first_loss: torch.Tensor | None = None  # of this run's first micro-batch, before any update
        self.grown_in_a_row = 0  # windows in a row whose loss grew past max_loss_growth x best_loss
        self.restart_clock()

    def add(self, loss: torch.Tensor, stats: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """A micro-batch's loss (summed over its positions) and statistics."""
        positions = stats[0, COUNT].detach()
        if self.first_loss is None:
            self.first_loss = loss.detach() / positions.clamp_min(1)
        self.stats += stats.detach()
        self.loss += loss.detach()
        self.positions += positions
        self.step_positions += positions
        self.tokens += attention_mask.sum()
        self.micro_steps += 1

    def bank_tokens(self, accelerator, position: dict[str, int]) -> None:
        """Add the tokens seen since the last log to `position`, which a checkpoint keeps, and count afresh (a run
        resumed from a step between two logs would otherwise lose them)."""
        position["tokens"] += int(accelerator.reduce(self.tokens, "sum"))
        self.tokens.zero_()

    def start_loss(self, accelerator) -> float:
        """The mean loss of the first micro-batch of every process, before any update: the start a loss is measured
        against, even when the first logging window already holds the explosion (a collective: every process calls
        it, at the same step)."""
        return float(accelerator.reduce(self.first_loss, "sum") / accelerator.num_processes)

    def window_loss(self, accelerator) -> float | None:
        """The loss per supervised position since the last log, across processes (a host sync: called where a
        checkpoint is saved), or None if no micro-step ran since."""
        if not self.micro_steps:
            return None
        both = accelerator.reduce(torch.stack([self.loss, self.positions]), "sum")
        return float(both[0] / both[1].clamp_min(1))

    def step_scale(self, accelerator) -> torch.Tensor:
        """What the step's accumulated gradient is multiplied by so that it is the gradient of the loss per
        supervised position of the whole step (every micro-batch, every process): Accelerate divided each micro-batch's
        by the accumulation steps and DDP averages over the processes, so GA x processes / the step's positions. A
        small all-reduce, on the device (no host sync); starts the next step's count."""
        total = accelerator.reduce(self.step_positions, "sum")  # a copy (one process: as it is)
        self.step_positions.zero_()
        return accelerator.gradient_accumulation_steps * accelerator.num_processes / total.clamp_min(1)

    def restart_clock(self) -> None:
        """tokens/s measures training only: restart after evaluating or saving."""
        self.t0 = time.perf_counter()

    def row(self, accelerator, cfg: Config, position: dict[str, int], lr: float) -> dict[str, float]:
        """The metrics row of this log step (adds the tokens seen to `position`), then start over."""
        stats = accelerator.reduce(self.stats, "sum")
        both = accelerator.reduce(torch.stack([self.loss, self.positions]), "sum")
        loss = both[0] / both[1].clamp_min(1)
        tokens = int(accelerator.reduce(self.tokens, "sum"))  # the host sync
        position["tokens"] += tokens
        row = {f"train/{k}": v for k, v in summarize(stats, cfg.loss).items()}
        row.update({"train/loss": float(loss), "train/lr": lr, "train/grad_norm": float(self.grad_norm),
                    "train/tokens_per_s": tokens / (time.perf_counter() - self.t0),
                    "train/epoch": position["epoch"], "train/tokens": position["tokens"],
                    "train/skipped_steps": self.skipped_steps,
                    "train/peak_memory_gib": peak_memory_gib(accelerator.device)})
        if self.lm_kl is not None:  # how far the adapted target is from the original, on the training batches
            kl = accelerator.reduce(self.lm_kl, "sum")
            row["train/lm_kl"] = float(kl[0] / kl[1].clamp_min(1))
            self.lm_kl.zero_()
        self.stats.zero_(), self.loss.zero_(), self.positions.zero_(), self.tokens.zero_()
        self.micro_steps = 0
        self.restart_clock()
        return row


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far, in GiB: what torch allocated on a CUDA device, the resident set of the
    process otherwise (Linux's ru_maxrss, in KiB). The main process's, which a sharded run's others match."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return host_peak_bytes() / 2 ** 30


def cache_counts(accelerator, states) -> dict[str, int]:
    """With the hidden-state cache: the rows the target ran on and those read from the cache so far, all processes
    (one small reduce, on log steps only)."""
    if not states.cache:
        return {}
    counts = torch.tensor([states.computed_rows, states.cached_rows], device=accelerator.device)
    computed, cached = accelerator.reduce(counts, "sum").tolist()
    return {"train/rows_from_target": computed, "train/rows_from_cache": cached}


def host_peak_bytes() -> int:
    """This process's peak resident memory so far, in bytes (Linux's ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def log_row(accelerator, cfg: Config, step: int, row: dict[str, Any]) -> None:
    """Send a row to the tracker and append it to metrics.jsonl (main process only)."""
    accelerator.log(row, step=step)
    if accelerator.is_main_process:
        with open(Path(cfg.output_dir) / METRICS_NAME, "a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")


def wandb_offline() -> bool:
    """W&B runs offline when neither WANDB_API_KEY nor WANDB_MODE is set."""
    return not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE")


def setup_tracking(accelerator, cfg: Config) -> None:
    """Start the W&B tracker (offline when there is neither WANDB_API_KEY nor WANDB_MODE)."""
    if cfg.tracking.backend != "wandb":
        return
    offline = wandb_offline()
    kwargs: dict[str, Any] = {"dir": str(Path(cfg.output_dir).resolve())}
    if cfg.tracking.run_name:
        kwargs["name"] = cfg.tracking.run_name
    if cfg.tracking.entity:
        kwargs["entity"] = cfg.tracking.entity
    if offline:
        kwargs["mode"] = "offline"
    accelerator.init_trackers(cfg.tracking.project, config=cfg.to_dict(), init_kwargs={"wandb": kwargs})
    if offline and accelerator.is_main_process:
        run_dir = Path(accelerator.get_tracker("wandb", unwrap=True).dir).parent
        accelerator.print(f"wandb: offline run in {run_dir} (no WANDB_API_KEY); upload it with: wandb sync {run_dir}")


def log_acceptance(accelerator, cfg: Config, step: int, acceptance: dict[str, Any], final: bool = False) -> None:
    """W&B (online or offline): a table of per-head, per-rank acceptance at this evaluation and, at the end, the
    expected tau of the best static tree against its budget as a line plot (acceptance.json keeps the same curve)."""
    if cfg.tracking.backend != "wandb" or not accelerator.is_main_process:
        return
    import wandb

    acc = acceptance["topk_accuracy"]
    rows = [[k + 1, r + 1, p, sum(row[:r + 1])] for k, row in enumerate(acc) for r, p in enumerate(row)]
    data: dict[str, Any] = {"eval/acceptance": wandb.Table(columns=["head", "rank", "p", "cumulative"], data=rows)}
    if final:
        curve = wandb.Table(columns=["budget", "expected_tau"],
                            data=[[b, t] for b, t in enumerate(acceptance["expected_tau_curve"])])
        data["eval/expected_tau_curve"] = wandb.plot.line(curve, "budget", "expected_tau",
                                                          title="expected tau of the best static tree by budget")
    accelerator.get_tracker("wandb", unwrap=True).log(data, step=step)
