"""What a step may cost: the target's verify timings, the tree budget they imply, and the CPU-versus-GPU choices.

`Platform.for_device` decides once, when a generator is built, how the engine behaves where it runs; the
generator hands the decision down (to the drafters through `DraftContext.host_reads`) instead of every module
testing the device. `verify_seconds` times the target's forward over 1..L tree rows after a prefix, once per
target (generators on one target share it, so they choose from the same numbers); `verify_costs` interpolates
them to every row count; `best_budget` picks the draft-node budget with the most expected tokens per second
of verify.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform as host
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from inference.engine.kv import crop_cache, new_cache
from inference.engine.tree import tree_from_parents
from inference.engine.verify import target_forward, verify_tree

# every length up to 16 on a CPU: the cost is a staircase there (MKL: 69 ms for 8 tokens, 80 for 10)
LENGTHS_CPU = tuple(range(1, 17)) + (24, 32)
LENGTHS_GPU = (1, 2, 4, 8, 16, 32, 64, 96)
PREFIX = 128  # prefix length the verify timings are taken at
# target -> {rows: seconds}: separate measurements differ by machine noise, so generators share one
_VERIFY_SECONDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TIMING_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its key in the timings file


@dataclass(frozen=True)
class Platform:
    """The engine's device-dependent choices, made once.

    host_trim: with the auto budget, each step keeps only the drafted nodes worth their verify rows
        (`inference.engine.calibrate`): on a CPU every row costs time, and reading how many to keep is a host read
        that a CPU makes for free; on a GPU rows are nearly free up to tens and the read would be a sync.
    host_reads: drafters may read the tree on the host (HybridDrafter merges the lookup's branch into the
        heads' nodes); on a GPU they append it as is and the step keeps its single sync.
    lengths: the row counts the verify timings are taken at.
    """

    device: torch.device
    host_trim: bool
    host_reads: bool
    lengths: tuple[int, ...]

    @classmethod
    def for_device(cls, device: torch.device | str) -> Platform:
        device = torch.device(device)
        cpu = device.type == "cpu"
        return cls(device, host_trim=cpu, host_reads=cpu, lengths=LENGTHS_CPU if cpu else LENGTHS_GPU)

    def sync(self) -> None:
        """Wait for the device's queued work (timing on CUDA); nothing on a CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def verify_seconds(target: nn.Module, platform: Platform, limit: int | None = None, static=None) -> dict[int, float]:
    """Seconds per target forward over n tree rows after a `PREFIX`-token prefix, n in `platform.lengths`,
    measured once per target (the least disturbed of 5 runs, round-robin over lengths so a burst of noise hits
    them all alike) and shared; `forget_verify_seconds` measures again. `limit`: the target's context.
    `static`: a `StaticVerifier` (a compiled generator's): its compiled verify is timed instead, at the row
    counts it runs (`inference.engine.compiled.BUCKETS`) up to the longest of `platform.lengths`, and kept with it."""
    owner = static if static is not None else target
    times = _VERIFY_SECONDS.get(owner)
    if times is not None:
        return times
    key = verify_key(target, platform, limit, static)
    times = _verify_entry(key)
    if times is not None:
        _VERIFY_SECONDS[owner] = times
        return times
    print(f"timing the target's verify forward once for this model shape, dtype and machine ({len(platform.lengths)} "
          f"tree sizes; kept in {timings_file()}; a fixed tree_budget / --tree-budget N skips it)", file=sys.stderr,
          flush=True)
    lengths = platform.lengths
    if static is not None:
        from inference.engine.compiled import BUCKETS

        lengths = tuple(b for b in BUCKETS if b <= max(lengths))
    vocab = target.get_output_embeddings().weight.shape[0]
    prefix_len = max(1, min(PREFIX, (limit or 1 << 30) - max(lengths)))
    ids = (torch.arange(prefix_len + max(lengths), device=platform.device) * 31 + 7) % vocab
    trees = {n: _chain(ids[prefix_len:prefix_len + n]) for n in lengths}
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    with torch.inference_mode():
        if static is not None:
            static.reserve(prefix_len + max(lengths))
            static.prefill(ids[None, :prefix_len])
            verify = lambda tree: static.verify(tree, prefix_len)  # noqa: E731
            rewind = lambda: crop_cache(static.cache, prefix_len)  # noqa: E731
        else:
            cache = new_cache()
            target_forward(target, ids[None, :prefix_len], cache)
            verify = lambda tree: verify_tree(target, cache, tree)  # noqa: E731
            rewind = lambda: crop_cache(cache, prefix_len)  # noqa: E731
        for rep in range(6):
            for n in lengths:
                platform.sync()
                t0 = time.perf_counter()
                verify(trees[n])
                platform.sync()
                if rep > 0:  # the first round warms up (and compiles)
                    samples[n].append(time.perf_counter() - t0)
                rewind()
    times = {n: min(samples[n]) for n in lengths}
    running = 0.0
    for n in lengths:  # a longer forward never costs less; smooth out noise that says otherwise
        running = times[n] = max(times[n], running)
    _VERIFY_SECONDS[owner] = times
    write_timings(key, {str(n): t for n, t in times.items()})
    return times


def timings_file() -> Path | None:
    """Where verify timings are kept between processes: `$MEDUSA_TRAIN_TIMINGS` (`off`: nowhere), else
    `timings.json` in the project's cache (`$MEDUSA_TRAIN_CACHE` or ~/.cache/medusa-train)."""
    where = os.environ.get("MEDUSA_TRAIN_TIMINGS")
    if where == "off":
        return None
    if where:
        return Path(os.path.expanduser(where))
    from medusa_train.base.files import cache_root

    return cache_root() / "timings.json"


def verify_key(target: nn.Module, platform: Platform, limit: int | None, static=None) -> str:
    """The key of `target`'s verify timings in the timings file (computed once per target or StaticVerifier)."""
    owner = static if static is not None else target
    key = _TIMING_KEYS.get(owner)
    if key is None:
        key = _TIMING_KEYS[owner] = timing_key(target, platform, limit, static)
    return key


def timing_key(target: nn.Module, platform: Platform, limit: int | None, static=None) -> str:
    """What a verify's time depends on: the model's shape (its config, not its weights), dtype, device and kernels,
    the compiled path, the row counts timed, and the machine (processor, threads, torch). Any change: a new key."""
    from inference.engine.kernels import uses_onednn_linear

    config = target.config.to_dict()
    config.pop("_name_or_path", None)
    weight = target.get_output_embeddings().weight
    if weight.device.type == "cuda":
        where = torch.cuda.get_device_name(weight.device)
    else:
        where = host.processor() or host.machine()
        try:
            with open("/proc/cpuinfo") as f:
                where = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    parts = {"config": config, "dtype": str(weight.dtype), "device": weight.device.type, "where": where,
             "threads": torch.get_num_threads(), "torch": torch.__version__, "onednn": uses_onednn_linear(target),
             "static": None if static is None else type(static).__name__, "lengths": list(platform.lengths),
             "limit": limit, "prefix": PREFIX}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def read_timings(key: str):
    """The value kept under `key` in the timings file, or None (none kept, or the file is missing or damaged: the
    caller measures again)."""
    path = timings_file()
    try:
        return json.loads(path.read_text()).get(key) if path is not None else None
    except (OSError, ValueError, AttributeError):
        return None


def write_timings(key: str, value) -> None:
    """Keep `value` (JSON; None: drop the key) under `key` in the timings file, atomically, other keys kept."""
    from medusa_train.base.files import atomic_write_text

    path = timings_file()
    if path is None:
        return
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    if value is None:
        data.pop(key, None)
    else:
        data[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    except OSError:  # a read-only cache costs a timing per process, nothing more
        pass


def _verify_entry(key: str) -> dict[int, float] | None:
    entry = read_timings(key)
    try:
        return {int(n): float(t) for n, t in entry.items()} if entry else None
    except (AttributeError, TypeError, ValueError):
        return None


def drafter_key(verify_key: str, drafter) -> str:
    """What drafting time depends on beyond the verify key: the drafter's kind and settings and, for heads, their
    shape (their spec without the target's fingerprint; weights do not change the time)."""
    import dataclasses

    def describe(obj, depth: int = 0) -> dict:
        out: dict = {"class": type(obj).__name__}
        for name, value in vars(obj).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (bool, int, float, str)):
                out[name] = value
            elif dataclasses.is_dataclass(getattr(value, "spec", None)):
                out[name] = {k: v for k, v in dataclasses.asdict(value.spec).items()
                             if k not in ("target_fingerprint", "target_name")}
            elif depth < 2 and hasattr(value, "draft") and hasattr(value, "max_depth"):
                out[name] = describe(value, depth + 1)
        return out

    parts = {"verify": verify_key, "drafter": describe(drafter)}
    return "draft-" + hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _chain(tokens: torch.Tensor):
    n = tokens.shape[0]
    idx = torch.arange(n, device=tokens.device)
    return tree_from_parents(tokens, (idx - 1).clamp_min(0), idx, n - 1)


# steps count towards drift only while the prefix is near the one the timing used: a verify after a long prompt
# costs more for its attention alone, which a new timing (at PREFIX) would not cure
DRIFT_PREFIX = 2 * PREFIX
_RETIMED: weakref.WeakSet = weakref.WeakSet()  # targets (or StaticVerifiers) already timed again for drift


def may_retime(owner) -> bool:
    """True the first time drift asks to time `owner` again (and never after): generators sharing a target share
    its timings, so one re-timing serves them all, and a drift it did not cure must not cost one per call."""
    if owner in _RETIMED:
        return False
    _RETIMED.add(owner)
    return True


class Drift:
    """Observed verify seconds against the timed cost of the same row count, over the last `window` CPU steps. The
    timing is taken once (and kept across runs): if the machine has changed since (another job started or ended,
    another power state), the budget chosen from it is wrong, and `drifted` says so: the median ratio of the last
    `window` steps beyond `factor` either way. A burst of noise moves the median of a full window little."""

    def __init__(self, window: int = 32, factor: float = 1.5) -> None:
        self.window, self.factor = window, factor
        self.ratios: list[float] = []

    def observe(self, seconds: float, predicted: float) -> None:
        if predicted > 0:
            self.ratios.append(seconds / predicted)
            del self.ratios[:-self.window]

    def ratio(self) -> float:
        ordered = sorted(self.ratios)
        return ordered[len(ordered) // 2] if ordered else 1.0

    def drifted(self) -> float | None:
        """The median ratio when it has drifted (and start counting afresh), else None."""
        if len(self.ratios) < self.window:
            return None
        r = self.ratio()
        if r > self.factor or r < 1 / self.factor:
            self.ratios.clear()
            return r
        return None


def forget_verify_seconds(target: nn.Module) -> None:
    """Drop the timings of `target` (or a StaticVerifier), here and in the timings file: the next use measures."""
    _VERIFY_SECONDS.pop(target, None)
    key = _TIMING_KEYS.pop(target, None)
    if key is not None:
        write_timings(key, None)


def verify_costs(times: dict[int, float], padded: bool = False) -> list[float]:
    """costs[n]: seconds of a verify over n rows, n = 0..the longest timed (costs[0] = 0), linear between the
    timed lengths; `padded` (a compiled verify, which runs n rows at the next timed count): that count's time."""
    lengths = sorted(times)
    costs = [0.0]
    for n in range(1, max(lengths) + 1):
        hi = next(length for length in lengths if length >= n)
        lo = max(length for length in lengths if length <= n)
        if padded or hi == lo:
            costs.append(times[hi])
        else:
            costs.append(times[lo] + (times[hi] - times[lo]) * (n - lo) / (hi - lo))
    return costs


def draft_seconds(drafter, ctx_for_budget, budgets: Sequence[int], platform: Platform) -> list[float]:
    """draft[b]: seconds the drafter takes to draft a tree of b nodes, b = 0..max(budgets): the least of 5 timed
    runs at each of `budgets` (0 included; after a warm-up round), linear in between. `ctx_for_budget(b)` gives
    the `DraftContext` to draft from (a real step's, the drafter's history observed)."""
    budgets = sorted(set(budgets) | {0})
    samples: dict[int, list[float]] = {b: [] for b in budgets}
    with torch.inference_mode():
        for rep in range(6):
            for b in budgets:
                ctx = ctx_for_budget(b)
                platform.sync()
                t0 = time.perf_counter()
                drafter.draft(ctx)
                platform.sync()
                if rep > 0:
                    samples[b].append(time.perf_counter() - t0)
    # verify_costs' interpolation, shifted by one: its index n holds budget n - 1
    return verify_costs({b + 1: min(samples[b]) for b in budgets})[1:]


def best_budget(expected_tau: Sequence[float], costs: Sequence[float], draft: Sequence[float] | None = None) -> int:
    """The draft-node budget b maximising expected tokens per second of a step: expected tau over the verify of
    b + 1 rows plus, when given, drafting b nodes (`draft[b]`)."""
    best, best_rate = 0, 0.0
    for budget in range(0, len(costs) - 1):
        seconds = costs[budget + 1] + (draft[min(budget, len(draft) - 1)] if draft else 0.0)
        rate = expected_tau[budget] / seconds
        if rate > best_rate:
            best, best_rate = budget, rate
    return best
