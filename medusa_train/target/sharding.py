"""The frozen target sharded across processes, for targets larger than one device: FSDP2 (`fully_shard`) or DeepSpeed
ZeRO-3, whichever the launcher's Accelerate config names.

`recipes/accelerate/fsdp2.yaml` (`distributed_type: FSDP`, `fsdp_version: 2`) or
`recipes/accelerate/deepspeed_zero3.yaml` (`distributed_type: DEEPSPEED`, `zero_stage: 3`) asks for it. Either way
each decoder layer of the target becomes its own unit: every process keeps 1/N of its weights and gathers the whole
layer only for that layer's forward (then frees it again). ZeRO-3 can keep those shards in CPU memory instead
(`offload_param_device: cpu`), which also lets a single process run a target larger than its device. The embedding,
the final norm and the LM head stay whole on every process: the heads read them outside the target's forward (the
input embedding of a draft token, the LM head's rows in the loss), and they are a few percent of a large target.

The heads themselves train replicated under DDP: they are small next to the target (EAGLE-3's layer for a 70B target
is ~1.4B parameters), and one code path for them on CPU and GPU, under either launcher, is one that the tests here
run. So the Accelerator is built without Accelerate's own FSDP or DeepSpeed (which would wrap the heads, and which
Accelerate ignores on CPUs), and this module shards the target with torch's `fully_shard` or DeepSpeed's ZeRO-3
parameter partitioning directly.

Under FSDP2 only the main process reads the checkpoint: the others build the target on the meta device and receive
their shards and the whole rest from it, so a host holds one copy of the target while it loads, not one a process.
ZeRO-3 still loads it whole in every process.

Every process must run the target's forward the same number of times (each layer's all-gather is collective): the
hidden-state cache keeps them in step (`TargetStates(lockstep=True)`), and the real tau, which generates on each
process's own prompts, is refused.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import Config, ConfigError


@dataclass(frozen=True)
class Sharding:
    """How the target is sharded: `how` is "fsdp2" or "zero3"; `offload` (ZeRO-3): the shards live in CPU memory and
    each layer is gathered onto the device for its forward."""
    how: str
    offload: bool = False

    @property
    def engine(self) -> str:
        return "FSDP2" if self.how == "fsdp2" else "DeepSpeed ZeRO-3"

    @property
    def name(self) -> str:
        return self.engine + (" with its shards in CPU memory" if self.offload else "")


def sharding_requested() -> Sharding | None:
    """What the launcher's Accelerate config asks for (`accelerate launch` exports its FSDP and DeepSpeed settings);
    None for anything else. ConfigError (one line) for DeepSpeed settings this trainer does not run."""
    env = os.environ
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and env.get("FSDP_VERSION", "1") == "2":
        return Sharding("fsdp2")
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    stage, param_device, optimizer_device = _deepspeed_settings()
    where = "DeepSpeed"
    if stage != 3:
        raise ConfigError(f"{where} zero_stage {stage}: stages 0-2 shard the heads' optimizer or gradients, which "
                          "this trainer keeps whole (the heads train replicated; its checkpoints hold their "
                          "optimizer); use zero_stage 3 (recipes/accelerate/deepspeed_zero3.yaml: the target sharded) "
                          "or recipes/accelerate/multi_gpu_ddp.yaml")
    if optimizer_device not in ("none", ""):
        raise ConfigError(f"{where}: offload_optimizer_device {optimizer_device}: the heads' optimizer stays on the "
                          "device with the replicated heads; set offload_optimizer_device: none")
    if param_device not in ("none", "", "cpu"):
        raise ConfigError(f"{where}: offload_param_device {param_device}: the target's shards are kept on the device "
                          "or in CPU memory; set offload_param_device: cpu or none")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise ConfigError(f"{where} ZeRO-3 was asked for but deepspeed is not installed: pip install deepspeed "
                          "(or pip install 'medusa-train[deepspeed]')") from None
    return Sharding("zero3", offload=param_device == "cpu")


def _deepspeed_settings() -> tuple[int, str, str]:
    """(zero stage, offload_param device, offload_optimizer device) from the DeepSpeed config file Accelerate names,
    else from its own deepspeed_config keys."""
    env = os.environ
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path.lower() != "none":
        try:
            zero = json.loads(Path(path).read_text()).get("zero_optimization", {})
        except (OSError, ValueError) as e:
            raise ConfigError(f"deepspeed_config_file {path} cannot be read ({str(e).splitlines()[0][:100]}): give "
                              "a DeepSpeed JSON config, or the zero_stage and offload keys in the Accelerate config"
                              ) from None

        def device(key: str) -> str:
            return str((zero.get(key) or {}).get("device", "none")).lower()

        return int(zero.get("stage", 0)), device("offload_param"), device("offload_optimizer")
    return (int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
            env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none").lower(),
            env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none").lower())


def take_over_sharding() -> Sharding | None:
    """When the target is to be sharded: remove Accelerate's FSDP / DeepSpeed switch from this process's environment,
    so that the Accelerator built next runs the heads under DDP while `shard_target` shards the target. Returns what
    was asked for (call once, before the Accelerator is made)."""
    sharding = sharding_requested()
    if sharding is not None:
        os.environ["ACCELERATE_USE_FSDP" if sharding.how == "fsdp2" else "ACCELERATE_USE_DEEPSPEED"] = "false"
        # the DeepSpeed config's gradient_accumulation_steps, which the Accelerator would take over the recipe's
        # train.grad_accum: the recipe's governs (DeepSpeed's engine, whose setting it is, does not run here)
        os.environ.pop("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", None)
    return sharding


def check_shardable(cfg: Config, world_size: int, sharding: Sharding = Sharding("fsdp2")) -> None:
    """One-line refusals for what a sharded target does not run, before anything loads."""
    prefix = f"{sharding.name} (the target sharded across processes)"
    if cfg.target.lora.r:
        raise ConfigError(f"{prefix}: target.lora trains the target's adapters, which a frozen sharded target does "
                          "not hold; set target.lora.r=0, or launch joint training with a DDP config")
    if cfg.target.forward_dtype != "same":
        raise ConfigError(f"{prefix}: target.forward_dtype={cfg.target.forward_dtype} keeps a second whole copy of "
                          "the target on every process; set target.forward_dtype=same")
    if cfg.eval.tau_every:
        raise ConfigError(f"{prefix}: eval.tau_every generates on each process's own prompts, which a sharded "
                          "target cannot (every process takes part in each layer); set eval.tau_every=0 and measure "
                          "tau after training with python -m inference.bench")
    if world_size < 2 and not sharding.offload:
        fix = ("or offload_param_device: cpu (one process, the target's layers in CPU memory)"
               if sharding.how == "zero3" else "or use recipes/accelerate/single_gpu.yaml")
        raise ConfigError(f"{prefix} was asked for with one process: launch with --num_processes 2 or more, {fix}")


def loads_on_main_only(sharding: Sharding | None, world_size: int) -> bool:
    """Whether only the main process reads the target's checkpoint (FSDP2 over several processes): the others build
    it on the meta device and receive their shards from it (`shard_target(..., from_main=True)`), so a host holds one
    copy of the target while it loads, not one a process."""
    return sharding is not None and sharding.how == "fsdp2" and world_size > 1


def shard_target(target: nn.Module, device: torch.device, sharding: Sharding = Sharding("fsdp2"),
                 from_main: bool = False, files: dict[str, Path] | None = None) -> dict[str, int]:
    """Shard each decoder layer of the frozen `target` across the process group (in place); the rest moves to
    `device` whole. `files` ({parameter: its safetensors file}, `weights.files_holding`): every process's `target` is
    a skeleton (`model.model_skeleton`) and each reads its own share from the files, its slices of each sharded
    tensor (FSDP2) or one decoder layer at a time, partitioned before the next is read (ZeRO-3): no process ever holds
    the whole target. Else `from_main` (FSDP2): only the main process's `target` holds weights, the others' are
    skeletons; the main process sends each one its shards and the whole rest, tensor by tensor. Returns the bytes of
    the target's weights: whole, held by this process (on the device, or in CPU memory with ZeRO-3's offload), and
    those of the layers that are sharded (whole and held here)."""
    from .model import decoder_layers

    layers = decoder_layers(target)
    if sharding.how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = torch.distributed.get_world_size()
        mesh = init_device_mesh(device.type, (world,))
        full = _full_state(target) if from_main and files is None else None
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        if files is not None:
            _read_own_shares(target, files, device)
        elif from_main and torch.distributed.get_rank() != 0:
            target.to_empty(device=device)
            target.tie_weights()
        else:
            target.to(device)
        if from_main and files is None:
            _receive_from_main(target, full, device)
    else:
        world = _zero3_layers(target, layers, device, sharding.offload, files)
    return {"whole": _bytes(target.parameters(), local=False), "here": _bytes(target.parameters(), local=True),
            "layers_whole": _bytes(layers.parameters(), local=False),
            "layers_here": _bytes(layers.parameters(), local=True), "processes": world}


def _materialize(module: nn.Module, device: torch.device | str, read, model: nn.Module, prefix: str = "") -> None:
    """Give a skeleton `module` (parameters on the meta device, buffers computed at construction) storage on `device`
    and its weights from the files (`read`, a `weights.TensorReader`; `prefix`: the module's name in the model):
    FSDP2's sharded parameters take only this process's slice of each tensor. The buffers are kept as computed."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    module.to_empty(device=device)
    if module is model:
        model.tie_weights()  # to_empty gave a tied LM head storage of its own: it is the embedding again
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
        for name, p in module.named_parameters():
            key = prefix + name
            if isinstance(p, DTensor):  # FSDP2 shards dim 0: this process's rows are one run of the file's bytes
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                if any(offset[1:]) or list(shape[1:]) != list(p.shape[1:]):
                    raise ValueError(f"{key}: sharded along a dimension other than the first ({p.placements})")
                local = p.to_local()
                if local.numel():
                    local.copy_(read.rows(key, offset[0], shape[0]))
            else:
                p.copy_(read.tensor(key))


def _read_own_shares(target: nn.Module, files: dict[str, Path], device: torch.device) -> None:
    """FSDP2 from the files: every process reads its slices of the sharded layers and the whole rest."""
    from .weights import TensorReader

    with TensorReader(files) as read:
        _materialize(target, device, read, target)


def _full_state(target: nn.Module) -> dict[str, torch.Tensor] | None:
    """The main process's whole weights (references, no copy), taken before the layers are sharded; None elsewhere."""
    return dict(target.state_dict()) if torch.distributed.get_rank() == 0 else None


def _receive_from_main(target: nn.Module, full: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """Every process's weights from the main process's `full` state: each process keeps its shard of each sharded
    tensor and the whole of the rest; then the buffers no state dict holds (rotary frequencies, computed at
    construction), and what `from_pretrained` and the adapter merge set on the model beside its weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    main = torch.distributed.get_rank() == 0
    set_model_state_dict(target, full if main else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True))
    persistent = set(target.state_dict())
    for name, buffer in target.named_buffers():
        if name not in persistent:
            torch.distributed.broadcast(buffer, src=0)
    extras = [{"generation_config": getattr(target, "generation_config", None),
               "medusa_adapter": getattr(target, "medusa_adapter", None)} if main else None]
    torch.distributed.broadcast_object_list(extras, src=0)
    for key, value in extras[0].items():
        if value is not None:
            setattr(target, key, value)


def _zero3_layers(target: nn.Module, layers: nn.ModuleList, device: torch.device, offload: bool,
                  files: dict[str, Path] | None = None) -> int:
    """ZeRO-3 parameter partitioning, one unit per decoder layer (each its own root: gathered at its forward, released
    after it, like FSDP2's units); the rest of the target moves to `device` first, whole. With `files` (`target` a
    skeleton) each layer is read from them just before it is partitioned, so a process holds its partitions and one
    layer. Returns the world size."""
    import deepspeed
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    from .weights import TensorReader

    read = TensorReader(files or {})
    if files is not None:  # the rest of the target, whole on the device (each layer comes as it is partitioned)
        _materialize_outside(target, layers, device, read)
    in_layers = {id(t) for t in [*layers.parameters(), *layers.buffers()]}
    for t in [*target.parameters(), *target.buffers()]:
        if id(t) not in in_layers:
            t.data = t.data.to(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():  # one process (offload): DeepSpeed still partitions over a group
        os.environ.setdefault("LOCAL_RANK", "0")
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                             world_size=1)
    if device.type == "cpu":
        # on CPUs DeepSpeed's communication wrapper compiles a shared-memory all-reduce (C++, ~30 s, a compiler
        # needed) that ZeRO-3's gathers never use: they go through torch's collectives over gloo
        import importlib

        ds_torch = importlib.import_module("deepspeed.comm.torch")  # (the package's own `torch` attribute is torch)
        if hasattr(ds_torch, "build_shm_op"):
            ds_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    # DeepSpeed gathers with torch's older name for the same collective: its warning, once a process, is not the user's
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    # not pinned (DeepSpeed's default): pinning a large target's layers can exceed a container's locked-memory limit
    offload_config = DeepSpeedZeroOffloadParamConfig(device="cpu", pin_memory=False) if offload \
        else None
    names = {id(m): n for n, m in target.named_modules()}
    target.medusa_zero3 = []
    with read:
        for layer in layers:
            if files is not None:
                _materialize(layer, "cpu", read, target, prefix=names[id(layer)] + ".")
            target.medusa_zero3.append(DeepSpeedZeRoOffload(layer, timers=None, ds_config=config,
                                                            param_persistence_threshold=0,
                                                            offload_param_config=offload_config))
    return torch.distributed.get_world_size()


def _materialize_outside(target: nn.Module, layers: nn.ModuleList, device: torch.device, read) -> None:
    """The skeleton's parameters outside `layers` (embedding, final norm, LM head), read whole from the files onto
    `device`; the layers stay on the meta device."""
    from accelerate.utils import set_module_tensor_to_device

    in_layers = {id(p) for p in layers.parameters()}
    with torch.no_grad():
        for key, p in list(target.named_parameters()):
            if id(p) not in in_layers:
                set_module_tensor_to_device(target, key, device, value=read.tensor(key), dtype=p.dtype)
    target.tie_weights()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bytes(params, local: bool) -> int:
    """Bytes of `params` whole, or (`local`) held by this process: FSDP2's local shard, ZeRO-3's partition."""
    total = 0
    for p in params:
        if hasattr(p, "ds_tensor"):
            n, size = (p.ds_tensor.numel() if local else p.ds_numel), p.ds_tensor.element_size()
        else:
            t = p.to_local() if local and hasattr(p, "to_local") else p
            n, size = t.numel(), t.element_size()
        total += n * size
    return total


def describe(sizes: dict[str, int], sharding: Sharding = Sharding("fsdp2")) -> str:
    unit, scale = ("GiB", 2 ** 30) if sizes["whole"] >= 2 ** 30 else ("MiB", 2 ** 20)

    def size(key: str) -> str:
        return f"{sizes[key] / scale:.1f}"

    n = sizes["processes"]
    over = f"target sharded over {n} process{'es' if n != 1 else ''} ({sharding.engine}, one unit per decoder layer"
    if sharding.offload:
        rest = (sizes["whole"] - sizes["layers_whole"]) / scale
        return (f"{over}, kept in CPU memory): decoder layers {size('layers_here')} of {size('layers_whole')} {unit} "
                f"held here in CPU memory, gathered onto the device one layer at a time; the rest (embedding, final "
                f"norm, LM head: {rest:.1f} {unit}) whole on the device")
    return (f"{over}): {size('here')} of its {size('whole')} {unit} held here; decoder layers {size('layers_here')} of "
            f"{size('layers_whole')} {unit}, the rest (embedding, final norm, LM head) whole on every process")
