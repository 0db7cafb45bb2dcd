"""Checkpoints: write, verify, rotate, resume, and compare a resumed run's recipe with the checkpoint's.

A checkpoint is `output_dir/checkpoints/step-N`: Accelerate's `save_state` (heads, optimizer, scheduler, sampler and
every process's RNG), the data position, the resolved recipe, and last a manifest of every file's size and sha256.
It is written into a temp directory, fsynced and renamed into place; rotation removes old and damaged ones and never
keeps a damaged one in place of one that verifies; resume takes the newest that verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from ..config import Config, ConfigError
from ..base.files import atomic_write_text, fsync_path

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
MANIFEST_NAME = "manifest.json"
RECIPE_NAME = "recipe.yaml"
METRICS_NAME = "metrics.jsonl"
def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """`checkpoints/step-N` directories, newest first (a save's `.tmp-*` and a rotation's `.trash-*` excluded)."""
    root = Path(output_dir) / CHECKPOINTS
    return sorted((p for p in root.glob("step-*") if p.name[5:].isdigit()), key=lambda p: -int(p.name[5:]))


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint whose manifest verifies (every file present, of its size and checksum)."""
    return next((p for p in checkpoints(output_dir) if verify_checkpoint(p) is None), None)


def verify_checkpoint(path: Path) -> str | None:
    """None if `path` holds every file its manifest lists, with the size and sha256 recorded; else what is wrong,
    as the tail of a sentence. The manifest is written last, so a save cut short has none."""
    manifest = path / MANIFEST_NAME
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST_NAME} is missing or unreadable (a save or a rotation was cut short)"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} is {f.stat().st_size} bytes, the manifest says {want['size']}"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum (damaged)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(accelerator, cfg: Config, position: dict[str, int]) -> Path:
    """accelerator.save_state into a temp dir, plus the data position and resolved recipe, and last a manifest of
    every file's size and sha256; all fsynced, then renamed to checkpoints/step-N. Rotation to
    `train.keep_checkpoints` renames an old checkpoint to `.trash-*` before deleting it. A crash at any point
    leaves nothing that verifies but the checkpoints that are complete."""
    root = Path(cfg.output_dir) / CHECKPOINTS
    final = root / f"step-{position['step']}"
    tmp = root / f".tmp-step-{position['step']}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # heads, optimizer, scheduler, sampler, RNG of every process
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / RECIPE_NAME).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        (tmp / TRAINER_STATE).write_text(json.dumps(position, indent=2) + "\n")
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            fsync_path(f)
            files[str(f.relative_to(tmp))] = {"size": f.stat().st_size, "sha256": _sha256(f)}
        (tmp / MANIFEST_NAME).write_text(json.dumps({"files": files}, indent=1) + "\n")
        fsync_path(tmp / MANIFEST_NAME)
        fsync_path(tmp)
        if final.exists():
            os.replace(final, root / f".trash-{final.name}")
        os.replace(tmp, final)
        fsync_path(root)
        for old in rotated_out(cfg.output_dir, final, cfg.train.keep_checkpoints):
            trash = root / f".trash-{old.name}"
            os.replace(old, trash)  # never a half-deleted step-N that could look complete
            shutil.rmtree(trash, ignore_errors=True)
        for trash in root.glob(".trash-*"):
            shutil.rmtree(trash, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def rotated_out(output_dir: str | os.PathLike, newest: Path, keep: int) -> list[Path]:
    """The checkpoints a rotation removes: all but the newest `keep` that verify (`newest`, just written and checked,
    among them). A damaged one is never kept in place of one that verifies: it is removed, and said so, so that a
    second fault cannot leave nothing to resume from. Verifies (sha256) only until `keep` good ones are found."""
    kept, out = [newest], []
    for ckpt in checkpoints(output_dir):
        if ckpt == newest:
            continue
        if len(kept) >= keep:
            out.append(ckpt)
            continue
        problem = verify_checkpoint(ckpt)
        if problem is None:
            kept.append(ckpt)
        else:
            print(f"checkpoints: removing {ckpt}, which does not verify ({problem})", flush=True)
            out.append(ckpt)
    return out


def remove_stale_files(output_dir: str | os.PathLike) -> None:
    """What interrupted writes left behind: checkpoint temp and trash directories, atomic writes' temp files."""
    out = Path(output_dir)
    for d in list((out / CHECKPOINTS).glob(".tmp-*")) + list((out / CHECKPOINTS).glob(".trash-*")):
        shutil.rmtree(d, ignore_errors=True)
    for f in out.glob(".*.tmp-*"):
        f.unlink(missing_ok=True)


# Keys a resumed run may change: they decide how long it runs and what it logs or keeps, never the math of a step
# (a changed max_steps or epochs changes where the schedule ends, which is what asking for more steps means).
RESUMABLE_CHANGES = ("output_dir", "resume", "train.max_steps", "train.epochs", "train.log_every", "train.save_every",
                     "train.keep_checkpoints", "train.max_nonfinite_steps", "train.max_loss_growth",
                     "train.cache_hidden", "train.hidden_cache_dir", "data.num_proc", "loss.chunk_size", "eval.",
                     "tracking.")


def resume_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint `cfg.resume` names, verified against its manifest. `auto`: the newest that verifies, saying in
    one line what is wrong with each newer one it passes over (None: start afresh); a path that does not verify
    is a ConfigError naming the file."""
    if cfg.resume == "none":
        return None
    if cfg.resume != "auto":
        problem = verify_checkpoint(Path(cfg.resume))
        if problem is not None:
            raise ConfigError(f"resume={cfg.resume}: {problem}; pick another checkpoint (resume=auto takes the newest "
                              "that verifies) or start afresh (resume=none)")
        return Path(cfg.resume)
    for ckpt in checkpoints(cfg.output_dir):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"resume: skipping {ckpt}: {problem}", flush=True)
    return None


def check_resumable(cfg: Config, ckpt: Path) -> list[str]:
    """The settings this run changes from the checkpoint's recipe. Any change outside RESUMABLE_CHANGES raises
    ConfigError naming every such key with both values and the ways on; the allowed ones are returned."""
    saved_path = ckpt / RECIPE_NAME
    if not saved_path.is_file():
        return []
    flat_saved, flat_now = _flatten(yaml.safe_load(saved_path.read_text()) or {}), _flatten(cfg.to_dict())
    flat_saved.setdefault("train.optimizer", "adamw")  # a recipe from before train.optimizer trained with AdamW
    changed = [k for k in flat_now if k in flat_saved and flat_saved[k] != flat_now[k]]
    resized = _same_steps_on_other_processes(ckpt, flat_saved, flat_now)
    refused = [k for k in changed if not any(k == a or (a.endswith(".") and k.startswith(a))
                                            for a in RESUMABLE_CHANGES) and not (resized and k in SPLIT_KEYS)]
    if refused:
        diffs = "; ".join(f"{k}={flat_now[k]!r} (the checkpoint has {flat_saved[k]!r})" for k in refused)
        raise ConfigError(f"resume: {ckpt} was trained with other settings: {diffs}. Resume with the checkpoint's "
                          f"values, or start a new run: resume=none (from trained heads: heads.init_from=DIR)")
    return [f"{k}: {flat_saved[k]!r} -> {flat_now[k]!r}" for k in changed]


SPLIT_KEYS = ("train.batch_size", "train.grad_accum")


def processes_of(ckpt: Path) -> int:
    """How many processes wrote a checkpoint (Accelerate saves one RNG state a process); 0 if it cannot tell."""
    return len(list(Path(ckpt).glob("random_states_*.pkl")))


def _same_steps_on_other_processes(ckpt: Path, saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether this run, on another number of processes, splits each step as the checkpoint's run did: the same rows
    a step (batch_size x grad_accum) and the same rows a forward on each process (batch_size / processes), so its
    steps are the checkpoint run's steps (e.g. 2 processes at batch_size 4 -> 1 process at batch_size 2, grad_accum
    2)."""
    before, after = processes_of(ckpt), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        b0, g0, b1, g1 = (int(d[k]) for d in (saved, now) for k in SPLIT_KEYS)
    except (KeyError, TypeError, ValueError):
        return False
    return before > 0 and b0 * g0 == b1 * g1 and b0 * after == b1 * before


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume(run, ckpt: Path | None) -> None:
    """Restore heads, optimizer, scheduler, sampler and RNG from `ckpt`, and the data position."""
    if ckpt is None:
        return
    run.accelerator.load_state(str(ckpt))  # each process's RNG where the checkpoint has one (fewer processes: not all)
    run.position = json.loads((ckpt / TRAINER_STATE).read_text())
    saved = yaml.safe_load((ckpt / RECIPE_NAME).read_text()) if (ckpt / RECIPE_NAME).is_file() else {}
    old_accum, cfg = int((saved.get("train") or {}).get("grad_accum", run.cfg.train.grad_accum)), run.cfg
    if old_accum != cfg.train.grad_accum:  # the position counts a process's micro-batches: the same steps, re-counted
        run.position["batch_in_epoch"] = run.position["batch_in_epoch"] // old_accum * cfg.train.grad_accum
    written_by, now = processes_of(ckpt), run.accelerator.num_processes
    if written_by and written_by != now:  # the data order and each step's rows do not depend on the process count
        old_batch = int((saved.get("train") or {}).get("batch_size", cfg.train.batch_size))
        same = old_batch * now == cfg.train.batch_size * written_by
        run.accelerator.print(
            f"resume: the checkpoint was written by {written_by} process{'es' if written_by > 1 else ''}, this run has "
            f"{now}: the same rows a step, in the same order" + (", split as before" if same else
                f", each forward now taking {cfg.train.batch_size // now} rows instead of {old_batch // written_by} "
                "(a step weighs every supervised position alike however its rows are split: the same steps)"))
    p = run.position
    metrics = Path(run.cfg.output_dir) / METRICS_NAME
    if run.accelerator.is_main_process and metrics.is_file():  # rows logged after the checkpoint are logged again
        rows = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= p["step"]]
        atomic_write_text(metrics, "".join(f"{line}\n" for line in rows))
    run.accelerator.print(f"resumed from {ckpt} at step {p['step']} (epoch {p['epoch']}, batch {p['batch_in_epoch']})")
