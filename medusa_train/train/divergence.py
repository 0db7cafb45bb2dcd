"""When training has diverged: steps with a non-finite gradient norm in a row, a loss that explodes, weights that
are not finite. Each raises TrainingDiverged before anything is saved from it, naming the last good checkpoint."""

from __future__ import annotations

import math

import torch

from .checkpoints import latest_checkpoint
from ..config import Config
from ..base.errors import TrainingDiverged
from .metrics import Meter


def count_nonfinite(cfg: Config, accelerator, meter: Meter, finite: bool, step: int) -> None:
    """Count a skipped step; `train.max_nonfinite_steps` of them in a row stop the run (TrainingDiverged)."""
    if finite:
        meter.nonfinite_in_a_row = 0
        return
    meter.skipped_steps += 1
    meter.nonfinite_in_a_row += 1
    limit = cfg.train.max_nonfinite_steps
    accelerator.print(f"step {step}: gradient norm {float(meter.grad_norm)}: update skipped "
                          f"({meter.nonfinite_in_a_row} in a row)")
    if limit and meter.nonfinite_in_a_row >= limit:
        last = latest_checkpoint(cfg.output_dir)
        raise TrainingDiverged(
            f"training diverged: {limit} optimizer steps in a row (to step {step}) had a non-finite gradient norm; "
            f"stopped without saving. The last checkpoint is {last or 'none'}: lower train.lr (now "
            f"{cfg.train.lr:g}) or check the data, then resume from it (resume=PATH) or start over")


def check_loss_growth(cfg: Config, accelerator, meter: Meter, loss: float, step: int,
                      final: bool = False) -> None:
    """A loss that explodes is a divergence (finite or not): a window whose mean loss exceeds `train.max_loss_growth`
    x the best window's so far counts; two in a row, or one at the last step (whose heads would be the result),
    raise TrainingDiverged. A window back under the bound resets the count."""
    factor = cfg.train.max_loss_growth
    if not factor:
        return
    if meter.best_loss == math.inf:
        meter.best_loss = meter.start_loss(accelerator)
    if not loss > factor * meter.best_loss:  # a NaN loss counts as grown (its steps are also skipped)
        meter.best_loss = min(meter.best_loss, loss)
        meter.grown_in_a_row = 0
        return
    meter.grown_in_a_row += 1
    accelerator.print(f"step {step}: training loss {loss:.4g} is over {factor:g}x its best window "
                          f"({meter.best_loss:.4g}); {meter.grown_in_a_row} in a row")
    if meter.grown_in_a_row >= 2 or final:
        last = latest_checkpoint(cfg.output_dir)
        raise TrainingDiverged(
            f"training diverged: at step {step} the training loss is {loss:.4g}, over train.max_loss_growth="
            f"{factor:g} x its best ({meter.best_loss:.4g}); nothing was saved from it. The last good checkpoint is "
            f"{last or 'none'}: lower train.lr (now {cfg.train.lr:g}) and resume from it (resume=PATH), or start "
            "over")


def check_finite(objective: torch.nn.Module, step: int) -> None:
    """TrainingDiverged unless every trained weight (heads, and adapters in joint training) is finite (checked before
    anything is saved)."""
    bad = [name for name, p in objective.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if bad:
        raise TrainingDiverged(f"training diverged: at step {step} the heads' weights are not finite ({bad[0]}"
                               f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); nothing was saved: lower "
                               "train.lr and resume from the last checkpoint, or start over")
