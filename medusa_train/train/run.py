"""A training run, built from a recipe: `setup` makes the Accelerator, the data, the target, the heads, the
objective, the optimizer and its schedule, then resumes from the newest checkpoint when the recipe says so. The
`Run` it returns is everything the loop (`trainer.py`) reads."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.data import DataLoader

from .best import Best, drop_stale_best, keep_best_metric, restore_best
from .checkpoints import METRICS_NAME, check_resumable, remove_stale_files, resume, resume_checkpoint
from ..config import Config, ConfigError, resolve_lr
from ..data.rows import (LengthGroupedSampler, build_datasets, collate, row_lengths, select_draft_vocab,
                         token_counts)
from ..kinds.heads import DraftHeads, kind_class
from .joint import JointObjective, add_lora
from .losses import HeadsObjective
from .metrics import host_peak_bytes, setup_tracking
from .optim import build_optimizer
from .preflight import check_before_loading, check_cache_room, checkpoint_reserve, target_config
from .processes import (check_joint_distributed, check_output_dir_shared, say_processes, set_aside_fsdp_on_cpus,
                        setup_accelerator, unwrapped)
from ..target.sharding import describe as describe_sharding
from ..target.sharding import check_shardable, loads_on_main_only, shard_target, take_over_sharding
from ..target.model import (load_model, load_tokenizer, logit_transform, model_skeleton, resolve_dtype,
                            text_config)
from ..target.states import TargetStates, cache_fingerprint
from ..target.weights import files_holding, load_generation_config
from .tau import tau_prompt_ids


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
    best: Best = field(default_factory=lambda: Best("last"))  # the best heads so far (train.keep_best)
    tau_prompts: list[list[int]] = field(default_factory=list)  # the real-tau prompts (eval.tau_every)
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
    config = target_config(cfg)  # read once, before any weight loads; None if unreadable (the model load says why)
    auto_lr = cfg.train.lr == "auto"
    if auto_lr and config is not None:
        resolve_lr(cfg, text_config(config).hidden_size)
    allowed = check_resumable(cfg, ckpt) if ckpt is not None else []  # before anything loads
    check_before_loading(cfg, config)
    sharded = take_over_sharding()  # the target sharded by us, the heads under DDP (medusa_train/target/sharding.py)
    if sharded:
        check_shardable(cfg, int(os.environ.get("WORLD_SIZE", "1")), sharded)
    fsdp_set_aside = set_aside_fsdp_on_cpus()
    accelerator = setup_accelerator(cfg)
    say_processes(accelerator, fsdp_set_aside)
    check_output_dir_shared(accelerator, cfg.output_dir)  # several machines: one output_dir, or a clear refusal
    if accelerator.mixed_precision == "fp16":  # before anything loads
        raise ConfigError("mixed precision fp16: the loss computes its gradients in its forward pass (in float16 "
                          "under fp16 autocast), before the loss scaler multiplies them, so small ones underflow to 0; "
                          "launch with --mixed_precision bf16 (GPUs since Ampere) or no")
    for change in allowed:
        accelerator.print(f"resume: changed since the checkpoint (allowed): {change}")
    set_seed(cfg.train.seed)

    tokenizer = load_tokenizer(cfg.target)
    train_ds, eval_ds, tau_prompts, tokens = setup_data(cfg, accelerator, tokenizer, resumed=ckpt is not None)
    cache_dir = cache_directory(cfg, accelerator.num_processes)
    if cache_dir is not None and (room := check_cache_room(cfg, cache_dir, tokens, accelerator.device, config)):
        accelerator.print(room)  # before the model loads: a cache that cannot fit is refused now, not an epoch in
    target, sizes = load_target(cfg, accelerator, sharded)  # sharded: each process reads its own share of the files
    if auto_lr:
        resolve_lr(cfg, text_config(target.config).hidden_size)  # (a no-op where the config could be read above)
        accelerator.print(f"train.lr auto: {cfg.train.lr:.3g}, heads.kind={cfg.heads.kind}'s own lr for this target")
    peft = None
    if cfg.target.lora.r:
        check_joint_distributed(accelerator)
        peft = add_lora(target, cfg.target.lora)
        target = peft.get_base_model()  # the same model, with the adapters in its layers
    forward_target = setup_forward_target(cfg, target, accelerator.device)
    heads = setup_heads(cfg, target, train_ds, tokenizer)
    heads.recompute = cfg.train.activation_checkpointing
    if sharded:
        if sizes is None:  # ZeRO-3 from a whole copy a process
            sizes = shard_target(target, accelerator.device, sharded)
        heads.to(accelerator.device)
        accelerator.print(describe_sharding(sizes, sharded))
        # each process's peak host memory so far: loading the target is what sets it (one copy a host, or one a process)
        peaks = accelerator.gather(torch.tensor([host_peak_bytes()], device=accelerator.device)).tolist()
        accelerator.print("host memory while loading the target: peak " + ", ".join(
            f"{p / 2 ** 30:.2f}" for p in peaks) + " GiB by process")
        if accelerator.is_main_process and ckpt is None:  # the main process's share, in the run's own record
            with open(Path(cfg.output_dir) / METRICS_NAME, "a") as f:
                f.write(json.dumps({"step": 0} | {f"target/bytes_{k}": v for k, v in sizes.items()}
                                   | {"target/host_peak_bytes_by_process": peaks}) + "\n")
    say_heads(cfg, accelerator, heads, target, peft)
    states = setup_states(cfg, accelerator, forward_target, target, heads, cache_dir, lockstep=sharded is not None)

    objective = make_objective(cfg, heads, target, peft)
    train_dl, eval_dl = setup_dataloaders(cfg, accelerator, train_ds, eval_ds, tokenizer.pad_token_id)
    # prepare() shards batches across processes (padded to equal length): batches per process per epoch
    steps_per_epoch = math.ceil(math.ceil(len(train_dl) / accelerator.num_processes) / cfg.train.grad_accum)
    total_steps = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    optimizer, scheduler = build_optimizer(cfg, heads, objective.adapters if peft is not None else None, total_steps)
    objective, optimizer, train_dl, scheduler = accelerator.prepare(objective, optimizer, train_dl, scheduler)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)
    setup_tracking(accelerator, cfg)
    run = Run(cfg, accelerator, target, states, unwrapped(objective).heads, objective, optimizer,
              scheduler, train_dl, eval_dl, total_steps, peft=peft)
    resume(run, ckpt)
    setup_best(run, eval_ds is not None, resumed=ckpt is not None)
    run.tau_prompts = tau_prompts
    return run


def load_target(cfg: Config, accelerator, sharded) -> tuple[torch.nn.Module, dict[str, int] | None]:
    """The frozen target and, when it was sharded as it loaded, what this process holds of it (else None). Sharded
    (`sharded`: what the launcher asked for), every process reads its own share from the checkpoint's safetensors
    files (`weights.files_holding`: its slices of each sharded tensor, or one ZeRO-3 layer at a time), so no process
    ever holds the whole target; where the files cannot be read so (GGUF, an adapter to merge, weights the loader
    renames), FSDP2's main process loads it and sends each process its share, and ZeRO-3 loads it whole on every
    process (sharded by the caller, after the heads are built)."""
    dtype = resolve_dtype(cfg.target.dtype, accelerator.device)
    if sharded is None:
        return load_model(cfg.target, accelerator.device, dtype), None
    skeleton = model_skeleton(cfg.target, dtype)
    files = None if cfg.target.adapter or cfg.target.gguf_file else files_holding(skeleton, cfg.target.model)
    if files is not None:
        accelerator.print("target: each process reads its own share of the checkpoint's files")
        load_generation_config(skeleton, cfg.target.model)
        return skeleton, shard_target(skeleton, accelerator.device, sharded, files=files)
    accelerator.print("target: its files cannot be read a share at a time (GGUF, an adapter, renamed weights): "
                      + ("the main process loads it and sends each process its share" if
                         loads_on_main_only(sharded, accelerator.num_processes) else "each process loads it whole"))
    if loads_on_main_only(sharded, accelerator.num_processes):
        target = load_model(cfg.target, "cpu", dtype) if accelerator.is_main_process else skeleton
        return target, shard_target(target, accelerator.device, sharded, from_main=True)
    return load_model(cfg.target, "cpu", dtype), None


def setup_data(cfg: Config, accelerator, tokenizer, resumed: bool):
    """(training rows, held-out rows or None, the real tau's prompts, the training tokens): built once on the main
    process first (the datasets cache is then reused), reported, and recorded in the run's metrics (once a run);
    before the model loads, so that a data error is the first thing a user reads."""
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
    if accelerator.is_main_process and not resumed:  # what training saw, in the run's own record (once a run)
        with open(Path(cfg.output_dir) / METRICS_NAME, "a") as f:
            f.write(json.dumps({"step": 0, "data/rows": info["rows"], "data/eval_rows": info["eval_rows"],
                                "data/tokens": info["tokens"], "data/dropped": dropped,
                                "data/drop_reasons": info["drop_reasons"]}) + "\n")
    tau_prompts = []  # the real tau's prompts, read before the model loads (every process generates on its share)
    if cfg.eval.tau_every:
        tau_prompts = tau_prompt_ids(cfg, tokenizer, eval_ds)
        if not tau_prompts:
            where = cfg.eval.tau_prompts or "the held-out split"
            raise ConfigError(f"eval.tau_every: no prompts for the real tau in {where}: set eval.tau_prompts to a "
                              "prompts file")
    return train_ds, eval_ds, tau_prompts, info["tokens"]


def say_heads(cfg: Config, accelerator, heads: DraftHeads, target: torch.nn.Module, peft) -> None:
    """One line: the heads' kind and size, and what of the target trains."""
    n_params = sum(p.numel() for p in heads.parameters() if p.requires_grad)
    n_target = sum(getattr(p, "ds_numel", p.numel()) for p in target.parameters())  # ZeRO-3: whole sizes
    n_adapter = sum(p.numel() for p in target.parameters() if p.requires_grad)
    accelerator.print(f"heads: {cfg.heads.kind}, K={cfg.heads.num_heads}, {n_params:,} trainable params; " + (
        f"target with LoRA r={cfg.target.lora.r}: {n_adapter:,} of its {n_target:,} params train (joint, Medusa-2)"
        if peft is not None else f"target frozen ({n_target:,} params)"))


def cache_directory(cfg: Config, processes: int) -> str | None:
    """Where the hidden-state cache lives on disk: `train.hidden_cache_dir`, else (several processes, a cache asked
    for) `output_dir/hidden-cache`, where the processes share their rows; None: in memory, or no cache."""
    if cfg.train.hidden_cache_dir:
        return cfg.train.hidden_cache_dir
    if cfg.train.cache_hidden and processes > 1:  # each process's memory would hold its own rows only
        return str(Path(cfg.output_dir) / "hidden-cache")
    return None


def setup_states(cfg: Config, accelerator, forward_target: torch.nn.Module, target: torch.nn.Module,
                 heads: DraftHeads, cache_dir: str | None, lockstep: bool) -> TargetStates:
    """The target's hidden states a step reads: computed, or from the hidden cache (in memory, or on disk in
    `cache_dir`, where the processes share their rows; a flush leaves the checkpoints' room free)."""
    if cache_dir is not None and not cfg.train.hidden_cache_dir:
        accelerator.print(f"hidden cache: on disk in {cache_dir}, where the {accelerator.num_processes} processes "
                          "share their rows (train.hidden_cache_dir=DIR puts it elsewhere)")
    reserve = checkpoint_reserve(cfg, text_config(target.config), cache_dir) if cache_dir is not None else 0
    states = TargetStates(forward_target, target.get_output_embeddings(), cfg.train.cache_hidden, cache_dir,
                          cache_fingerprint(cfg.target, target), accelerator.process_index, layers=heads.target_layers,
                          lockstep=lockstep and accelerator.num_processes > 1, reserve_bytes=reserve)
    if len(states):
        accelerator.print(f"hidden cache: {len(states)} rows mapped from {cache_dir}")
    return states


def make_objective(cfg: Config, heads: DraftHeads, target: torch.nn.Module, peft=None) -> torch.nn.Module:
    """What a training step runs: the heads and their loss (`HeadsObjective`), or with `peft` the adapted target too
    (`JointObjective`)."""
    if peft is not None:
        return JointObjective(heads, peft, cfg.loss, token_sums=True)
    return HeadsObjective(heads, cfg.loss, logit_transform(target.config), token_sums=True)


def setup_best(run: Run, has_eval_split: bool, resumed: bool) -> None:
    """The measure the run keeps its best heads by, and (resumed) the best up to the checkpoint."""
    cfg, accelerator = run.cfg, run.accelerator
    run.best = restore_best(cfg, keep_best_metric(cfg, has_eval_split), run.position["step"] if resumed else None)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        drop_stale_best(cfg, run.best)
    if run.best.step >= 0:
        accelerator.print(f"resume: best heads so far from step {run.best.step} ({run.best.metric} "
                          f"{run.best.value:.3f})")


def setup_heads(cfg: Config, target: torch.nn.Module, train_ds, tokenizer) -> DraftHeads:
    """Fresh heads for `target` per `cfg.heads` (a draft vocabulary drawn from `train_ds`; the kind's options resolved
    for this target and `tokenizer`), or warm-started ones."""
    h = cfg.heads
    if h.init_from:
        return _warm_start_heads(cfg, target, tokenizer)
    draft_ids = None
    vocab = target.get_output_embeddings().weight.shape[0]
    if n := h.draft_vocab(vocab):
        always = [i for i in (target.config.eos_token_id, getattr(target.config, "bos_token_id", None))
                  if isinstance(i, int)]
        draft_ids = select_draft_vocab(token_counts(train_ds, vocab), n, always)
    options = dataclasses.asdict(kind_class(h.kind).options_from(h))
    heads = DraftHeads.for_target(target, h.kind, h.num_heads, draft_ids=draft_ids, target_name=cfg.target.model,
                                  tokenizer=tokenizer, **options)
    return heads.to(target.device)


def _warm_start_heads(cfg: Config, target: torch.nn.Module, tokenizer) -> DraftHeads:
    """heads.init_from: trained heads, checked against this target and against the recipe's heads.* keys: those it
    sets must be the heads' own (resolved as fresh heads' would be), except the kind's training options, which the
    recipe gives."""
    h = cfg.heads
    try:
        heads = DraftHeads.from_pretrained(h.init_from, target)
    except ValueError as e:  # HeadsMismatchError (another target) or not a heads directory
        raise ConfigError(f"heads.init_from={h.init_from}: {e}") from None
    spec, kind = heads.spec, type(heads)
    same_kind = kind is kind_class(h.kind)
    differ = [f"heads.{key}={getattr(h, key)!r} but those heads have {getattr(spec, key)!r}"
              for key, same in (("kind", same_kind), ("num_heads", h.num_heads == spec.num_heads)) if not same]
    if h.draft_vocab(spec.vocab_size) != spec.draft_vocab_size:
        differ.append(f"heads.draft_vocab_size={h.draft_vocab_size!r} ({h.draft_vocab(spec.vocab_size)} tokens for "
                      f"this target) but those heads have {spec.draft_vocab_size}")
    if same_kind:  # then the recipe's heads.* keys are this kind's options
        wanted = kind.resolve(kind.options_from(h), target.config, target.get_input_embeddings().weight, tokenizer)
        for f in dataclasses.fields(kind.Options):
            said, have = getattr(h, f.name), getattr(spec.options, f.name)
            if f.name in kind.training_options:
                setattr(spec.options, f.name, getattr(wanted, f.name))
            elif said not in (None, "auto", []) and getattr(wanted, f.name) != have:
                differ.append(f"heads.{f.name}={said!r} but those heads have {have!r}")
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
    if cfg.data.group_by_length:  # batches of rows of similar length (data.group_by_length)
        # grouped by the rows of a whole step, which are the same on any number of processes: a run resumed on
        # another number of them takes the rows the uninterrupted run would have
        sampler = LengthGroupedSampler(row_lengths(train_ds), cfg.train.batch_size * cfg.train.grad_accum,
                                       cfg.train.seed)
        train_dl = DataLoader(train_ds, batch_size=per_process, sampler=sampler, collate_fn=fn, drop_last=False)
    else:
        train_dl = DataLoader(train_ds, batch_size=per_process, shuffle=True, collate_fn=fn, drop_last=False)
    eval_dl = DataLoader(eval_ds, batch_size=per_process, shuffle=False, collate_fn=fn) if eval_ds else None
    return train_dl, eval_dl
