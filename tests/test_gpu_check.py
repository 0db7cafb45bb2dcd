"""scripts/gpu_check.py, the one command a session with a GPU runs first, runs here on its CPU path: the engine's
greedy output checked against `generate` for every registered kind and both trees (float64 must match, exit 0), the
JSON it writes, and a clear refusal where there is no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_its_exactness_part_on_a_cpu(tmp_path):
    from medusa_train.kinds import KINDS

    out = tmp_path / "gc"
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--parts", "exact",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "gpu-check.json").read_text())
    strict = [r for r in report["exact"] if r["dtype"] == "float64"]
    assert {(r["kind"], r["tree"]) for r in strict} == {(k, t) for k in KINDS for t in ("static", "dynamic")}
    assert all(r["all_exact"] for r in strict)
    assert "greedy output of the engine against generate" in done.stdout


def test_the_gpu_check_says_so_when_there_is_no_gpu(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cuda", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env={"CUDA_VISIBLE_DEVICES": "",
                                                                                      "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: no CUDA device")


def test_the_gpu_check_launches_training_as_users_do(tmp_path):
    """Part 3: `accelerate launch ... train.py RECIPE` for 4 steps: exit 0, every step logged, heads written."""
    out = tmp_path / "gc"
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--parts", "launch",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    launch = json.loads((out / "gpu-check.json").read_text())["launch"]
    assert launch["launched"] and launch["exit_code"] == 0, launch
    assert launch["steps_logged"] == [1, 2, 3, 4] and launch["heads_written"] and launch["peak_gib"] > 0
    assert "3. accelerate launch train.py, 4 steps" in done.stdout


def test_a_subprocess_that_hangs_is_a_result_not_a_lost_report():
    """Each subprocess of the check (the launch, each oracle run) has a timeout: past it, rc 124 and a line saying so,
    and the check goes on to write its report."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check import run_for

    done = run_for([sys.executable, "-c", "import time; time.sleep(30)"], 1)
    assert (done.returncode, done.stderr) == (124, "timed out after 1 s")
    assert run_for([sys.executable, "-c", "print('ok')"], 30).stdout == "ok\n"
