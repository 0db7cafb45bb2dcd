"""What the training tests share: a small plain-text dataset, and `train.py` under torchrun with two CPU processes."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and then it ran to see the dog who was very happy about it".split()


def max_diff(a: Path, b: Path) -> float:
    """The largest difference between two heads directories' weights (the same tensors in both)."""
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa if wa[k].numel())


def config(ws: Path, out: str, *overrides: str):
    """The workspace's `base.yaml` with `output_dir=ws/out` and the overrides, for one process."""
    from medusa_train.config import load_config

    return load_config(ws / "base.yaml", [f"output_dir={ws / out}", *overrides], world_size=1)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_text_data(path: Path, seed: int = 0, documents: int = 10, words: int = 40) -> None:
    """`documents` JSONL rows of `words` random words each (10 x 40 give ~55 rows of 24 tokens)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")


def torchrun_train(args: list[str], out: Path, timeout: int = 50) -> subprocess.CompletedProcess:
    """`train.py ARGS output_dir=OUT` under torchrun, 2 CPU processes (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "train.py"), *args, f"output_dir={out}"]
    return launch_twice(cmd, out, timeout)


def launch_twice(cmd: list[str], out: Path, timeout: int) -> subprocess.CompletedProcess:
    """A multi-process launch (torchrun, accelerate launch) with 1 thread a process. Their rendezvous has hung once in
    many runs, so a hung attempt's process group is killed and it is tried once more (OUT removed first, unless it
    was there before: a resumed run's checkpoint); a second hang fails the test."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    fresh = not out.exists()
    for attempt in range(2):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            if fresh:
                shutil.rmtree(out, ignore_errors=True)
    raise AssertionError(f"two attempts hung:\n{stderr[-2000:]}")
