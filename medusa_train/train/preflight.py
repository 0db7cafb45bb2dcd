"""The checks before loading: what would otherwise fail after the work (an output directory that cannot be written,
a disk too small for the checkpoints, sequences longer than the target's positions, an unreachable hub) or after
training (a target the engine refuses, eagle3 heads on a target whose layers cannot be found), each a one-line
ConfigError before any model loads, read from the recipe and the target's config alone."""

from __future__ import annotations

import os
from pathlib import Path
from shutil import disk_usage
import torch

from ..config import Config, ConfigError
from ..kinds.heads import DraftHeads, HeadsSpec, kind_class
from ..target.model import check_hub_reachable, resolve_dtype, text_config, unsupported_reason
from ..target.states import SHARD_GLOB

def check_writable(path: Path, key: str) -> None:
    """ConfigError unless `path` is (or can be made) a directory this process can write: a real probe write."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path} is a file, not a directory: point {key} at a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={path} cannot be written ({e.strerror}): choose a directory you can write, "
                          "or fix its permissions") from None


def target_config(cfg: Config):
    """The target's config, cheap to read before the model loads; None if it cannot be read (loading the model will
    then say why)."""
    from transformers import AutoConfig

    # else an unreachable hub costs ~90 s of retries here, and again later
    check_hub_reachable(cfg.target.model, filename=cfg.target.gguf_file)
    kw = {"gguf_file": cfg.target.gguf_file} if cfg.target.gguf_file else {}
    try:
        return AutoConfig.from_pretrained(cfg.target.model, trust_remote_code=cfg.target.trust_remote_code, **kw)
    except Exception:  # noqa: BLE001 - offline, missing, gated: all reported by the model load
        return None


def check_target_supported(cfg: Config, config) -> None:
    """The engine's support rules, from the config alone, and what the heads' kind needs of the target: heads are
    never trained for a target the engine would refuse, nor fail after an hour for want of its layers."""
    text = text_config(config)
    model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "?")
    reason = unsupported_reason(config)
    if reason:
        raise ConfigError(f"target.model={cfg.target.model}: {model_type}: {reason}; the engine cannot generate with "
                          "heads for it, so nothing was trained: pick another target (docs/architectures.md lists "
                          "them)")
    kind = kind_class(cfg.heads.kind)
    kind.check_target(kind.options_from(cfg.heads), config, cfg.target.trust_remote_code)


def heads_spec(cfg: Config, text) -> HeadsSpec:
    """The spec of the recipe's heads for a target of config `text`, before any weight loads."""
    h = cfg.heads
    kind = kind_class(h.kind)
    options = kind.resolve(kind.options_from(h), text)  # no embedding yet: placeholders of the same size
    return HeadsSpec(kind=h.kind, num_heads=h.num_heads, hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                     draft_vocab_size=h.draft_vocab(text.vocab_size), layer_config=kind.layer_config(options, text),
                     options=options)


def head_parameters(cfg: Config, text) -> int:
    """How many parameters the recipe's heads have for a target of config `text`, counted on heads built on the
    meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DraftHeads(heads_spec(cfg, text)).parameters())


def checkpoint_bytes(cfg: Config, text) -> int:
    """The room the checkpoints and the final heads take: a checkpoint holds float32 weights and AdamW's two moments
    (12 bytes a parameter), one more exists while the newest is written, and the final heads take 4."""
    n = head_parameters(cfg, text)
    return 12 * n * (cfg.train.keep_checkpoints + 1) + 4 * n


def cache_bytes_per_token(cfg: Config, text, device: torch.device | str) -> int:
    """What a token costs in the hidden-state cache: the states the heads read (h, and eagle3's layers: (1 + layers)
    x d), in the dtype of the forward that makes them, and its greedy token (4 bytes)."""
    with torch.device("meta"):
        layers = len(DraftHeads(heads_spec(cfg, text)).target_layers)
    forward = cfg.target.forward_dtype
    dtype = getattr(torch, forward) if forward != "same" else resolve_dtype(cfg.target.dtype, device)
    return (1 + layers) * text.hidden_size * dtype.itemsize + 4


def _on_disk(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (the disk it will be made on)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def checkpoint_reserve(cfg: Config, text, directory: str | os.PathLike) -> int:
    """The room a cache in `directory` leaves free for the checkpoints: theirs when they share its disk, else 0."""
    shared = _on_disk(Path(directory)).stat().st_dev == _on_disk(Path(cfg.output_dir)).stat().st_dev
    return checkpoint_bytes(cfg, text) if shared else 0


def check_cache_room(cfg: Config, directory: str | os.PathLike, tokens: int, device: torch.device | str, config
                     ) -> str | None:
    """The hidden-state cache's expected size for `tokens` training tokens against the room on its disk: a line to
    print, or a one-line ConfigError when it cannot fit (beside the checkpoints, when they share the disk). The
    shards already there count as written (a later run on the same data writes nothing). `config`: the target's, as
    `target_config` read it; None (unreadable) checks nothing."""
    if config is None:
        return None
    text = text_config(config)
    directory = Path(directory)
    per_token = cache_bytes_per_token(cfg, text, device)
    need = int(tokens * per_token * 1.02)  # keys, offsets and the files' headers: ~1-2%
    have = sum(f.stat().st_size for f in directory.glob(SHARD_GLOB)) if directory.is_dir() else 0
    free = disk_usage(_on_disk(directory)).free
    reserve = checkpoint_reserve(cfg, text, directory)
    if free < max(0, need - have) + reserve:
        raise ConfigError(
            f"train.hidden_cache_dir={directory}: the cache needs about {size(need)} for {tokens:,} tokens "
            f"({per_token:,} bytes a token; {size(have)} written already), but its disk has {size(free)} free"
            + (f", {size(reserve)} of them for the checkpoints" if reserve else "") + ": point it at a larger disk, "
            "set target.forward_dtype=bfloat16 (half the bytes), or train without it (train.cache_hidden=false, "
            "train.hidden_cache_dir='')")
    return (f"hidden cache: about {size(need)} for {tokens:,} tokens ({per_token:,} bytes a token), {size(have)} "
            f"written already, {size(free)} free on its disk")


def size(n: float) -> str:
    """Bytes for a reader: `1.50 GiB`, `12.0 MiB`."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2 ** 10:.1f} KiB"


def check_before_loading(cfg: Config, config) -> None:
    """What would otherwise fail after the work: directories that cannot be written (found at the first write, an
    epoch in), a disk too full for the checkpoints, sequences longer than the target's positions. `config`: the
    target's, as `target_config` read it (once a run: reading a GGUF's parses its header); None checks the
    directories only (the model load then says why it cannot be read)."""
    out = Path(cfg.output_dir)
    check_writable(out, "output_dir")
    if cfg.train.hidden_cache_dir:
        check_writable(Path(cfg.train.hidden_cache_dir), "train.hidden_cache_dir")
    if config is None:
        return
    check_target_supported(cfg, config)
    text = text_config(config)
    need = checkpoint_bytes(cfg, text)
    free = disk_usage(out).free
    if free < need:
        raise ConfigError(f"output_dir={out}: {free / 2**30:.2f} GiB free, but {cfg.train.keep_checkpoints} "
                          f"checkpoints and the heads need about {need / 2**30:.2f} GiB: free some space, lower "
                          "train.keep_checkpoints, or write elsewhere")
    positions = getattr(text, "max_position_embeddings", None)
    if positions is not None and cfg.data.max_length > positions:
        raise ConfigError(f"data.max_length={cfg.data.max_length} exceeds the target's {positions} positions "
                          f"(max_position_embeddings): set data.max_length <= {positions}")
