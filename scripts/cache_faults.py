"""The hidden-state cache under real faults, where the test suite injects them: a disk that fills in the middle of a
run (an 8 MB tmpfs, filled by another writer once training has started: needs root to mount), and `kill -9` of
`train.py` at random moments, resumed each time. Each ends with heads equal to an uncached run's, no temp file left,
every shard readable.

    sudo python scripts/cache_faults.py --kills 10      # prints one line a fault, then a summary

A tiny random Llama and ~1,100 rows of 24 tokens (every row a shard's worth of states at each epoch's end).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
ENV = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
STEPS = ["train.max_steps=120", "train.save_every=5", "train.log_every=1", "eval.every=0", "train.keep_best=last"]


def train(tmp: Path, out: Path, *more: str, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), str(tmp / "recipe.yaml"), f"output_dir={out}", *STEPS, *more]
    if wait:
        return subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_cache(cache: Path) -> str:
    from medusa_train.base.files import TEMP_MARK
    from medusa_train.target.states import SHARD_GLOB, Shard

    rows = sum(len(Shard(p).slots) for p in cache.glob(SHARD_GLOB))  # a damaged shard raises
    temps = list(cache.glob(f".*{TEMP_MARK}*"))
    return f"{rows} rows in {len(list(cache.glob(SHARD_GLOB)))} shards, {len(temps)} temp files"


def full_disk(tmp: Path) -> dict:
    """The cache on an 8 MB tmpfs; once training says the cache's size, a filler takes all but 64 KiB of it."""
    from runs import max_diff

    mount = tmp / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=True)
    try:
        proc = train(tmp, tmp / "full", f"train.hidden_cache_dir={mount / 'cache'}", wait=False)
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("hidden cache: about"):
                free = shutil.disk_usage(mount).free
                (mount / "filler").write_bytes(b"\0" * (free - 64 * 1024))
        proc.wait()
        said = [x for x in lines if "cannot be written" in x]
        result = {"exit": proc.returncode, "warnings": said, "cache": check_cache(mount / "cache"),
                  "max_diff_to_uncached": max_diff(tmp / "ref", tmp / "full") if proc.returncode == 0 else None,
                  "a_shard_write_on_the_full_disk": shard_write_error(mount)}
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    return result


def shard_write_error(mount: Path) -> str:
    """What a shard write raises on the full disk (the flush takes OSError and RuntimeError for a full disk), and
    whether its temp file is gone."""
    import torch

    from medusa_train.base.files import TEMP_MARK
    from medusa_train.target.states import Shard

    try:
        Shard.write(mount / "cache" / "shard-x.pt", [(b"k" * 20, torch.zeros(4096, 64), None)])
        return "no error"
    except (OSError, RuntimeError) as e:
        left = list((mount / "cache").glob(f".*{TEMP_MARK}*"))
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}; {len(left)} temp files left"


def logged(metrics: Path) -> int:
    """The last step metrics.jsonl logged."""
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            steps.append(json.loads(line).get("step", 0) if "train/loss" in line else 0)
        except ValueError:  # a line being written
            continue
    return max(steps, default=0)


def kills(tmp: Path, n: int, seed: int) -> dict:
    """`n` kill -9s of train.py at random moments (1-30 steps past where the last one got, plus up to 0.3 s: in a
    step, a checkpoint, the epoch's end and its flush, the run's end), each resumed, then a run to the end."""
    from runs import max_diff

    rng = random.Random(seed)
    cache, out = tmp / "kill-cache", tmp / "killed"
    moments = []
    for _ in range(n):
        metrics = out / "metrics.jsonl"
        reached = logged(metrics) if metrics.is_file() else 0
        step, extra = min(119, reached + rng.randint(1, 30)), rng.uniform(0.0, 0.3)
        proc = train(tmp, out, f"train.hidden_cache_dir={cache}", wait=False)
        while proc.poll() is None and not (metrics.is_file() and logged(metrics) >= step):
            time.sleep(0.01)
        time.sleep(extra)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        moments.append({"after_step": step, "plus_s": round(extra, 2), "killed": proc.returncode == -signal.SIGKILL})
    done = train(tmp, out, f"train.hidden_cache_dir={cache}")
    return {"kills": moments, "exit": done.returncode, "cache": check_cache(cache),
            "max_diff_to_uncached": max_diff(tmp / "ref", out) if done.returncode == 0 else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("scripts/cache_faults.py mounts a small tmpfs: run it as root (sudo)", file=sys.stderr)
        return 2
    from runs import write_text_data
    from tiny import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_tiny(tmp / "model", "llama")
        write_text_data(tmp / "text.jsonl", documents=200)
        (tmp / "recipe.yaml").write_text(
            f"target: {{model: {tmp / 'model'}}}\nheads: {{num_heads: 2}}\n"
            f"data: {{dataset: {tmp / 'text.jsonl'}, format: text, max_length: 24, eval_size: 0}}\n"
            "train: {batch_size: 16, lr: 3.0e-3, seed: 0}\n")
        ref = train(tmp, tmp / "ref")
        if ref.returncode != 0:
            print(ref.stderr[-3000:], file=sys.stderr)
            return 1
        results = {"full_disk": full_disk(tmp), "kills": kills(tmp, args.kills, args.seed)}
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    ok = all(r["exit"] == 0 and r["max_diff_to_uncached"] is not None and r["max_diff_to_uncached"] <= 1e-5
             for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
