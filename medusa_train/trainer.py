"""The training loop: an explicit Accelerate loop over a frozen target and trainable draft heads.

    for each micro-batch:
        h = target_hidden(target, batch)                 # frozen, no_grad            [B, T, d]
        loss, stats = objective(h, batch, embed, lm_head) # heads + chunked KL/CE      (only heads learn)
        backward; on a sync step: clip, optimizer step, lr schedule, zero grads
        every log_every steps: reduce stats across processes, one host sync, log
        every eval.every steps: held-out eval; every save_every steps: atomic checkpoint

Outputs in `output_dir`: the heads (`config.json` + `model.safetensors`), `recipe.yaml` (the resolved
config), `acceptance.json` (per-head top-k acceptance, read by the inference engine), `metrics.jsonl`
(one row per log step and per eval), `checkpoints/step-N/` and, with W&B, `wandb/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.data import DataLoader

from .config import Config, ConfigError
from .data import build_datasets, collate, select_draft_vocab, token_counts
from .evaluate import evaluate, save_acceptance
from .heads import DraftHeads, atomic_write, fingerprint_difference, target_fingerprint
from .losses import STATS, HeadsObjective, greedy_tokens, summarize
from .target import load_model, load_tokenizer, target_hidden

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
RECIPE_NAME = "recipe.yaml"
METRICS_NAME = "metrics.jsonl"


@dataclass
class TrainResult:
    """What `train` leaves behind: where, how far, and the in-memory heads and (still frozen) target."""

    output_dir: Path
    step: int
    stopped: bool
    """True when a signal stopped the run early (a checkpoint was saved; resume with resume=auto)."""
    heads: DraftHeads
    target: torch.nn.Module
    acceptance: dict[str, Any] | None


# ---------------------------------------------------------------------------------------------------
# Small pieces the loop is made of


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """lr multiplier: linear warmup from 0 to 1 over warmup_steps, then cosine down to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StopRequest:
    """SIGTERM / SIGINT set a flag that the loop checks after each optimizer step (save, then exit).

    A second signal gets the default behaviour, so a stuck run can still be killed.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint and stopping after this step",
              flush=True)

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete `checkpoints/step-N` (temp dirs of an interrupted save are ignored)."""
    root = Path(output_dir) / CHECKPOINTS
    done = [p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file() and p.name[5:].isdigit()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def save_checkpoint(accelerator, cfg: Config, position: dict[str, int]) -> Path:
    """accelerator.save_state into a temp dir, plus the data position and resolved recipe, then rename
    it to checkpoints/step-N and rotate to `train.keep_checkpoints`. A crash mid-save leaves only a
    `.tmp-*` dir, which resume ignores."""
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
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted((p for p in root.glob("step-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        for old in done[:-cfg.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def full_params(accelerator, model):
    """A context in which `model`'s own parameters are whole on every process: FSDP gathers its shards
    (for eval and the final save); DDP and single-process runs need nothing."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.summon_full_params(model, writeback=False)
    return contextlib.nullcontext()


class HiddenCache:
    """The frozen target's hidden states per training row, kept on the CPU (`train.cache_hidden`).

    The target never changes, so h for a row is the same every epoch: after the first, a batch whose rows
    are all cached skips the target forward (the dominant cost when heads are small). Rows are keyed by
    their token ids, so with `directory` (`train.hidden_cache_dir`) a later run on other heads reuses them:
    each `flush` writes the rows computed since the last one as a new shard file, atomically.
    """

    META = "meta.json"

    def __init__(self, directory: str | os.PathLike | None = None, fingerprint: dict[str, Any] | None = None,
                 rank: int = 0, dtype: torch.dtype = torch.float32) -> None:
        self.rows: dict[bytes, torch.Tensor] = {}
        self.greedy_rows: dict[bytes, torch.Tensor] = {}  # in memory only: cheap to recompute from rows
        self.new: list[bytes] = []
        self.dir = Path(directory) if directory else None
        self.rank = rank
        if self.dir is not None:
            self._open(fingerprint or {}, str(dtype).removeprefix("torch."))

    @staticmethod
    def key(ids: torch.Tensor) -> bytes:
        return hashlib.sha1(ids.to(torch.int64).cpu().numpy().tobytes()).digest()

    def _open(self, fingerprint: dict[str, Any], dtype: str) -> None:
        """Check (or write) meta.json: the target's fingerprint and the dtype of the forward that made the rows."""
        meta = self.dir / self.META
        if meta.is_file():
            saved = json.loads(meta.read_text())
            diff = fingerprint_difference(saved.get("target_fingerprint", {}), fingerprint)
            if diff is not None:
                raise ConfigError(f"train.hidden_cache_dir={self.dir} holds hidden states of another target "
                                  f"({diff}): point it at a new directory, or delete this one")
            saved_dtype = saved.get("dtype", "float32")  # caches written before the key existed were float32
            if saved_dtype != dtype:
                raise ConfigError(f"train.hidden_cache_dir={self.dir} holds hidden states of a {saved_dtype} "
                                  f"forward, but this run's target forward is {dtype}: set target.forward_dtype="
                                  f"{saved_dtype} (or target.dtype), or point it at a new directory")
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            # several ranks may race here; every one writes the same content
            atomic_write(meta, lambda tmp: Path(tmp).write_text(
                json.dumps({"target_fingerprint": fingerprint, "dtype": dtype})))
        for shard in sorted(self.dir.glob("shard-*.pt")):
            self.rows.update(torch.load(shard, map_location="cpu", weights_only=True))

    def hidden(self, target: torch.nn.Module, batch: dict[str, torch.Tensor], lm_head: torch.nn.Module
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h [B, T, d], the target's greedy token at every position [B, T], 0 past each row's end).

        h comes from the cache where it can; the target runs on the rows it has not seen only. Greedy tokens
        are kept per row in memory (not on disk: cheap to recompute from h), so a row pays the full-vocab LM
        head once per run, not once per epoch: with them the loss scores a draft vocabulary's columns only
        (`chunked_head_losses`)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        lengths = mask.sum(1).tolist()  # a small host read, once per micro-step
        keys = [self.key(ids[b, :n]) for b, n in enumerate(lengths)]
        missing = [b for b, k in enumerate(keys) if k not in self.rows]
        if len(missing) == len(keys):
            h = target_hidden(target, ids, mask)
        else:  # new data added to a cached set: the target runs on the new rows only
            like = next(iter(self.rows.values()))
            h = torch.zeros(ids.shape[0], ids.shape[1], like.shape[-1], dtype=like.dtype)
            for b, k in enumerate(keys):
                if k in self.rows:
                    h[b, :lengths[b]] = self.rows[k]
            h = h.to(ids.device, non_blocking=True)
            if missing:
                rows, n = torch.tensor(missing, device=ids.device), max(lengths[b] for b in missing)
                h[rows, :n] = target_hidden(target, ids[rows, :n], mask[rows, :n]).to(like.dtype)
        for b in missing:
            k = keys[b]
            if k not in self.rows:  # a batch may hold the same row twice
                self.rows[k] = h[b, :lengths[b]].detach().to("cpu", copy=True)
                if self.dir is not None:  # only rows to be written by the next flush
                    self.new.append(k)

        no_greedy = [b for b, k in enumerate(keys) if k not in self.greedy_rows]
        if no_greedy:
            fresh = greedy_tokens(lm_head, h[no_greedy])
            for i, b in enumerate(no_greedy):
                self.greedy_rows[keys[b]] = fresh[i, :lengths[b]].to("cpu", copy=True)
        greedy = torch.zeros(ids.shape, dtype=torch.long)
        for b, k in enumerate(keys):
            greedy[b, :lengths[b]] = self.greedy_rows[k]
        return h, greedy.to(ids.device, non_blocking=True)

    def flush(self) -> None:
        """Write the rows computed since the last flush as one new shard (no-op without a directory)."""
        if self.dir is None or not self.new:
            return
        final = self.dir / f"shard-{time.strftime('%Y%m%d-%H%M%S')}-r{self.rank}-{uuid.uuid4().hex[:8]}.pt"
        atomic_write(final, lambda tmp: torch.save({k: self.rows[k] for k in self.new}, tmp))
        self.new = []


def append_metrics(output_dir: str | os.PathLike, row: dict[str, Any]) -> None:
    with open(Path(output_dir) / METRICS_NAME, "a") as f:
        f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------------
# Setup steps


def _setup_accelerator(cfg: Config):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    # Accelerate forms a CPU (gloo) process group under torchrun only when asked for the CPU explicitly
    multi_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    return Accelerator(
        cpu=multi_cpu,
        gradient_accumulation_steps=cfg.train.grad_accum,
        # the schedule counts optimizer steps; stepping it once per step keeps it independent of world size
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.train.seed),
        project_config=ProjectConfiguration(project_dir=cfg.output_dir),
        log_with="wandb" if cfg.tracking.backend == "wandb" else None,
    )


def _setup_tracking(accelerator, cfg: Config) -> None:
    """Start the W&B tracker (offline when there is neither WANDB_API_KEY nor WANDB_MODE)."""
    if cfg.tracking.backend != "wandb":
        return
    offline = not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE")
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


def _setup_heads(cfg: Config, target: torch.nn.Module, train_ds) -> DraftHeads:
    h = cfg.heads
    if h.init_from:
        return _warm_start_heads(cfg, target)
    draft_ids = None
    if h.draft_vocab_size:
        vocab = target.get_output_embeddings().weight.shape[0]
        always = [i for i in (target.config.eos_token_id, getattr(target.config, "bos_token_id", None))
                  if isinstance(i, int)]
        draft_ids = select_draft_vocab(token_counts(train_ds, vocab), h.draft_vocab_size, always)
    heads = DraftHeads.for_target(target, h.kind, h.num_heads, h.layers_per_head, h.own_embed, h.own_lm_head,
                                  draft_ids=draft_ids, target_name=cfg.target.model, block=h.block,
                                  context_layers=h.context_layers)
    return heads.to(target.device)


def _warm_start_heads(cfg: Config, target: torch.nn.Module) -> DraftHeads:
    """heads.init_from: trained heads, checked against this target and against the recipe's heads.* keys."""
    h = cfg.heads
    try:
        heads = DraftHeads.from_pretrained(h.init_from, target)
    except ValueError as e:  # HeadsMismatchError (another target) or not a heads directory
        raise ConfigError(f"heads.init_from={h.init_from}: {e}") from None
    spec = heads.spec
    differ = [f"heads.{key}={getattr(h, key)!r} but those heads have {getattr(spec, key)!r}"
              for key in ("kind", "num_heads", "layers_per_head", "block", "own_embed", "own_lm_head",
                          "draft_vocab_size", "context_layers") if getattr(h, key) != getattr(spec, key)]
    if differ:
        raise ConfigError(f"heads.init_from={h.init_from} does not match the recipe: " + "; ".join(differ)
                          + ". Set those keys to the heads' values (their config.json), or drop heads.init_from")
    return heads.to(target.device)


def _setup_forward_target(cfg: Config, target: torch.nn.Module, device) -> torch.nn.Module:
    """The model whose forward gives h in training: the target itself, or (target.forward_dtype) a second
    frozen copy in another dtype."""
    if cfg.target.forward_dtype == "same":
        return target
    dtype = getattr(torch, cfg.target.forward_dtype)
    if dtype == target.dtype:
        return target
    return load_model(cfg.target, device, dtype)


def _setup_dataloaders(cfg: Config, accelerator, train_ds, eval_ds, pad_token_id: int):
    per_process = cfg.train.batch_size // accelerator.num_processes
    fn = partial(collate, pad_token_id=pad_token_id)
    train_dl = DataLoader(train_ds, batch_size=per_process, shuffle=True, collate_fn=fn, drop_last=False)
    eval_dl = DataLoader(eval_ds, batch_size=per_process, shuffle=False, collate_fn=fn) if eval_ds else None
    return train_dl, eval_dl


# ---------------------------------------------------------------------------------------------------
# The loop


def train(cfg: Config) -> TrainResult:
    """Train heads per `cfg`; the final heads, recipe.yaml and acceptance.json land in `cfg.output_dir`."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    out = Path(cfg.output_dir)
    accelerator = _setup_accelerator(cfg)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        accelerator.print("resolved config:\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    set_seed(cfg.train.seed)

    # -- target, data, heads -------------------------------------------------------------------------
    tokenizer = load_tokenizer(cfg.target)
    with accelerator.main_process_first():  # the datasets cache is written once, then reused
        train_ds, eval_ds, info = build_datasets(cfg, tokenizer)  # data errors surface before the model loads
    accelerator.print(f"data: {info['rows']} training rows, {info['tokens']} tokens "
                      f"({info['supervised_tokens']} supervised), {info['eval_rows']} held-out rows")
    target = load_model(cfg.target, accelerator.device)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    forward_target = _setup_forward_target(cfg, target, accelerator.device)
    heads = _setup_heads(cfg, target, train_ds)
    n_params = sum(p.numel() for p in heads.parameters())
    accelerator.print(f"heads: {cfg.heads.kind}, K={cfg.heads.num_heads}, {n_params:,} trainable params; "
                      f"target frozen ({sum(p.numel() for p in target.parameters()):,} params)")

    objective = HeadsObjective(heads, cfg.loss)
    optimizer = torch.optim.AdamW(param_groups(objective, cfg.train.weight_decay), lr=cfg.train.lr)
    cache = None
    if cfg.train.cache_hidden or cfg.train.hidden_cache_dir:
        cache = HiddenCache(cfg.train.hidden_cache_dir or None, target_fingerprint(target), accelerator.process_index,
                            forward_target.dtype)
        if cache.rows:
            accelerator.print(f"hidden cache: {len(cache.rows)} rows read from {cfg.train.hidden_cache_dir}")
    train_dl, eval_dl = _setup_dataloaders(cfg, accelerator, train_ds, eval_ds, tokenizer.pad_token_id)
    # prepare() shards batches across processes (padded to equal length): batches per process per epoch
    steps_per_epoch = math.ceil(math.ceil(len(train_dl) / accelerator.num_processes) / cfg.train.grad_accum)
    total_steps = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        warmup_cosine, warmup_steps=cfg.train.warmup_steps, total_steps=total_steps,
        min_lr_ratio=cfg.train.min_lr_ratio))
    objective, optimizer, train_dl, scheduler = accelerator.prepare(objective, optimizer, train_dl, scheduler)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)
    _setup_tracking(accelerator, cfg)

    # -- resume ----------------------------------------------------------------------------------------
    position = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "tokens": 0}
    ckpt = None if cfg.resume == "none" else latest_checkpoint(out) if cfg.resume == "auto" else Path(cfg.resume)
    if ckpt is not None:
        accelerator.load_state(str(ckpt))  # heads, optimizer, scheduler, sampler, RNG
        position = json.loads((ckpt / TRAINER_STATE).read_text())
        accelerator.print(f"resumed from {ckpt} at step {position['step']} "
                          f"(epoch {position['epoch']}, batch {position['batch_in_epoch']})")

    # -- loop ------------------------------------------------------------------------------------------
    unwrapped = accelerator.unwrap_model(objective).heads
    K = cfg.heads.num_heads
    stats = torch.zeros(K, len(STATS), device=accelerator.device)  # summed per-head stats since the last log
    loss_sum = torch.zeros((), device=accelerator.device)
    tokens = torch.zeros((), device=accelerator.device, dtype=torch.long)
    micro_steps = 0
    grad_norm = torch.zeros((), device=accelerator.device)
    bar = tqdm(total=total_steps, initial=position["step"], disable=not accelerator.is_local_main_process,
               desc="train", dynamic_ncols=True)
    t_log = time.perf_counter()
    objective.train()
    with StopRequest() as stop:
        while position["step"] < total_steps and not stop.requested:
            train_dl.set_epoch(position["epoch"])
            skip = position["batch_in_epoch"]
            batches = accelerator.skip_first_batches(train_dl, skip) if skip else train_dl
            for batch in batches:
                with accelerator.accumulate(objective):
                    ids, mask = batch["input_ids"], batch["attention_mask"]
                    # h [B, T, d] and (with the cache) greedy tokens, no grad; cached after the first epoch
                    h, greedy = cache.hidden(forward_target, batch, lm_head) if cache is not None else \
                        (target_hidden(forward_target, ids, mask), None)
                    h = h.to(embed.weight.dtype)  # a no-op unless target.forward_dtype differs
                    loss, batch_stats = objective(h, ids, batch["labels"], mask, embed, lm_head, greedy)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(objective.parameters(),
                                                                cfg.train.max_grad_norm or float("inf"))
                    optimizer.step()  # a no-op on accumulation micro-steps (Accelerate skips it)
                    optimizer.zero_grad(set_to_none=True)
                position["batch_in_epoch"] += 1
                stats += batch_stats.detach()
                loss_sum += loss.detach()
                tokens += mask.sum()
                micro_steps += 1
                if not accelerator.sync_gradients:
                    continue

                # -- one optimizer step done ----------------------------------------------------------
                scheduler.step()
                position["step"] += 1
                step = position["step"]
                bar.update(1)
                last = step >= total_steps
                if step % cfg.train.log_every == 0 or last:
                    # the only host sync of the step: reduce on device, then one transfer
                    g_stats = accelerator.reduce(stats, "sum")
                    g_loss = accelerator.reduce(loss_sum, "sum") / (micro_steps * accelerator.num_processes)
                    g_tokens = accelerator.reduce(tokens, "sum")
                    now = time.perf_counter()
                    position["tokens"] += int(g_tokens)
                    row = {f"train/{k}": v for k, v in summarize(g_stats, cfg.loss).items()}
                    row.update({"train/loss": float(g_loss), "train/lr": scheduler.get_last_lr()[0],
                                "train/grad_norm": float(grad_norm),
                                "train/tokens_per_s": int(g_tokens) / (now - t_log),
                                "train/epoch": position["epoch"], "train/tokens": position["tokens"]})
                    _log(accelerator, cfg, step, row)
                    bar.set_postfix(loss=f"{row['train/loss']:.3f}", acc1=f"{row['train/head1/top1_target']:.3f}",
                                    tok_s=f"{row['train/tokens_per_s']:.0f}")
                    stats.zero_(), loss_sum.zero_(), tokens.zero_()
                    micro_steps = 0
                    t_log = time.perf_counter()
                if eval_dl is not None and cfg.eval.every and step % cfg.eval.every == 0 and not last:
                    with full_params(accelerator, objective):
                        metrics, _ = evaluate(unwrapped, target, eval_dl, cfg.loss, cfg.eval.max_batches, accelerator)
                    _log(accelerator, cfg, step, {f"eval/{k}": v for k, v in metrics.items()})
                    objective.train()
                    t_log = time.perf_counter()
                if accelerator.num_processes > 1:
                    # every process must agree to stop at the same step (signals may arrive at different steps)
                    flag = torch.tensor(float(stop.requested), device=accelerator.device)
                    stop.requested = bool(accelerator.reduce(flag, "max") > 0)
                if (cfg.train.save_every and step % cfg.train.save_every == 0) or last or stop.requested:
                    save_checkpoint(accelerator, cfg, position)
                    t_log = time.perf_counter()  # tokens/s measures training, not saving
                if last or stop.requested:
                    break
            else:  # the epoch ran out
                if cache is not None:
                    cache.flush()
                position["epoch"] += 1
                position["batch_in_epoch"] = 0
    bar.close()
    if cache is not None:
        cache.flush()

    if stop.requested:
        accelerator.print(f"stopped at step {position['step']}; resume with resume=auto (the default)")
        accelerator.end_training()
        return TrainResult(out, position["step"], True, unwrapped, target, None)

    # -- final heads, recipe and acceptance ----------------------------------------------------------------
    split, batches = ("eval", eval_dl) if eval_dl is not None else ("train", train_dl)
    if eval_dl is None:
        accelerator.print("no held-out split (data.eval_size=0): acceptance.json is measured on training batches")
    with full_params(accelerator, objective):
        metrics, acceptance = evaluate(unwrapped, target, batches, cfg.loss, cfg.eval.max_batches, accelerator)
        if accelerator.is_main_process:
            training = {"steps": position["step"], "tokens": position["tokens"], "recipe": RECIPE_NAME}
            if cfg.heads.init_from:
                training["init_from"] = str(cfg.heads.init_from)
            unwrapped.save_pretrained(out, extra={"training": training})
    prefix = "eval" if split == "eval" else "eval_on_train"  # never mixed up with the training rows
    _log(accelerator, cfg, position["step"], {f"{prefix}/{k}": v for k, v in metrics.items()})
    if accelerator.is_main_process:
        (out / RECIPE_NAME).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        save_acceptance(out, acceptance, split)
        accelerator.print(f"heads saved to {out} (expected tau of a chain: {acceptance['expected_tau']:.3f})")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if cfg.tracking.backend == "wandb" and accelerator.is_main_process and not os.environ.get("WANDB_API_KEY") \
            and not os.environ.get("WANDB_MODE"):
        runs = sorted((out / "wandb").glob("offline-run-*"))
        if runs:
            accelerator.print(f"wandb: to upload this run: wandb sync {runs[-1]}")
    return TrainResult(out, position["step"], False, unwrapped, target, acceptance)


def _log(accelerator, cfg: Config, step: int, row: dict[str, Any]) -> None:
    """Send a row to the tracker and append it to metrics.jsonl (main process only)."""
    accelerator.log(row, step=step)
    if accelerator.is_main_process:
        append_metrics(cfg.output_dir, {"step": step, **row})
