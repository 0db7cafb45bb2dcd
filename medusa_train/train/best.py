"""The best heads so far, by what they accept (`train.keep_best`), kept in `output_dir/best/`.

Loss keeps falling while acceptance stops rising, so the run scores each evaluation by the recipe's measure: the
real tau the engine measured (`tau`), or the held-out expected tau of the static tree at `eval.tau_budget`
(`expected_tau`). An evaluation that beats the best so far (strictly: an earlier step wins a tie) rewrites
`best/` as a whole (heads, that step's acceptance.json, best.json with the step and the value), staged beside it and
renamed into place, so a crash leaves the old best or the new one. A resumed run takes the best up to its
checkpoint's step back from best.json; a fresh run starts without one. At the end `output_dir` gets the best heads
unless the measure is `last`, and `output_dir/last/` the last step's (when they are not the best).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from .evaluate import ACCEPTANCE_NAME
from ..base.files import WEIGHTS_NAME, atomic_write_dir, write_json
from .processes import full_params

BEST_DIR = "best"
BEST_NAME = "best.json"
LAST_DIR = "last"  # the last step's heads, when the run ends with the best


def keep_best_metric(cfg: Config, has_eval_split: bool) -> str:
    """`train.keep_best` with `auto` resolved: tau, expected_tau or last."""
    k = cfg.train.keep_best
    if k != "auto":
        return k
    if cfg.target.lora.r:  # joint training: the adapter trains too, and best/ keeps heads only
        return "last"
    if cfg.eval.tau_every:
        return "tau"
    if cfg.eval.every and has_eval_split:
        return "expected_tau"
    return "last"


@dataclass
class Best:
    metric: str  # tau | expected_tau | last
    step: int = -1
    value: float = -math.inf

    def score(self, cfg: Config, metrics: dict[str, float] | None, tau: dict[str, Any] | None) -> float | None:
        """This evaluation's value of the measure (None: it did not measure it)."""
        if self.metric == "tau":
            return None if tau is None else float(tau["tau"])
        if self.metric == "expected_tau" and metrics is not None:
            return metrics.get(f"expected_tau@{cfg.eval.tau_budget}")
        return None

    def beaten_by(self, value: float | None) -> bool:
        """Whether `value` is a new best (never, for `last`: its score is always None, so its step stays -1)."""
        return value is not None and math.isfinite(value) and value > self.value

    def row(self) -> dict[str, Any]:
        """What metrics.jsonl and W&B record of the best so far."""
        return {"best/step": self.step, f"best/{self.metric}": self.value}


def best_dir(cfg: Config) -> Path:
    return Path(cfg.output_dir) / BEST_DIR


def restore_best(cfg: Config, metric: str, resumed_step: int | None) -> Best:
    """The best so far of the run being resumed (at `resumed_step`; None: a fresh run). A best from after the
    checkpoint, or by another measure, is not taken: the resumed run measures those steps again."""
    record = best_dir(cfg) / BEST_NAME
    if resumed_step is not None and record.is_file():
        saved = json.loads(record.read_text())
        if saved.get("metric") == metric and saved.get("step", math.inf) <= resumed_step:
            return Best(metric, int(saved["step"]), float(saved["value"]))
    return Best(metric)


def drop_stale_best(cfg: Config, best: Best) -> None:
    """Remove a `best/` that is not the restored best (an older run's, or from after the checkpoint), and any `last/`
    (written only when a run ends). Main process."""
    path = best_dir(cfg)
    if best.step < 0 and path.exists():
        shutil.rmtree(path)
    shutil.rmtree(Path(cfg.output_dir) / LAST_DIR, ignore_errors=True)


def write_best(cfg: Config, best: Best, heads, acceptance: dict[str, Any], split: str,
               extra: dict[str, Any]) -> Path:
    """Rewrite `best/` as a whole: the heads (their config records the step), acceptance.json, best.json."""
    record = {"metric": best.metric, "step": best.step, "value": best.value}
    training = {"best_step": best.step, **extra}
    return write_heads_dir(best_dir(cfg), heads, acceptance, split, best.step, training, record)


def write_heads_dir(directory: Path, heads, acceptance: dict[str, Any], split: str, step: int,
                    training: dict[str, Any], record: dict[str, Any] | None = None) -> Path:
    """A heads directory the engine loads (heads, acceptance.json; with `record`, best.json), written as a whole."""
    def write(staging: Path) -> None:
        heads.save_pretrained(staging, extra={"training": training})
        write_json(staging / ACCEPTANCE_NAME, acceptance | {"split": split, "step": step})
        if record is not None:
            write_json(staging / BEST_NAME, record)

    return atomic_write_dir(directory, write)


def load_best_heads(cfg: Config, accelerator, objective, heads) -> dict[str, Any]:
    """Load `best/`'s heads into `heads` on every process (FSDP: into the gathered parameters, sharded back);
    returns that step's acceptance."""
    from safetensors.torch import load_file

    directory = best_dir(cfg)
    state = load_file(str(directory / WEIGHTS_NAME))
    with full_params(accelerator, objective, writeback=True):
        heads.load_state_dict({k: state[k].to(v.device, v.dtype) for k, v in heads.state_dict().items()})
    accelerator.wait_for_everyone()
    acceptance = json.loads((directory / ACCEPTANCE_NAME).read_text())
    return {k: v for k, v in acceptance.items() if k not in ("split", "step")}
