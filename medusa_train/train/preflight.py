"""The checks before loading: what would otherwise fail after the work (an output directory that cannot be written,
a disk too small for the checkpoints, sequences longer than the target's positions, an unreachable hub) or after
training (a target the engine refuses, eagle3 heads on a target whose layers cannot be found), each a one-line
ConfigError before any model loads, read from the recipe and the target's config alone."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
import torch

from ..config import Config, ConfigError
from ..kinds.heads import DraftHeads, HeadsSpec, kind_class
from ..target.model import check_hub_reachable, text_config, unsupported_reason

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


def target_text_config(cfg: Config):
    """The target's text config (see `target_config`)."""
    config = target_config(cfg)
    return None if config is None else text_config(config)


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


def check_before_loading(cfg: Config) -> None:
    """What would otherwise fail after the work: directories that cannot be written (found at the first write, an
    epoch in), a disk too full for the checkpoints, sequences longer than the target's positions."""
    out = Path(cfg.output_dir)
    check_writable(out, "output_dir")
    if cfg.train.hidden_cache_dir:
        check_writable(Path(cfg.train.hidden_cache_dir), "train.hidden_cache_dir")
    config = target_config(cfg)
    if config is None:
        return
    check_target_supported(cfg, config)
    text = text_config(config)
    n = head_parameters(cfg, text)
    # a checkpoint holds float32 weights and AdamW's two moments (12 bytes a parameter), one more exists while the
    # newest is written, and the final heads take 4
    need = 12 * n * (cfg.train.keep_checkpoints + 1) + 4 * n
    free = shutil.disk_usage(out).free
    if free < need:
        raise ConfigError(f"output_dir={out}: {free / 2**30:.2f} GiB free, but {cfg.train.keep_checkpoints} "
                          f"checkpoints and the heads need about {need / 2**30:.2f} GiB: free some space, lower "
                          "train.keep_checkpoints, or write elsewhere")
    positions = getattr(text, "max_position_embeddings", None)
    if positions is not None and cfg.data.max_length > positions:
        raise ConfigError(f"data.max_length={cfg.data.max_length} exceeds the target's {positions} positions "
                          f"(max_position_embeddings): set data.max_length <= {positions}")
