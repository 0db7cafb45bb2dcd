"""The hidden-state cache on a bad day: a process killed in the middle of a flush, a power loss that leaves a shard
short, a disk that fills, a cache too large for its disk. None loses a row, leaves a damaged file behind, or changes
the heads (the cache never changes a value: the heads of a cached run equal an uncached run's)."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import ROOT, config, max_diff, write_text_data

from medusa_train.base import files
from medusa_train.config import ConfigError
from medusa_train.train.trainer import train

STEPS = ["train.max_steps=12", "train.save_every=1", "train.log_every=1", "eval.every=0"]

# `train.py` with every micro-step's rows flushed as a shard, and the `nth` shard write interrupted by a kill -9
KILLED_IN_A_FLUSH = """
import os, signal, sys
from pathlib import Path
import medusa_train.target.states as states
from medusa_train.base import files

moment, nth = sys.argv[1], int(sys.argv[2])
states.FLUSH_BYTES = 1
writes = [0]

def atomic_write(final, write):
    writes[0] += 1
    if writes[0] < nth:
        return files.atomic_write(final, write)
    tmp = files.temp_path(Path(final))
    if moment == "power-loss":  # renamed into place, but only half of it reached the disk
        files.atomic_write(final, write)
        tmp = Path(final)
    else:
        write(str(tmp))
    if moment in ("mid-write", "power-loss"):
        os.truncate(tmp, os.path.getsize(tmp) // 2)
    os.kill(os.getpid(), signal.SIGKILL)

states.atomic_write = atomic_write
from medusa_train.train.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A tiny saved Llama, a small plain-text dataset, and the heads of an uncached 12-step run (`ref`)."""
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("cache")
    save_tiny(root / "model", "llama")
    write_text_data(root / "text.jsonl")  # ~55 rows of 24 tokens: 12 steps of 4 cross an epoch boundary
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}}}\n"
        "heads: {num_heads: 2}\n"
        f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24, eval_size: 4}}\n"
        "train: {batch_size: 4, lr: 3.0e-3, warmup_steps: 2, seed: 0}\n"
        "eval: {max_batches: 1}\n")
    train(config(root, "ref", *STEPS))
    return root


def shards_readable(cache: Path) -> int:
    """Rows in the cache's shards, each shard read whole (a damaged one raises)."""
    from medusa_train.target.states import SHARD_GLOB, Shard

    return sum(len(Shard(p).slots) for p in cache.glob(SHARD_GLOB))


def test_atomic_write_syncs_before_the_rename_and_a_dead_writers_temp_file_is_removed(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a))) or real_replace(a, b))
    files.atomic_write_text(tmp_path / "a.json", "{}")
    monkeypatch.undo()
    tmp = str(files.temp_path(tmp_path / "a.json"))
    assert events == [("fsync", tmp), ("replace", tmp), ("fsync", str(tmp_path))]  # data, rename, then the entry

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {"dead": f".s1.pt.tmp-{files.HOST}-{dead.pid}", "live": f".s2.pt.tmp-{files.HOST}-{os.getpid()}",
             "other": ".s3.pt.tmp-elsewhere-7", "old": ".s4.pt.tmp-elsewhere-8", "legacy": f".s5.pt.tmp-{dead.pid}"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - files.STALE_TEMP_SECONDS - 60
    os.utime(tmp_path / names["old"], (old, old))
    assert files.remove_stale_temps(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.glob(".*")) == sorted([names["live"], names["other"]])


@pytest.mark.parametrize("moment,seed", [("mid-write", 0), ("before-rename", 1), ("power-loss", 2)])
def test_killed_in_a_cache_flush_then_resumed_ends_as_an_uncached_run(ws, moment, seed, capsys):
    """kill -9 of `train.py` inside its nth shard write (n at random): a half-written temp file, a whole one not yet
    renamed, or a shard renamed into place but cut short (a power loss before its data reached the disk); then resume
    on the same cache: no damaged shard is read (the short one is set aside, said in one line), no temp file is left,
    the missing rows are computed again, and the heads equal an uncached run's."""
    out, cache = ws / f"killed-{moment}", ws / f"cache-{moment}"
    nth = random.Random(seed).randint(2, 9)
    args = [str(ws / "base.yaml"), f"output_dir={out}", f"train.hidden_cache_dir={cache}", *STEPS]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KILLED_IN_A_FLUSH, moment, str(nth), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = [p.name for p in cache.glob(f".*{files.TEMP_MARK}*")]
    assert len(left) == (moment != "power-loss")  # what the kill left behind

    capsys.readouterr()
    result = train(config(ws, out.name, f"train.hidden_cache_dir={cache}", *STEPS))
    said = capsys.readouterr().out
    assert result.step == 12 and "resumed from" in said, said
    assert max_diff(ws / "ref", out) <= 1e-6
    assert not list(cache.glob(f".*{files.TEMP_MARK}*"))
    damaged = list(cache.glob("damaged-*"))
    assert len(damaged) == (moment == "power-loss")
    assert said.count("set aside as damaged-") == (moment == "power-loss")
    assert shards_readable(cache) >= 40  # every training row is cached again (~50 of them)


class FullDisk:
    """`disk_usage` for the cache's module: plenty of room until `fill()`, then `left` bytes."""

    def __init__(self) -> None:
        self.left: int | None = None

    def __call__(self, path):
        free = 2 ** 40 if self.left is None else self.left
        return collections.namedtuple("usage", "total used free")(2 ** 41, 2 ** 41 - free, free)


@pytest.mark.parametrize("how", ["the write fails", "no room before it"])
def test_a_cache_disk_that_fills_stops_the_caching_not_the_training(ws, monkeypatch, capsys, how):
    """The cache's disk fills in the middle of a run: torch.save's own failure (a RuntimeError of its zip writer, as
    a full disk gives it) or a flush that finds no room: one line says so, the training goes on without caching new
    rows, the shards written before are read, no temp file is left, and the heads equal an uncached run's. A write
    that fails while the disk has room is not taken for a full disk."""
    import medusa_train.target.states as states

    cache = ws / f"full-{how.replace(' ', '-')}"
    disk = FullDisk()
    monkeypatch.setattr(states, "disk_usage", disk)
    monkeypatch.setattr(states, "FLUSH_BYTES", 1)
    real_write, writes, written = states.Shard.write, [0], [0]

    def write(path, rows):
        writes[0] += 1
        if how == "the write fails" and writes[0] == 4:  # the disk fills in the middle of this write
            disk.left = 1000

            def half(tmp):
                Path(tmp).write_bytes(b"PK" * 50)
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 25600 vs 25496")

            files.atomic_write(path, half)
        real_write(path, rows)
        written[0] += len(rows)
        if writes[0] == 3 and how == "no room before it":  # the next flush finds the disk full
            disk.left = 1000

    monkeypatch.setattr(states.Shard, "write", staticmethod(write))
    capsys.readouterr()
    result = train(config(ws, cache.name + "-run", f"train.hidden_cache_dir={cache}", *STEPS))
    said = capsys.readouterr().out
    assert result.step == 12
    assert max_diff(ws / "ref", ws / (cache.name + "-run")) <= 1e-6
    warnings = [line for line in said.splitlines() if "cannot be written" in line]
    assert len(warnings) == 1 and "training goes on without caching" in warnings[0], said
    assert writes[0] == (4 if how == "the write fails" else 3)  # nothing tried after the disk filled
    assert shards_readable(cache) == written[0] >= 3 * 3  # the shards written before, each read whole
    assert not list(cache.glob(f".*{files.TEMP_MARK}*"))

    if how == "the write fails":  # a write that fails with room to spare is a bug to see, not a full disk
        disk.left, writes[0] = None, -100

        def broken(path, rows):
            files.atomic_write(path, lambda tmp: (_ for _ in ()).throw(RuntimeError("pickling failed")))

        monkeypatch.setattr(states.Shard, "write", staticmethod(broken))
        with pytest.raises(RuntimeError, match="pickling failed"):
            train(config(ws, "broken-run", f"train.hidden_cache_dir={ws / 'broken-cache'}", *STEPS))


def test_preflight_says_the_caches_size_and_refuses_one_its_disk_cannot_hold(ws, monkeypatch, capsys):
    import medusa_train.train.preflight as preflight

    cache = ws / "sized"
    train(config(ws, "sized-run", f"train.hidden_cache_dir={cache}", "train.max_steps=14", "eval.every=0"))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("hidden cache: about"))
    rows = [json.loads(x) for x in (ws / "sized-run" / "metrics.jsonl").read_text().splitlines()]
    tokens = next(r["data/tokens"] for r in rows if "data/tokens" in r)
    from transformers import AutoConfig

    per_token = AutoConfig.from_pretrained(ws / "model").hidden_size * 4 + 4  # h in float32, and the greedy token
    assert f"for {tokens:,} tokens ({per_token:,} bytes a token)" in line, line

    fake = FullDisk()
    reserve = preflight.checkpoint_bytes(config(ws, "x"), AutoConfig.from_pretrained(ws / "model"))
    fake.left = reserve + tokens * per_token // 2  # the checkpoints' room, and half the cache's
    monkeypatch.setattr(preflight, "disk_usage", fake)
    with pytest.raises(ConfigError, match=r"^train.hidden_cache_dir=.*needs about .*B for .* but its disk has .*B free"):
        train(config(ws, "too-small", f"train.hidden_cache_dir={ws / 'another'}", "train.max_steps=1"))
    # the same data's cache already on disk (a whole epoch of it) needs no more room
    train(config(ws, "sized-again", f"train.hidden_cache_dir={cache}", "train.max_steps=1", "eval.every=0"))


def changed_copy(src: Path, dst: Path, tensor: str | None = None, **config) -> Path:
    """A copy of the checkpoint `src` with one tensor scaled (the embedding and LM head untouched) or config keys set."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensor:
        weights = load_file(str(dst / "model.safetensors"))
        weights[tensor] = weights[tensor] * 1.01
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        data = json.loads((dst / "config.json").read_text()) | config
        (dst / "config.json").write_text(json.dumps(data, indent=4))
    return dst


def test_the_weights_digest_sees_any_tensor_and_the_config_not_the_place_or_the_formatting(ws, tmp_path):
    from medusa_train.target.weights import weights_digest

    model = ws / "model"
    same = changed_copy(model, tmp_path / "same")
    (same / "config.json").write_text(json.dumps(json.loads((same / "config.json").read_text()) | {
        "transformers_version": "0.0", "_name_or_path": "elsewhere"}, indent=1, sort_keys=True))
    assert weights_digest(same) == weights_digest(model) is not None  # another place, another formatting
    inner = changed_copy(model, tmp_path / "inner", "model.layers.0.mlp.down_proj.weight")
    rope = changed_copy(model, tmp_path / "rope", rope_theta=123.0)
    digests = {weights_digest(p) for p in (model, inner, rope)}
    assert len(digests) == 3
    assert weights_digest(tmp_path / "nowhere") is None


def test_a_target_whose_inner_layers_changed_is_not_served_the_old_cache(ws, tmp_path):
    """The cache of one target, and a copy of it whose inner MLP weight was scaled by 1% (a fine-tune, a merged LoRA:
    the embedding and LM head untouched, so their signatures match): refused in one line. The same checkpoint copied
    elsewhere reads the cache."""
    cache = tmp_path / "h"
    train(config(ws, "digest-a", f"train.hidden_cache_dir={cache}", "train.max_steps=2", "eval.every=0"))
    inner = changed_copy(ws / "model", tmp_path / "inner", "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ConfigError, match=r"^train.hidden_cache_dir=.*another target \(its weight files differ"):
        train(config(ws, "digest-b", f"target.model={inner}", f"train.hidden_cache_dir={cache}",
                     "train.max_steps=2", "eval.every=0"))
    moved = changed_copy(ws / "model", tmp_path / "moved")
    assert train(config(ws, "digest-c", f"target.model={moved}", f"train.hidden_cache_dir={cache}",
                        "train.max_steps=2", "eval.every=0")).step == 2
