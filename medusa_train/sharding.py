"""The frozen target sharded across processes with FSDP2 (`fully_shard`), for targets larger than one device.

An Accelerate config with `distributed_type: FSDP` and `fsdp_version: 2` (recipes/accelerate/fsdp2.yaml) asks for it.
Each decoder layer of the target becomes its own FSDP unit: every process keeps 1/N of its weights and gathers the
whole layer only for that layer's forward (then frees it again: `reshard_after_forward`). The embedding, the final
norm and the LM head stay whole on every process: the heads read them outside the target's forward (the input
embedding of a draft token, the LM head's rows in the loss), and they are a few percent of a large target.

The heads themselves train replicated under DDP: they are small next to the target (EAGLE-3's layer for a 70B target
is ~1.4B parameters), and one code path for them on CPU and GPU is one that the tests here run. So the Accelerator is
built without Accelerate's own FSDP (which would wrap the heads, and which Accelerate ignores on CPUs), and this
module shards the target with torch's `fully_shard` directly.

Every process must run the target's forward the same number of times (each layer's all-gather is collective): the
hidden-state cache keeps them in step (`TargetStates(lockstep=True)`), and the real tau, which generates on the main
process alone, is refused.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .config import Config, ConfigError


def sharding_requested() -> bool:
    """Whether the launcher's Accelerate config asks for FSDP2 (`accelerate launch` exports its FSDP settings)."""
    return (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
            and os.environ.get("FSDP_VERSION", "1") == "2")


def take_over_fsdp2() -> bool:
    """When FSDP2 is asked for: remove Accelerate's FSDP switch from this process's environment, so that the
    Accelerator built next runs the heads under DDP while `shard_target` shards the target. Returns whether it was
    asked for (call once, before the Accelerator is made)."""
    if not sharding_requested():
        return False
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    return True


def check_shardable(cfg: Config, world_size: int) -> None:
    """One-line refusals for what a sharded target does not run, before anything loads."""
    prefix = "fsdp_version 2 (the target sharded across processes)"
    if cfg.target.lora.r:
        raise ConfigError(f"{prefix}: target.lora trains the target's adapters, which a frozen sharded target does "
                          "not hold; set target.lora.r=0, or launch joint training with a DDP config")
    if cfg.target.forward_dtype != "same":
        raise ConfigError(f"{prefix}: target.forward_dtype={cfg.target.forward_dtype} keeps a second whole copy of "
                          "the target on every process; set target.forward_dtype=same")
    if cfg.eval.tau_every:
        raise ConfigError(f"{prefix}: eval.tau_every generates on the main process alone, which a sharded target "
                          "cannot (every process takes part in each layer); set eval.tau_every=0 and measure tau "
                          "after training with python -m inference.bench")
    if world_size < 2:
        raise ConfigError(f"{prefix} was asked for with one process: launch with --num_processes 2 or more, or use "
                          "recipes/accelerate/single_gpu.yaml")


def shard_target(target: nn.Module, device: torch.device) -> dict[str, int]:
    """Shard each decoder layer of the frozen `target` across the process group (FSDP2, in place); the rest moves
    to `device` whole. Returns the bytes of the target's weights: whole, held by this process, and those of the
    layers that are sharded (whole and held here)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .target import decoder_layers

    world = torch.distributed.get_world_size()
    whole = _bytes(target.parameters(), local=False)
    layers = decoder_layers(target)
    layers_whole = _bytes(layers.parameters(), local=False)
    mesh = init_device_mesh(device.type, (world,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    target.to(device)
    return {"whole": whole, "here": _bytes(target.parameters(), local=True), "layers_whole": layers_whole,
            "layers_here": _bytes(layers.parameters(), local=True), "processes": world}


def _bytes(params, local: bool) -> int:
    total = 0
    for p in params:
        t = p.to_local() if local and hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def describe(sizes: dict[str, int]) -> str:
    unit, scale = ("GiB", 2 ** 30) if sizes["whole"] >= 2 ** 30 else ("MiB", 2 ** 20)

    def size(key: str) -> str:
        return f"{sizes[key] / scale:.1f}"

    return (f"target sharded over {sizes['processes']} processes (FSDP2, one unit per decoder layer): {size('here')} "
            f"of its {size('whole')} {unit} held here; decoder layers {size('layers_here')} of {size('layers_whole')} "
            f"{unit}, the rest (embedding, final norm, LM head) whole on every process")
