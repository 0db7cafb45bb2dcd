"""The processes a run spans: the Accelerator, what the launcher asked for, stop requests that every process
agrees on, and parameters gathered whole where FSDP shards them."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import torch
import yaml

from ..config import Config, ConfigError


def setup_accelerator(cfg: Config):
    from accelerate import Accelerator
    from datetime import timedelta

    from accelerate.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs,
                                  ProjectConfiguration)

    # Accelerate forms a CPU (gloo) process group under torchrun only when asked for the CPU explicitly
    multi_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    # the heads' warm-up of joint training leaves the adapters out of the step: DDP must be told
    unused = bool(cfg.target.lora.r and cfg.train.heads_warmup_steps)
    return Accelerator(
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=unused),
                         InitProcessGroupKwargs(timeout=timedelta(minutes=cfg.train.process_timeout_minutes))],
        cpu=multi_cpu,
        gradient_accumulation_steps=cfg.train.grad_accum,
        # the schedule counts optimizer steps; stepping it once per step keeps it independent of world size
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.train.seed),
        project_config=ProjectConfiguration(project_dir=cfg.output_dir),
        log_with="wandb" if cfg.tracking.backend == "wandb" else None,
    )


def launcher_argv() -> list[str] | None:
    """The command line of the launcher that started this process (`accelerate launch`, `torchrun`, `python -m
    torch.distributed.run`), read from /proc; None when the parent is something else (a shell, nohup) or on a
    system without /proc."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    head = " ".join(argv[:4])
    launched = any(w in head for w in ("accelerate", "torchrun", "torch.distributed.run", "torch/distributed/run"))
    return argv if launched else None


def die_with_launcher() -> None:
    """Linux: have the kernel send this process SIGTERM when its parent (the launcher) dies, so that SIGTERM to the
    launcher alone still reaches the trainer, which saves and stops, instead of running on as an orphan."""
    launcher = os.getppid()  # (it may be PID 1 itself, in a container)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    if os.getppid() != launcher:  # the launcher died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def launcher_asked_for() -> int | None:
    """How many processes `accelerate launch` was asked for (its --num_processes flag, else its config file's), when
    this process runs under it; None when that cannot be read (not Linux, another launcher)."""
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


def set_aside_fsdp_on_cpus() -> bool:
    """FSDP v1 over the heads (fsdp.yaml) on a machine without a GPU: Accelerate's FSDP plugin stops there with a
    traceback, so its switch is removed from this process's environment and the heads train under DDP, which gives
    the same heads (said by `say_processes`). Returns whether it was set aside (call before the Accelerator is made;
    FSDP2 is taken over before this, by sharding.py)."""
    if torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return False
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    return True


def say_processes(accelerator, fsdp_set_aside: bool = False) -> None:
    """How many processes run, on what: the first line of every run. `accelerate launch --cpu --num_processes N` runs
    one process whatever N is (several CPU processes need its mpirun support, or torchrun): said, with the fix."""
    backend = getattr(getattr(accelerator, "state", None), "backend", None) or "none"
    accelerator.print(f"processes: {accelerator.num_processes} ({accelerator.distributed_type.value}, backend "
                      f"{backend}, device {accelerator.device.type})")
    if fsdp_set_aside:
        accelerator.print("warning: the launch config asks for FSDP over the heads (fsdp.yaml), which Accelerate "
                          "runs only on GPUs: here the heads train replicated under DDP (the same heads)")
    asked = launcher_asked_for() if accelerator.num_processes == 1 else None
    if asked and asked > 1:
        accelerator.print(f"warning: accelerate launch was asked for {asked} processes but started 1: on CPUs it "
                          "starts several only through mpirun; use torchrun --nproc_per_node "
                          f"{asked} train.py ... for {asked} CPU processes")


def check_output_dir_shared(accelerator, directory: str | os.PathLike) -> None:
    """Several processes (several machines, most of all) read and write one `output_dir`: the checkpoints and each
    process's RNG state in them, `resume: auto`'s search, the shared hidden-state cache. The main process writes a
    file there, every process looks for it; a process that cannot see it is on a disk of its own, refused in one line
    before anything loads (a later resume would find no checkpoint, or another machine's)."""
    if accelerator.num_processes == 1:
        return
    import uuid

    from accelerate.utils import broadcast_object_list

    directory = Path(directory)
    token = [uuid.uuid4().hex if accelerator.is_main_process else None]
    broadcast_object_list(token)
    marker = directory / f".shared-{token[0]}"
    if accelerator.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(token[0])
    accelerator.wait_for_everyone()
    seen = marker.is_file() and marker.read_text() == token[0]
    flags = accelerator.gather(torch.tensor([float(seen)], device=accelerator.device)).tolist()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink(missing_ok=True)
    blind = [i for i, f in enumerate(flags) if f < 1]
    if blind:
        raise ConfigError(f"output_dir={directory}: process{'es' if len(blind) > 1 else ''} "
                          f"{', '.join(map(str, blind))} cannot see the main process's files there (a disk of its "
                          "own): every process of a run reads and writes one output_dir (checkpoints, resume, the "
                          "cache); put it on a file system every machine mounts")


def check_joint_distributed(accelerator) -> None:
    """Joint training runs on one process or under DDP; FSDP and DeepSpeed would shard a target that has both frozen
    and trainable weights, which this trainer does not set up."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(f"target.lora runs on one process or under DDP, not {accelerator.distributed_type.value}: "
                          "launch with a DDP config (`accelerate config`, multi-GPU), or set target.lora.r=0")


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


def all_agree_to_stop(accelerator, requested: bool) -> bool:
    """Whether any process was asked to stop: every process must stop at the same step (signals may arrive at
    different steps)."""
    if accelerator.num_processes == 1:
        return requested
    flag = torch.tensor(float(requested), device=accelerator.device)
    return bool(accelerator.reduce(flag, "max") > 0)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module `accelerator.prepare` wrapped (in torch.compile, DDP or FSDP v1). Accelerate's own unwrap_model also
    tests for DeepSpeed's engine, which imports deepspeed wherever it is installed (0.7 s a process) and never wraps
    what this trainer prepares: a DeepSpeed launch is taken over (sharding.py) and the heads train under DDP."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper (Accelerate's dynamo_backend)
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel,
                             FullyShardedDataParallel)):
        model = model.module
    return model


def full_params(accelerator, model, writeback: bool = False):
    """A context in which `model`'s own parameters are whole on every process: FSDP gathers its shards
    (for eval and the final save; with `writeback`, what is written into them is sharded back on exit); DDP and
    single-process runs need nothing."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.summon_full_params(model, writeback=writeback)
    return contextlib.nullcontext()
