"""The training loop: an explicit Accelerate loop over a frozen target and trainable draft heads.

    run = setup(cfg)           # accelerator, data, target, heads, optimizer, schedule, resume
    train_loop(run)            # for each micro-batch:
                               #   h, greedy = run.states(batch)      frozen target (or its cache), no grad
                               #   loss = objective(h, greedy, ...)   heads + chunked KL/CE (only heads learn)
                               #   (target.lora: objective(batch) runs the adapted target too, `joint.py`)
                               #   backward; on a sync step: clip, optimizer step, lr schedule
                               #   every log_every steps: reduce metrics across processes, one host sync, log
                               #   every eval.every steps: held-out eval; every save_every: atomic checkpoint
    finish(run)                # final eval, heads, recipe.yaml, acceptance.json

Outputs in `output_dir`: the heads (`config.json` + `model.safetensors`), `recipe.yaml` (the resolved
config), `acceptance.json` (per-head top-k acceptance, read by the inference engine), `metrics.jsonl`
(one row per log step and per eval), `checkpoints/step-N/` and, with W&B, `wandb/`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.data import DataLoader

from .config import Config, ConfigError
from .errors import TrainingDiverged
from .data import build_datasets, collate, select_draft_vocab, token_counts
from .checkpoints import (METRICS_NAME, RECIPE_NAME, check_resumable, latest_checkpoint, remove_stale_files, resume,
                          resume_checkpoint, save_checkpoint)
from .evaluate import evaluate, save_acceptance
from .heads import DraftHeads
from .joint import JointObjective, add_lora, held_out_lm_kl, save_adapter
from .losses import STATS, HeadsObjective, summarize
from .preflight import check_before_loading
from .target import load_model, load_tokenizer, logit_transform, target_fingerprint
from .target_states import TargetStates


@dataclass
class TrainResult:
    """What `train` leaves behind: where, how far, and the in-memory heads and (still frozen) target."""

    output_dir: Path
    step: int
    stopped: bool
    """True when a signal stopped the run early (a checkpoint was saved; resume with resume=auto)."""
    heads: DraftHeads
    target: torch.nn.Module
    """The target as trained on: frozen, or (target.lora) with the trained adapters in place."""
    acceptance: dict[str, Any] | None


# ---------------------------------------------------------------------------------------------------
# Small pieces the loop is made of


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


def full_params(accelerator, model):
    """A context in which `model`'s own parameters are whole on every process: FSDP gathers its shards
    (for eval and the final save); DDP and single-process runs need nothing."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.summon_full_params(model, writeback=False)
    return contextlib.nullcontext()


def all_agree_to_stop(accelerator, requested: bool) -> bool:
    """Whether any process was asked to stop: every process must stop at the same step (signals may arrive at
    different steps)."""
    if accelerator.num_processes == 1:
        return requested
    flag = torch.tensor(float(requested), device=accelerator.device)
    return bool(accelerator.reduce(flag, "max") > 0)


def log_row(accelerator, cfg: Config, step: int, row: dict[str, Any]) -> None:
    """Send a row to the tracker and append it to metrics.jsonl (main process only)."""
    accelerator.log(row, step=step)
    if accelerator.is_main_process:
        with open(Path(cfg.output_dir) / METRICS_NAME, "a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")


def wandb_offline() -> bool:
    """W&B runs offline when neither WANDB_API_KEY nor WANDB_MODE is set."""
    return not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE")


class Meter:
    """Training metrics since the last log, kept on device so that a step makes no host sync; `row` reduces
    them across processes and reads them with one transfer."""

    def __init__(self, num_heads: int, device: torch.device, joint: bool = False) -> None:
        self.stats = torch.zeros(num_heads, len(STATS), device=device)  # summed per-head stats (losses.STATS)
        self.lm_kl = torch.zeros(2, device=device) if joint else None  # target.lora: KL sum and positions
        self.loss = torch.zeros((), device=device)
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
        if self.first_loss is None:
            self.first_loss = loss.detach().clone()
        self.stats += stats.detach()
        self.loss += loss.detach()
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
        """The mean loss since the last log, across processes (a host sync: called where a checkpoint is saved), or
        None if no micro-step ran since."""
        if not self.micro_steps:
            return None
        return float(accelerator.reduce(self.loss, "sum") / (self.micro_steps * accelerator.num_processes))

    def restart_clock(self) -> None:
        """tokens/s measures training only: restart after evaluating or saving."""
        self.t0 = time.perf_counter()

    def row(self, accelerator, cfg: Config, position: dict[str, int], lr: float) -> dict[str, float]:
        """The metrics row of this log step (adds the tokens seen to `position`), then start over."""
        stats = accelerator.reduce(self.stats, "sum")
        loss = accelerator.reduce(self.loss, "sum") / (self.micro_steps * accelerator.num_processes)
        tokens = int(accelerator.reduce(self.tokens, "sum"))  # the host sync
        position["tokens"] += tokens
        row = {f"train/{k}": v for k, v in summarize(stats, cfg.loss).items()}
        row.update({"train/loss": float(loss), "train/lr": lr, "train/grad_norm": float(self.grad_norm),
                    "train/tokens_per_s": tokens / (time.perf_counter() - self.t0),
                    "train/epoch": position["epoch"], "train/tokens": position["tokens"],
                    "train/skipped_steps": self.skipped_steps})
        if self.lm_kl is not None:  # how far the adapted target is from the original, on the training batches
            kl = accelerator.reduce(self.lm_kl, "sum")
            row["train/lm_kl"] = float(kl[0] / kl[1].clamp_min(1))
            self.lm_kl.zero_()
        self.stats.zero_(), self.loss.zero_(), self.tokens.zero_()
        self.micro_steps = 0
        self.restart_clock()
        return row


# ---------------------------------------------------------------------------------------------------
# Setup


def setup_accelerator(cfg: Config):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, ProjectConfiguration

    # Accelerate forms a CPU (gloo) process group under torchrun only when asked for the CPU explicitly
    multi_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    # the heads' warm-up of joint training leaves the adapters out of the step: DDP must be told
    unused = bool(cfg.target.lora.r and cfg.train.heads_warmup_steps)
    return Accelerator(
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=unused)],
        cpu=multi_cpu,
        gradient_accumulation_steps=cfg.train.grad_accum,
        # the schedule counts optimizer steps; stepping it once per step keeps it independent of world size
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.train.seed),
        project_config=ProjectConfiguration(project_dir=cfg.output_dir),
        log_with="wandb" if cfg.tracking.backend == "wandb" else None,
    )


def launcher_asked_for() -> int | None:
    """How many processes `accelerate launch` was asked for (its --num_processes flag, else its config file's), when
    this process runs under it; None when that cannot be read (not Linux, another launcher)."""
    from .cli import launcher_argv

    argv = launcher_argv()
    if argv is None or "launch" not in argv[:4]:
        return None
    for i, a in enumerate(argv[:-1]):
        if a in ("--num_processes", "--num-processes"):
            return int(argv[i + 1]) if argv[i + 1].isdigit() else None
    for i, a in enumerate(argv[:-1]):
        if a in ("--config_file", "--config-file"):
            try:
                n = (yaml.safe_load(Path(argv[i + 1]).read_text()) or {}).get("num_processes")
            except (OSError, yaml.YAMLError):
                return None
            return int(n) if isinstance(n, int) else None
    return None


def say_processes(accelerator) -> None:
    """How many processes run, on what: the first line of every run. `accelerate launch --cpu --num_processes N` runs
    one process whatever N is (several CPU processes need its mpirun support, or torchrun): said, with the fix."""
    backend = getattr(getattr(accelerator, "state", None), "backend", None) or "none"
    accelerator.print(f"processes: {accelerator.num_processes} ({accelerator.distributed_type.value}, backend "
                      f"{backend}, device {accelerator.device.type})")
    asked = launcher_asked_for() if accelerator.num_processes == 1 else None
    if asked and asked > 1:
        accelerator.print(f"warning: accelerate launch was asked for {asked} processes but started 1: on CPUs it "
                          "starts several only through mpirun; use torchrun --nproc_per_node "
                          f"{asked} train.py ... for {asked} CPU processes")


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


def setup_heads(cfg: Config, target: torch.nn.Module, train_ds) -> DraftHeads:
    """Fresh heads for `target` per `cfg.heads` (a draft vocabulary drawn from `train_ds`), or warm-started ones."""
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
                                  context_layers=h.context_layers, aux_layers=h.aux_layers or None)
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
    if h.aux_layers and h.aux_layers != spec.aux_layers:
        differ.append(f"heads.aux_layers={h.aux_layers!r} but those heads have {spec.aux_layers!r}")
    if differ:
        raise ConfigError(f"heads.init_from={h.init_from} does not match the recipe: " + "; ".join(differ)
                          + ". Set those keys to the heads' values (their config.json), or drop heads.init_from")
    return heads.to(target.device)


def setup_forward_target(cfg: Config, target: torch.nn.Module, device) -> torch.nn.Module:
    """The model whose forward gives h in training: the target itself, or (target.forward_dtype) a second
    frozen copy in another dtype."""
    if cfg.target.forward_dtype == "same":
        return target
    dtype = getattr(torch, cfg.target.forward_dtype)
    if dtype == target.dtype:
        return target
    return load_model(cfg.target, device, dtype)


def setup_dataloaders(cfg: Config, accelerator, train_ds, eval_ds, pad_token_id: int):
    per_process = cfg.train.batch_size // accelerator.num_processes
    fn = partial(collate, pad_token_id=pad_token_id)
    train_dl = DataLoader(train_ds, batch_size=per_process, shuffle=True, collate_fn=fn, drop_last=False)
    eval_dl = DataLoader(eval_ds, batch_size=per_process, shuffle=False, collate_fn=fn) if eval_ds else None
    return train_dl, eval_dl


@dataclass
class Run:
    """Everything the loop reads, built once by `setup`. `position` is where training stands (the part of a
    checkpoint that is not Accelerate's state)."""

    cfg: Config
    accelerator: Any
    target: torch.nn.Module
    states: TargetStates  # (h, greedy) per batch: the frozen target's forward, or its cache
    heads: DraftHeads  # unwrapped, for eval and saving
    objective: torch.nn.Module  # heads + loss, as prepared by Accelerate (DDP/FSDP-wrapped)
    optimizer: Any
    scheduler: Any
    train_dl: Any
    eval_dl: Any | None
    total_steps: int
    peft: Any = None  # target.lora: the PeftModel around the target (whose base model `target` is)
    position: dict[str, int] = field(default_factory=lambda: {"step": 0, "epoch": 0, "batch_in_epoch": 0,
                                                              "tokens": 0})

    @property
    def embed(self) -> torch.nn.Module:
        return self.target.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.target.get_output_embeddings()


def setup(cfg: Config) -> Run:
    """Accelerator, data (its errors surface before the model loads), target, heads, optimizer, schedule, then
    the newest checkpoint if `cfg.resume` says so."""
    from accelerate.utils import set_seed

    if int(os.environ.get("RANK", "0")) == 0:
        remove_stale_files(cfg.output_dir)
    ckpt = resume_checkpoint(cfg)
    allowed = check_resumable(cfg, ckpt) if ckpt is not None else []  # before anything loads
    check_before_loading(cfg)
    accelerator = setup_accelerator(cfg)
    say_processes(accelerator)
    for change in allowed:
        accelerator.print(f"resume: changed since the checkpoint (allowed): {change}")
    set_seed(cfg.train.seed)

    tokenizer = load_tokenizer(cfg.target)
    with accelerator.main_process_first():  # the datasets cache is written once, then reused
        train_ds, eval_ds, info = build_datasets(cfg, tokenizer)
    if accelerator.is_main_process:  # after the data, so that a data error is the first thing a user reads
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        accelerator.print("resolved config:\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    accelerator.print(f"data: {info['rows']} training rows, {info['tokens']} tokens "
                      f"({info['supervised_tokens']} supervised), {info['eval_rows']} held-out rows")
    dropped = info["dropped"] + info["eval_dropped"]
    if dropped:
        reasons = "; ".join(f"{n} x {r}" for r, n in sorted(info["drop_reasons"].items(), key=lambda x: -x[1])[:3])
        accelerator.print(f"data: {dropped} rows dropped ({reasons})")
    if accelerator.is_main_process and ckpt is None:  # what training saw, in the run's own record (once a run)
        with open(Path(cfg.output_dir) / METRICS_NAME, "a") as f:
            f.write(json.dumps({"step": 0, "data/rows": info["rows"], "data/eval_rows": info["eval_rows"],
                                "data/tokens": info["tokens"], "data/dropped": dropped,
                                "data/drop_reasons": info["drop_reasons"]}) + "\n")
    target = load_model(cfg.target, accelerator.device)
    peft = None
    if cfg.target.lora.r:
        check_joint_distributed(accelerator)
        peft = add_lora(target, cfg.target.lora)
        target = peft.get_base_model()  # the same model, with the adapters in its layers
    forward_target = setup_forward_target(cfg, target, accelerator.device)
    heads = setup_heads(cfg, target, train_ds)
    n_params = sum(p.numel() for p in heads.parameters() if p.requires_grad)
    n_target = sum(p.numel() for p in target.parameters())
    n_adapter = sum(p.numel() for p in target.parameters() if p.requires_grad)
    accelerator.print(f"heads: {cfg.heads.kind}, K={cfg.heads.num_heads}, {n_params:,} trainable params; " + (
        f"target with LoRA r={cfg.target.lora.r}: {n_adapter:,} of its {n_target:,} params train (joint, Medusa-2)"
        if peft is not None else f"target frozen ({n_target:,} params)"))
    states = TargetStates(forward_target, target.get_output_embeddings(), cfg.train.cache_hidden,
                          cfg.train.hidden_cache_dir or None, target_fingerprint(target), accelerator.process_index,
                          layers=heads.spec.aux_layers)
    if states.rows:
        accelerator.print(f"hidden cache: {len(states.rows)} rows read from {cfg.train.hidden_cache_dir}")

    groups = param_groups(heads, cfg.train.weight_decay)
    if peft is None:
        objective = HeadsObjective(heads, cfg.loss, logit_transform(target.config))
    else:
        objective = JointObjective(heads, peft, cfg.loss)
        groups.append({"params": list(objective.adapters.parameters()), "lr": cfg.target.lora.lr, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr)
    train_dl, eval_dl = setup_dataloaders(cfg, accelerator, train_ds, eval_ds, tokenizer.pad_token_id)
    # prepare() shards batches across processes (padded to equal length): batches per process per epoch
    steps_per_epoch = math.ceil(math.ceil(len(train_dl) / accelerator.num_processes) / cfg.train.grad_accum)
    total_steps = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    shape = dict(warmup_steps=cfg.train.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.train.min_lr_ratio)
    schedules = [partial(warmup_cosine, **shape)] * len(groups)
    if peft is not None:  # the adapters' group is the last
        schedules[-1] = partial(adapter_schedule, heads_warmup_steps=cfg.train.heads_warmup_steps, **shape)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
    objective, optimizer, train_dl, scheduler = accelerator.prepare(objective, optimizer, train_dl, scheduler)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)
    setup_tracking(accelerator, cfg)
    run = Run(cfg, accelerator, target, states, accelerator.unwrap_model(objective).heads, objective, optimizer,
              scheduler, train_dl, eval_dl, total_steps, peft=peft)
    resume(run, ckpt)
    return run


def check_joint_distributed(accelerator) -> None:
    """Joint training runs on one process or under DDP; FSDP and DeepSpeed would shard a target that has both frozen
    and trainable weights, which this trainer does not set up."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(f"target.lora runs on one process or under DDP, not {accelerator.distributed_type.value}: "
                          "launch with a DDP config (`accelerate config`, multi-GPU), or set target.lora.r=0")


# ---------------------------------------------------------------------------------------------------
# The loop


def micro_step(run: Run, batch: dict[str, torch.Tensor], meter: Meter) -> bool:
    """Forward and backward of one micro-batch; on a sync step also clip and step the optimizer, unless the
    gradient norm is not finite: that step is skipped. Returns False for a skipped step."""
    accelerator = run.accelerator
    finite = True
    with accelerator.accumulate(run.objective):
        if run.peft is None:
            h, greedy = run.states(batch)  # no grad; read from the cache after the first epoch when it is on
            h = h.to(run.embed.weight.dtype)  # a no-op unless target.forward_dtype differs
            loss, stats = run.objective(h, greedy, batch["input_ids"], batch["labels"], batch["attention_mask"],
                                        run.embed, run.lm_head)
        else:  # the adapted target runs inside the objective; after the heads' warm-up its adapters train too
            joint = run.position["step"] >= run.cfg.train.heads_warmup_steps
            loss, stats, lm_kl = run.objective(batch["input_ids"], batch["labels"], batch["attention_mask"],
                                               run.embed, run.lm_head, joint)
            meter.lm_kl += lm_kl
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            meter.grad_norm = accelerator.clip_grad_norm_(run.objective.parameters(),
                                                          run.cfg.train.max_grad_norm or float("inf"))
            # one host read per optimizer step (torch's GradScaler makes the same one to skip a step)
            finite = bool(torch.isfinite(meter.grad_norm))
        if finite:
            run.optimizer.step()  # a no-op on accumulation micro-steps (Accelerate skips it)
        run.optimizer.zero_grad(set_to_none=True)
    meter.add(loss, stats, batch["attention_mask"])
    return finite


def rng_neutral(batches):
    """`batches`, with the global torch RNG as it was before the first one was fetched: starting a data loader draws
    from it (its workers' base seed), and a resumed run starts one at another point of the stream than the run it
    resumes, so the adapters' dropout (target.lora) would see other masks than the uninterrupted run."""
    it = iter(batches)
    with torch.random.fork_rng(devices=[]):
        first = next(it, None)
    if first is None:
        return
    yield first
    yield from it


def train_loop(run: Run) -> bool:
    """Optimizer steps until `total_steps` or a stop signal; returns True when a signal stopped the run (after
    saving a checkpoint)."""
    from tqdm.auto import tqdm

    cfg, accelerator, position = run.cfg, run.accelerator, run.position
    meter = Meter(cfg.heads.num_heads, accelerator.device, joint=run.peft is not None)
    bar = tqdm(total=run.total_steps, initial=position["step"], disable=not accelerator.is_local_main_process,
               desc="train", dynamic_ncols=True)
    run.objective.train()
    with StopRequest() as stop:
        while position["step"] < run.total_steps and not stop.requested:
            run.train_dl.set_epoch(position["epoch"])
            skip = position["batch_in_epoch"]
            for batch in rng_neutral(accelerator.skip_first_batches(run.train_dl, skip) if skip else run.train_dl):
                finite = micro_step(run, batch, meter)
                position["batch_in_epoch"] += 1
                if not accelerator.sync_gradients:
                    continue
                # -- one optimizer step done (or skipped) ---------------------------------------------------
                run.scheduler.step()
                position["step"] += 1
                step, last = position["step"], position["step"] >= run.total_steps
                bar.update(1)
                count_nonfinite(run, meter, finite, step)
                if step % cfg.train.log_every == 0 or last:
                    row = meter.row(accelerator, cfg, position, run.scheduler.get_last_lr()[0])
                    if run.peft is not None:  # the adapters' group is the last
                        row["train/adapter_lr"] = run.scheduler.get_last_lr()[-1]
                    log_row(accelerator, cfg, step, row)
                    check_loss_growth(run, meter, row["train/loss"], step)
                    bar.set_postfix(loss=f"{row['train/loss']:.3f}", acc1=f"{row['train/head1/top1_target']:.3f}",
                                    tok_s=f"{row['train/tokens_per_s']:.0f}")
                if run.eval_dl is not None and cfg.eval.every and step % cfg.eval.every == 0 and not last:
                    metrics, _ = evaluate_heads(run, run.eval_dl)
                    log_row(accelerator, cfg, step, {f"eval/{k}": v for k, v in metrics.items()})
                    run.objective.train()
                    meter.restart_clock()
                stop.requested = all_agree_to_stop(accelerator, stop.requested)
                if (cfg.train.save_every and step % cfg.train.save_every == 0) or last or stop.requested:
                    with full_params(accelerator, run.objective):
                        check_finite(run.objective, step)  # a checkpoint of garbage would rotate out a good one
                    window = meter.window_loss(accelerator)  # since the last log (None: it was just checked)
                    if window is not None:
                        check_loss_growth(run, meter, window, step, final=last)
                    if meter.grown_in_a_row:  # heads from an exploding loss would rotate out a good checkpoint
                        accelerator.print(f"step {step}: checkpoint not written: the loss is exploding")
                    else:
                        meter.bank_tokens(accelerator, position)
                        save_checkpoint(accelerator, cfg, position)
                    meter.restart_clock()
                if last or stop.requested:
                    break
            else:  # the epoch ran out
                run.states.flush()
                position["epoch"] += 1
                position["batch_in_epoch"] = 0
    bar.close()
    run.states.flush()
    return stop.requested


def count_nonfinite(run: Run, meter: Meter, finite: bool, step: int) -> None:
    """Count a skipped step; `train.max_nonfinite_steps` of them in a row stop the run (TrainingDiverged)."""
    if finite:
        meter.nonfinite_in_a_row = 0
        return
    meter.skipped_steps += 1
    meter.nonfinite_in_a_row += 1
    limit = run.cfg.train.max_nonfinite_steps
    run.accelerator.print(f"step {step}: gradient norm {float(meter.grad_norm)}: update skipped "
                          f"({meter.nonfinite_in_a_row} in a row)")
    if limit and meter.nonfinite_in_a_row >= limit:
        last = latest_checkpoint(run.cfg.output_dir)
        raise TrainingDiverged(
            f"training diverged: {limit} optimizer steps in a row (to step {step}) had a non-finite gradient norm; "
            f"stopped without saving. The last checkpoint is {last or 'none'}: lower train.lr (now "
            f"{run.cfg.train.lr:g}) or check the data, then resume from it (resume=PATH) or start over")


def check_loss_growth(run: Run, meter: Meter, loss: float, step: int, final: bool = False) -> None:
    """A loss that explodes is a divergence (finite or not): a window whose mean loss exceeds `train.max_loss_growth`
    x the best window's so far counts; two in a row, or one at the last step (whose heads would be the result),
    raise TrainingDiverged. A window back under the bound resets the count."""
    factor = run.cfg.train.max_loss_growth
    if not factor:
        return
    if meter.best_loss == math.inf:
        meter.best_loss = meter.start_loss(run.accelerator)
    if not loss > factor * meter.best_loss:  # a NaN loss counts as grown (its steps are also skipped)
        meter.best_loss = min(meter.best_loss, loss)
        meter.grown_in_a_row = 0
        return
    meter.grown_in_a_row += 1
    run.accelerator.print(f"step {step}: training loss {loss:.4g} is over {factor:g}x its best window "
                          f"({meter.best_loss:.4g}); {meter.grown_in_a_row} in a row")
    if meter.grown_in_a_row >= 2 or final:
        last = latest_checkpoint(run.cfg.output_dir)
        raise TrainingDiverged(
            f"training diverged: at step {step} the training loss is {loss:.4g}, over train.max_loss_growth="
            f"{factor:g} x its best ({meter.best_loss:.4g}); nothing was saved from it. The last good checkpoint is "
            f"{last or 'none'}: lower train.lr (now {run.cfg.train.lr:g}) and resume from it (resume=PATH), or start "
            "over")


def check_finite(objective: torch.nn.Module, step: int) -> None:
    """TrainingDiverged unless every trained weight (heads, and adapters in joint training) is finite (checked before
    anything is saved)."""
    bad = [name for name, p in objective.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if bad:
        raise TrainingDiverged(f"training diverged: at step {step} the heads' weights are not finite ({bad[0]}"
                               f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); nothing was saved: lower "
                               "train.lr and resume from the last checkpoint, or start over")


# ---------------------------------------------------------------------------------------------------
# Finish


def evaluate_heads(run: Run, batches) -> tuple[dict[str, float], dict[str, Any]]:
    """Held-out metrics and acceptance of the heads as they are (FSDP gathers their shards first); in joint training
    on the adapted target, with `lm_kl`: its mean KL to the original target per supervised position."""
    run.objective.eval()  # the adapters' dropout off (the loop turns training back on)
    with full_params(run.accelerator, run.objective):
        metrics, acceptance = evaluate(run.heads, run.target, batches, run.cfg.loss, run.cfg.eval.max_batches,
                                       run.accelerator)
    if run.peft is not None:
        metrics["lm_kl"] = held_out_lm_kl(run.peft, batches, run.cfg.eval.max_batches, run.cfg.loss.chunk_size,
                                          run.accelerator)
    return metrics, acceptance


def finish(run: Run, stopped: bool) -> TrainResult:
    """After the loop: a stopped run says how to resume; a finished one writes the final heads, recipe.yaml and
    acceptance.json (measured on the held-out split, else on training batches)."""
    cfg, accelerator, position = run.cfg, run.accelerator, run.position
    out = Path(cfg.output_dir)
    if stopped:
        accelerator.print(f"stopped at step {position['step']}; resume with resume=auto (the default)")
        accelerator.end_training()
        return TrainResult(out, position["step"], True, run.heads, run.target, None)

    split, batches = ("eval", run.eval_dl) if run.eval_dl is not None else ("train", run.train_dl)
    if run.eval_dl is None:
        accelerator.print("no held-out split (data.eval_size=0): acceptance.json is measured on training batches")
    with full_params(accelerator, run.objective):
        check_finite(run.objective, position["step"])
    metrics, acceptance = evaluate_heads(run, batches)
    if accelerator.is_main_process:
        training = {"steps": position["step"], "tokens": position["tokens"], "recipe": RECIPE_NAME}
        if cfg.heads.init_from:
            training["init_from"] = str(cfg.heads.init_from)
        if run.peft is not None:  # the adapter first: the heads' config names it, as the target they draft for
            run.heads.spec.target_fingerprint["adapter"] = save_adapter(run.peft, out)
            training["joint"] = {"lora_r": cfg.target.lora.r, "heads_warmup_steps": cfg.train.heads_warmup_steps}
        with full_params(accelerator, run.objective):
            run.heads.save_pretrained(out, extra={"training": training})
    prefix = "eval" if split == "eval" else "eval_on_train"  # never mixed up with the training rows
    log_row(accelerator, cfg, position["step"], {f"{prefix}/{k}": v for k, v in metrics.items()})
    if accelerator.is_main_process:
        (out / RECIPE_NAME).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        save_acceptance(out, acceptance, split)
        accelerator.print(f"heads saved to {out} (expected tau of a chain: {acceptance['expected_tau']:.3f})")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if cfg.tracking.backend == "wandb" and accelerator.is_main_process and wandb_offline():
        runs = sorted((out / "wandb").glob("offline-run-*"))
        if runs:
            accelerator.print(f"wandb: to upload this run: wandb sync {runs[-1]}")
    return TrainResult(out, position["step"], False, run.heads, run.target, acceptance)


def train(cfg: Config) -> TrainResult:
    """Train heads per `cfg`; the final heads, recipe.yaml and acceptance.json land in `cfg.output_dir`."""
    run = setup(cfg)
    stopped = train_loop(run)
    return finish(run, stopped)
