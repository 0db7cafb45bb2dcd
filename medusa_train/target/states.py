"""What the frozen target says about a training batch: its final hidden states h and its greedy token at every
position, computed by the target or read from the hidden-state cache.

The trainer, the held-out evaluation and the `evaluate` CLI all take both through `TargetStates`, so the loss
has one teacher path: the accuracies compare against these greedy tokens, and the soft labels score only the
columns the heads score (a draft vocabulary's, when there is one).

With `train.cache_hidden` the target is frozen, so h for a row is the same every epoch: after the first, a batch
whose rows are all cached skips the target forward (the dominant cost when heads are small). Rows are keyed by
their token ids. With `train.hidden_cache_dir` (and, under several processes, always: `OUTPUT_DIR/hidden-cache`
unless the recipe names a directory) the rows live on disk: each process writes the rows it computed as shard files
(atomically, every `FLUSH_BYTES` of new rows and at every epoch's end and the run's) and maps every shard into
memory, so a row costs the process's memory only while it is in a batch, and the processes share their rows: at an
epoch's end each one writes its new rows, they wait for each other, and each maps the others' shards, so the next
epoch, whose shuffle hands a process rows another one computed, runs no target forward. A later run on other heads
reuses the same directory. Cost on disk: d x (2 or 4) bytes per token for h, 4 for the greedy token (SmolLM2-135M
in float32: 2.3 KB a token, 2.6 GB for the documented 1.1M-token data); eagle3 heads also read three intermediate
layers, so their rows are 4 d wide: 4x that (a bfloat16 forward, `target.forward_dtype=bfloat16`, halves it). In
memory: about 250 bytes a row for the index, plus the rows computed since the last write.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from shutil import disk_usage
from typing import Any

import torch
from torch import nn

from ..base.errors import ConfigError
from ..base.files import atomic_write, atomic_write_text, remove_stale_temps
from .model import fingerprint_difference, greedy_tokens, target_fingerprint, target_hidden
from .weights import weights_digest

META_NAME = "meta.json"
SHARD_GLOB = "shard-*.pt"
FLUSH_BYTES = 512 * 2 ** 20  # new rows kept in memory before they are written as a shard (and mapped back)
DAMAGED_PREFIX = "damaged-"  # a shard that cannot be read is renamed so (out of SHARD_GLOB) and its rows computed again
KEY_BYTES = 20


def row_key(ids: torch.Tensor) -> bytes:
    """A row's cache key: the hash of its token ids."""
    return hashlib.sha1(ids.to(torch.int64).cpu().numpy().tobytes()).digest()


class DamagedShard(ValueError):
    """A shard file that cannot be read (truncated by a power loss, or damaged)."""


class Shard:
    """One shard file of the cache, memory-mapped: a row's tensors are views into the file, read when used.

    The format: {"keys": uint8 [n, 20], "offsets": int64 [n + 1], "h": [tokens, width], "greedy": int32 [tokens],
    "has_greedy": bool [n]}, row i at tokens offsets[i]:offsets[i + 1]. Shards written before it ({key: h}, one tensor a
    row) are read as they are, their greedy tokens computed again."""

    def __init__(self, path: Path) -> None:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(data, dict):
                raise ValueError(f"holds a {type(data).__name__}, not a dict of rows")
            if "offsets" in data:
                self._check(data)
        except Exception as e:  # noqa: BLE001 - a truncated or damaged file fails in several ways
            raise DamagedShard(f"{path} cannot be read ({str(e).splitlines()[0][:100]})") from None
        self.path = path
        if "offsets" in data:
            self.rows = None
            self.h, self.greedy_tokens, has = data["h"], data["greedy"], data["has_greedy"].tolist()
            offsets, keys = data["offsets"].tolist(), data["keys"].numpy().tobytes()
            self.slots = {keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]: (offsets[i], offsets[i + 1], has[i])
                          for i in range(len(has))}
        else:
            self.rows, self.slots = data, dict.fromkeys(data)

    @staticmethod
    def _check(data: dict) -> None:
        """The shapes agree: as many keys, offsets and flags as rows, as many states and tokens as the offsets say."""
        n, offsets = len(data["has_greedy"]), data["offsets"]
        if data["keys"].shape != (n, KEY_BYTES) or offsets.shape != (n + 1,):
            raise ValueError(f"{n} rows but keys {tuple(data['keys'].shape)} and offsets {tuple(offsets.shape)}")
        tokens = int(offsets[-1])
        if data["h"].shape[0] != tokens or data["greedy"].shape[0] != tokens:
            raise ValueError(f"{tokens} tokens by the offsets, but states for {data['h'].shape[0]}")

    def keys(self):
        return self.slots.keys()

    def hidden(self, key: bytes) -> torch.Tensor:
        if self.rows is not None:
            return self.rows[key]
        start, end, _ = self.slots[key]
        return self.h[start:end]

    def greedy(self, key: bytes) -> torch.Tensor | None:
        if self.rows is not None:
            return None
        start, end, has = self.slots[key]
        return self.greedy_tokens[start:end] if has else None

    @staticmethod
    def write(path: Path, rows: list[tuple[bytes, torch.Tensor, torch.Tensor | None]]) -> None:
        """Write (key, h [n, width], greedy [n] or None) rows as one shard, atomically."""
        lengths = [h.shape[0] for _, h, _ in rows]
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        greedy = torch.cat([g.to(torch.int32) if g is not None else torch.zeros(h.shape[0], dtype=torch.int32)
                            for _, h, g in rows])
        data = {"keys": torch.frombuffer(bytearray(b"".join(k for k, _, _ in rows)), dtype=torch.uint8
                                         ).view(len(rows), KEY_BYTES),
                "offsets": offsets, "h": torch.cat([h for _, h, _ in rows]), "greedy": greedy,
                "has_greedy": torch.tensor([g is not None for _, _, g in rows])}
        atomic_write(path, lambda tmp: torch.save(data, tmp))


class TargetStates:
    """(h [B, T, d], greedy [B, T]) for training batches: `states(batch)`.

    `cache`: keep every row's h once computed (`train.cache_hidden`), in memory; `directory`: on disk instead, shared
    by the processes and by later runs, tied to the target's `fingerprint` and the dtype of the forward that made them
    (`train.hidden_cache_dir`, implies `cache`). The greedy tokens are kept with h, so a row pays the full-vocabulary
    LM head once, not once per epoch. `computed_rows` / `cached_rows` count the rows this process ran the target on
    and those it read from the cache.
    """

    def __init__(self, target: nn.Module, lm_head: nn.Module, cache: bool = False,
                 directory: str | os.PathLike | None = None, fingerprint: dict[str, Any] | None = None,
                 rank: int = 0, layers: list[int] | tuple[int, ...] = (), lockstep: bool = False,
                 reserve_bytes: int = 0) -> None:
        self.target, self.lm_head = target, lm_head
        self.lockstep = lockstep  # a sharded target: every process runs its forward whenever any process must
        self.layers = tuple(layers)  # eagle3: the aux layers read after h_t
        self.cache = cache or bool(directory)
        self.fresh: dict[bytes, torch.Tensor] = {}  # rows in memory: all of them without a directory, else unwritten
        self.fresh_greedy: dict[bytes, torch.Tensor] = {}
        self.fresh_bytes = 0
        self.index: dict[bytes, Shard] = {}  # rows on disk
        self.opened: set[str] = set()
        self.dir = Path(directory) if directory else None
        self.rank = rank
        self.reserve_bytes = reserve_bytes  # room a flush leaves free on the cache's disk (the checkpoints')
        self.writing = True  # False once a shard could not be written (a full disk): no new rows are kept
        self.computed_rows = self.cached_rows = 0
        if self.dir is not None:
            self._open(fingerprint or {}, str(next(target.parameters()).dtype).removeprefix("torch."))
        self.d = target.get_output_embeddings().weight.shape[1]

    def __contains__(self, key: bytes) -> bool:
        return key in self.fresh or key in self.index

    def __len__(self) -> int:
        return len(self.fresh) + len(self.index)

    def _open(self, fingerprint: dict[str, Any], dtype: str) -> None:
        """Check (or write) meta.json: the target's fingerprint and the dtype of the forward that made the rows;
        then map every shard."""
        meta = self.dir / META_NAME
        if meta.is_file():
            saved = json.loads(meta.read_text())
            diff = fingerprint_difference(saved.get("target_fingerprint", {}), fingerprint) or weights_difference(
                saved.get("target_fingerprint", {}).get("weights"), fingerprint.get("weights"))
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
        remove_stale_temps(self.dir)  # shards that killed processes were writing
        self.refresh()

    def refresh(self) -> int:
        """Map the shards written since the last look (other processes', or other runs'); returns the rows added."""
        if self.dir is None:
            return 0
        before = len(self.index)
        for path in sorted(self.dir.glob(SHARD_GLOB)):
            if path.name not in self.opened:
                try:
                    shard = Shard(path)
                except DamagedShard as e:
                    self._set_aside(path, e)
                    continue
                self.index.update(dict.fromkeys(shard.keys(), shard))
                self.opened.add(path.name)
        return len(self.index) - before

    def _set_aside(self, path: Path, problem: Exception) -> None:
        """A shard that cannot be read (a power loss before its data reached the disk, a damaged disk): renamed out of
        the cache's sight, so that no process reads it again, and its rows computed again."""
        aside = path.with_name(DAMAGED_PREFIX + path.name)
        try:
            os.replace(path, aside)
        except FileNotFoundError:  # another process set it aside first
            return
        except OSError:
            aside = path
        self.opened.add(path.name)
        print(f"\nwarning: train.hidden_cache_dir: {problem}: set aside as {aside.name}; its rows are computed again",
              flush=True)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return target_hidden(self.target, ids, mask, self.layers)

    def hidden_row(self, key: bytes) -> torch.Tensor:
        """A cached row's states [n, width] (a view into its shard's file, or the copy in memory)."""
        row = self.fresh.get(key)
        return row if row is not None else self.index[key].hidden(key)

    def _greedy_row(self, key: bytes) -> torch.Tensor | None:
        row = self.fresh_greedy.get(key)
        if row is None and key in self.index:
            row = self.index[key].greedy(key)
        return row

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
        rows = [self._greedy_row(k) for k in keys]
        no_greedy = [b for b, row in enumerate(rows) if row is None]
        if no_greedy:
            fresh = greedy_tokens(self.lm_head, h[no_greedy][..., :self.d])
            for i, b in enumerate(no_greedy):
                rows[b] = fresh[i, :lengths[b]].to("cpu", torch.int32, copy=True)
                if self.writing:
                    self.fresh_greedy[keys[b]] = rows[b]
        greedy = torch.zeros(ids.shape, dtype=torch.long)
        for b, row in enumerate(rows):
            greedy[b, :lengths[b]] = row
        if self.dir is not None and self.fresh_bytes >= FLUSH_BYTES:
            self.flush()
        return h, greedy.to(ids.device, non_blocking=True)

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor, keys: list[bytes], lengths: list[int]) -> torch.Tensor:
        """h from the cache where it can; the target runs on the rows it has not seen only."""
        missing = [b for b, k in enumerate(keys) if k not in self]
        self.computed_rows += len(missing)
        self.cached_rows += len(keys) - len(missing)
        if self.lockstep and self._any_process_needs_the_target(bool(missing)) and not missing:
            self.forward(ids[:1, :1], mask[:1, :1])  # takes its part in each sharded layer's all-gather
        if len(missing) == len(keys):
            h = self.forward(ids, mask)
        else:  # rows cached (all, or some: new data added to a cached set): the target runs on the others only
            like = self.hidden_row(next(k for k in keys if k in self))
            h = torch.zeros(ids.shape[0], ids.shape[1], like.shape[-1], dtype=like.dtype)
            for b, k in enumerate(keys):
                if k in self:
                    h[b, :lengths[b]] = self.hidden_row(k)
            h = h.to(ids.device, non_blocking=True)
            if missing:
                rows, n = torch.tensor(missing, device=ids.device), max(lengths[b] for b in missing)
                h[rows, :n] = self.forward(ids[rows, :n], mask[rows, :n]).to(like.dtype)
        for b in missing:
            if keys[b] not in self:  # a batch may hold the same row twice
                self.keep(keys[b], h[b, :lengths[b]])
        return h

    def keep(self, key: bytes, h: torch.Tensor, greedy: torch.Tensor | None = None) -> None:
        """Keep one row's states [n, width] (a CPU copy) under its `row_key`, and its greedy tokens [n] if known;
        with a directory, the next flush writes them (nothing is kept once the cache's disk is full)."""
        if not self.writing:
            return
        self.fresh[key] = h.detach().to("cpu", copy=True)
        self.fresh_bytes += self.fresh[key].nbytes
        if greedy is not None:
            self.fresh_greedy[key] = greedy.detach().to("cpu", torch.int32, copy=True)

    def _any_process_needs_the_target(self, here: bool) -> bool:
        """Whether any process runs the target on this micro-step: one small all-reduce, made only with a sharded
        target and a cache, where a process that skipped the forward would leave the others waiting in a layer's
        all-gather."""
        flag = torch.tensor([float(here)], device=self.lm_head.weight.device)
        torch.distributed.all_reduce(flag)
        return bool(flag.item() > 0)

    def end_epoch(self, wait_for_everyone) -> None:
        """At an epoch's end: write the rows computed since the last flush; with the cache on disk, wait for the other
        processes to write theirs (`wait_for_everyone`, a barrier) and map them, so that the next epoch, whose shuffle
        hands this process rows another one computed, runs no target forward."""
        self.flush()
        if self.dir is not None:
            wait_for_everyone()
            self.refresh()

    def flush(self) -> None:
        """Write the rows computed since the last flush as one new shard and map it back, so that their memory is
        freed (no-op without a directory)."""
        if self.dir is None or not self.fresh:
            return
        final = self.dir / f"shard-{time.strftime('%Y%m%d-%H%M%S')}-r{self.rank}-{uuid.uuid4().hex[:8]}.pt"
        rows = [(k, h, self.fresh_greedy.get(k)) for k, h in self.fresh.items()]
        self.fresh, self.fresh_greedy, need, self.fresh_bytes = {}, {}, self.fresh_bytes, 0
        free = disk_usage(self.dir).free
        if free < need + self.reserve_bytes:
            return self._stop_writing(len(rows), need, free, "not enough room")
        try:
            Shard.write(final, rows)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its zip writer
            free = disk_usage(self.dir).free
            if isinstance(e, RuntimeError) and free >= need:
                raise  # not a full disk
            return self._stop_writing(len(rows), need, free, str(e).splitlines()[0][:80])
        self.refresh()

    def _stop_writing(self, n: int, need: int, free: int, why: str) -> None:
        """A shard could not be written: say so once; training goes on, reading the rows already written and
        computing the others (the unwritten rows' memory is freed)."""
        self.writing = False
        reserve = f", {self.reserve_bytes / 2 ** 30:.2f} GiB kept for the checkpoints" if self.reserve_bytes else ""
        print(f"\nwarning: train.hidden_cache_dir={self.dir}: a shard of {n} rows ({need / 2 ** 20:.1f} MiB) cannot be "
              f"written ({why}; {free / 2 ** 20:.1f} MiB free{reserve}): training goes on without caching more rows "
              "(those on disk are still read; free space, or point the cache at a larger disk, for the next run)",
              flush=True)


def cache_fingerprint(cfg, target: nn.Module) -> dict[str, Any]:
    """What ties a cache to the target that made it: `target_fingerprint` (sizes, the embedding's and LM head's
    signatures, the adapter) and the digest of its files (`weights.weights_digest`: any tensor or config change).
    `cfg`: the recipe's target section."""
    return target_fingerprint(target) | {"weights": weights_digest(cfg.model, cfg.gguf_file, cfg.adapter)}


def weights_difference(saved: str | None, now: str | None) -> str | None:
    """Why a cache's recorded weights digest rules this target out (the tail of a sentence), or None. A cache
    written before digests were recorded, or a target whose files are not on this machine, cannot be told: allowed."""
    if saved and now and saved != now:
        return ("its weight files differ from those the cache was made from (a fine-tune, a merged adapter or a "
                "changed config that keeps the embedding and LM head)")
    return None


def read_shard(path: str | os.PathLike) -> dict[bytes, torch.Tensor]:
    """A shard's rows, {key: h [n, width]} (for tools and tests)."""
    shard = Shard(Path(path))
    return {k: shard.hidden(k) for k in shard.keys()}
