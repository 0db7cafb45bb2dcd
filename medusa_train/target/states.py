"""What the frozen target says about a training batch: its final hidden states h and its greedy token at every
position, computed by the target or read from the hidden-state cache.

The trainer, the held-out evaluation and the `evaluate` CLI all take both through `TargetStates`, so the loss
has one teacher path: the accuracies compare against these greedy tokens, and the soft labels score only the
columns the heads score (a draft vocabulary's, when there is one).

With `train.cache_hidden` the target is frozen, so h for a row is the same every epoch: after the first, a batch
whose rows are all cached skips the target forward (the dominant cost when heads are small). Rows are keyed by
their token ids, so with `train.hidden_cache_dir` a later run on other heads reuses them: each `flush` writes the
rows computed since the last one as a new shard file, atomically. Cost: d x (2 or 4) bytes per token on disk and
in memory (SmolLM2-135M in float32: 2.3 KB a token, 2.6 GB for the documented 1.1M-token data). eagle3 heads also
read three intermediate layers, so their rows are 4 d wide: 4x that (9.2 KB a token in float32; a bfloat16 forward,
`target.forward_dtype=bfloat16`, halves it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base.errors import ConfigError
from ..base.files import atomic_write, atomic_write_text
from .model import fingerprint_difference, greedy_tokens, target_hidden

META_NAME = "meta.json"


def row_key(ids: torch.Tensor) -> bytes:
    """A row's cache key: the hash of its token ids."""
    return hashlib.sha1(ids.to(torch.int64).cpu().numpy().tobytes()).digest()


class TargetStates:
    """(h [B, T, d], greedy [B, T]) for training batches: `states(batch)`.

    `cache`: keep every row's h in CPU memory once computed (`train.cache_hidden`); `directory`: also on disk,
    tied to the target's `fingerprint` and the dtype of the forward that made them (`train.hidden_cache_dir`,
    implies `cache`). Greedy tokens are kept per row in memory whenever h is (not on disk: cheap to recompute
    from h), so a row pays the full-vocabulary LM head once per run, not once per epoch.
    """

    def __init__(self, target: nn.Module, lm_head: nn.Module, cache: bool = False,
                 directory: str | os.PathLike | None = None, fingerprint: dict[str, Any] | None = None,
                 rank: int = 0, layers: list[int] | tuple[int, ...] = (), lockstep: bool = False) -> None:
        self.target, self.lm_head = target, lm_head
        self.lockstep = lockstep  # a sharded target: every process runs its forward whenever any process must
        self.layers = tuple(layers)  # eagle3: the aux layers read after h_t
        self.cache = cache or bool(directory)
        self.rows: dict[bytes, torch.Tensor] = {}
        self.greedy_rows: dict[bytes, torch.Tensor] = {}
        self.new: list[bytes] = []  # rows the next flush writes
        self.dir = Path(directory) if directory else None
        self.rank = rank
        if self.dir is not None:
            self._open(fingerprint or {}, str(next(target.parameters()).dtype).removeprefix("torch."))
        self.d = target.get_output_embeddings().weight.shape[1]

    def _open(self, fingerprint: dict[str, Any], dtype: str) -> None:
        """Check (or write) meta.json: the target's fingerprint and the dtype of the forward that made the rows;
        then read every shard."""
        meta = self.dir / META_NAME
        if meta.is_file():
            saved = json.loads(meta.read_text())
            diff = fingerprint_difference(saved.get("target_fingerprint", {}), fingerprint)
            if diff is not None:
                raise ConfigError(f"train.hidden_cache_dir={self.dir} holds hidden states of another target "
                                  f"({diff}): point it at a new directory, or delete this one")
            saved_layers = saved.get("layers", [])
            if saved_layers != list(self.layers):
                raise ConfigError(f"train.hidden_cache_dir={self.dir} holds the target's states at layers "
                                  f"{saved_layers or 'none (h_t only)'}, but these heads read "
                                  f"{list(self.layers) or 'none (h_t only)'}: point it at a new directory (one per "
                                  "heads.kind=eagle3 layer set), or delete this one")
            saved_dtype = saved.get("dtype", "float32")  # caches written before the key existed were float32
            if saved_dtype != dtype:
                raise ConfigError(f"train.hidden_cache_dir={self.dir} holds hidden states of a {saved_dtype} "
                                  f"forward, but this run's target forward is {dtype}: set target.forward_dtype="
                                  f"{saved_dtype} (or target.dtype), or point it at a new directory")
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            # several ranks may race here; every one writes the same content
            atomic_write_text(meta, json.dumps({"target_fingerprint": fingerprint, "dtype": dtype,
                                                "layers": list(self.layers)}))
        for shard in sorted(self.dir.glob("shard-*.pt")):
            try:
                self.rows.update(torch.load(shard, map_location="cpu", weights_only=True))
            except Exception as e:  # noqa: BLE001 - a truncated or damaged file fails in several ways
                raise ConfigError(f"train.hidden_cache_dir: {shard} cannot be read ({str(e).splitlines()[0][:100]}): "
                                  "delete that shard (its rows are computed again) or the whole directory") from None

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return target_hidden(self.target, ids, mask, self.layers)

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(h [B, T, d], the target's greedy token at every position [B, T], 0 past each row's end). With `layers`
        (eagle3 heads), h is followed by the states at those layers: [B, T, (1 + len(layers)) d]."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if not self.cache:
            h = self.forward(ids, mask)
            return h, greedy_tokens(self.lm_head, h[..., :self.d]) * mask
        lengths = mask.sum(1).tolist()  # a small host read, once per micro-step
        keys = [row_key(ids[b, :n]) for b, n in enumerate(lengths)]
        h = self._hidden(ids, mask, keys, lengths)
        no_greedy = [b for b, k in enumerate(keys) if k not in self.greedy_rows]
        if no_greedy:
            fresh = greedy_tokens(self.lm_head, h[no_greedy][..., :self.d])
            for i, b in enumerate(no_greedy):
                self.greedy_rows[keys[b]] = fresh[i, :lengths[b]].to("cpu", copy=True)
        greedy = torch.zeros(ids.shape, dtype=torch.long)
        for b, k in enumerate(keys):
            greedy[b, :lengths[b]] = self.greedy_rows[k]
        return h, greedy.to(ids.device, non_blocking=True)

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor, keys: list[bytes], lengths: list[int]) -> torch.Tensor:
        """h from the cache where it can; the target runs on the rows it has not seen only."""
        missing = [b for b, k in enumerate(keys) if k not in self.rows]
        if self.lockstep and self._any_process_needs_the_target(bool(missing)) and not missing:
            self.forward(ids[:1, :1], mask[:1, :1])  # takes its part in each sharded layer's all-gather
        if len(missing) == len(keys):
            h = self.forward(ids, mask)
        else:  # new data added to a cached set: the target runs on the new rows only
            like = next(iter(self.rows.values()))
            h = torch.zeros(ids.shape[0], ids.shape[1], like.shape[-1], dtype=like.dtype)
            for b, k in enumerate(keys):
                if k in self.rows:
                    h[b, :lengths[b]] = self.rows[k]
            h = h.to(ids.device, non_blocking=True)
            if missing:
                rows, n = torch.tensor(missing, device=ids.device), max(lengths[b] for b in missing)
                h[rows, :n] = self.forward(ids[rows, :n], mask[rows, :n]).to(like.dtype)
        for b in missing:
            if keys[b] not in self.rows:  # a batch may hold the same row twice
                self.keep(keys[b], h[b, :lengths[b]])
        return h

    def keep(self, key: bytes, h: torch.Tensor) -> None:
        """Keep one row's states [n, width] (a CPU copy) under its `row_key`; the next flush writes it."""
        self.rows[key] = h.detach().to("cpu", copy=True)
        if self.dir is not None:
            self.new.append(key)

    def _any_process_needs_the_target(self, here: bool) -> bool:
        """Whether any process runs the target on this micro-step: one small all-reduce, made only with a sharded
        target and a cache, where a process that skipped the forward would leave the others waiting in a layer's
        all-gather."""
        flag = torch.tensor([float(here)], device=self.lm_head.weight.device)
        torch.distributed.all_reduce(flag)
        return bool(flag.item() > 0)

    def flush(self) -> None:
        """Write the rows computed since the last flush as one new shard (no-op without a directory)."""
        if self.dir is None or not self.new:
            return
        final = self.dir / f"shard-{time.strftime('%Y%m%d-%H%M%S')}-r{self.rank}-{uuid.uuid4().hex[:8]}.pt"
        atomic_write(final, lambda tmp: torch.save({k: self.rows[k] for k in self.new}, tmp))
        self.new = []
