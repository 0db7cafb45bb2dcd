"""The README's commands as users run them, under real launchers: `accelerate launch` and `torchrun`. What the
launcher returns is its own (1 whenever a process fails); the trainer's code is its last line and
`output_dir/exit_status.json`; an error is said once, not once per process; a launcher killed alone never leaves the
trainer running as an orphan; a run says how many processes it has."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import ROOT, torchrun_train, write_text_data


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("launch")
    save_tiny(root / "model", "llama")
    write_text_data(root / "text.jsonl")
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}}}\n"
        "heads: {num_heads: 2}\n"
        f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24, eval_size: 4}}\n"
        "train: {batch_size: 4, lr: 3.0e-3, warmup_steps: 2, log_every: 1, seed: 0}\n"
        "eval: {every: 0, max_batches: 1}\n")
    return root


def accelerate(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "accelerate"), "launch", "--cpu", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", *args]


ENV = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_bad_input_under_accelerate_launch(ws, tmp_path):
    """One `error:` line from the trainer, its code in its last line (the launcher itself returns 1)."""
    proc = subprocess.run(accelerate("--num_processes", "1", str(ROOT / "train.py"), str(ws / "base.yaml"),
                                     "train.lr=-1", f"output_dir={tmp_path / 'out'}"),
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: train.lr must be > 0, got -1.0"], proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "train.py: exit code 2 (bad input, nothing trained)"


def test_bad_input_under_torchrun_is_said_once(ws, tmp_path):
    proc = torchrun_train([str(ws / "base.yaml"), "train.lr=-1"], tmp_path / "out")
    assert proc.returncode != 0
    assert sum(line.startswith("error:") for line in proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stdout.count("train.py: exit code 2") == 1


def test_a_process_other_than_the_first_leaves_a_shared_error_to_the_first(ws, tmp_path, monkeypatch, capsys):
    """The launcher stops every process as soon as one exits: a process other than the first that exited at once on
    an error they all meet had the first killed before it said its line (CI saw it: no `error:` line at all). It waits
    for the launcher to end it (SIGTERM back to its default), and says the error only if the wait ends, naming itself:
    an error of its own, which the first never met. The first says it at once."""
    from medusa_train.train import cli

    waits, handlers = [], []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    monkeypatch.setattr(cli.signal, "signal", lambda sig, handler: handlers.append((sig, handler)))
    bad = [str(ws / "base.yaml"), "train.lr=-1", f"output_dir={tmp_path / 'out'}"]
    monkeypatch.setenv("RANK", "1")
    assert cli.main(bad) == 2
    assert waits == [cli.OTHERS_WAIT_S] and handlers == [(signal.SIGTERM, signal.SIG_DFL)]
    assert capsys.readouterr().err.splitlines() == ["error: (process 1) train.lr must be > 0, got -1.0"]
    monkeypatch.setenv("RANK", "0")
    waits.clear()
    assert cli.main(bad) == 2
    assert waits == [] and capsys.readouterr().err.splitlines() == ["error: train.lr must be > 0, got -1.0"]


def test_sigterm_to_the_launcher_alone_stops_the_trainer_with_a_checkpoint(ws, tmp_path):
    """The launcher gets SIGTERM and dies (143); the trainer, told by the kernel that its parent died, saves a
    checkpoint and stops with 75 instead of running on as an orphan; `resume: auto` then continues from it. Asked for
    2 processes, accelerate on CPUs starts one: said, and warned how to get two (the 2-process line of a torchrun run
    is asserted on the hidden-cache test's run)."""
    out = tmp_path / "out"
    launcher = subprocess.Popen(accelerate("--num_processes", "2", str(ROOT / "train.py"), str(ws / "base.yaml"),
                                           "train.max_steps=1000000", "train.save_every=0", f"output_dir={out}"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and "train/loss" in metrics.read_text()):  # the loop is running
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
        trainer = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        assert len(trainer) == 1
        launcher.send_signal(signal.SIGTERM)  # the launcher alone, as a scheduler that signals one PID does
        said, _ = launcher.communicate(timeout=30)
        assert launcher.returncode != 0
        assert "processes: 1 (NO, backend none, device cpu)" in said
        assert ("warning: accelerate launch was asked for 2 processes but started 1: on CPUs it starts several only "
                "through mpirun; use torchrun --nproc_per_node 2") in said
        deadline = time.monotonic() + 60
        while Path(f"/proc/{trainer[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{trainer[0]}").exists(), "the trainer runs on as an orphan"
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None
    assert json.loads((out / "exit_status.json").read_text())["code"] == 75
    assert list((out / "checkpoints").glob("step-*"))
    shutil.rmtree(out / "wandb", ignore_errors=True)


def test_two_processes_share_the_hidden_cache_so_the_second_epoch_runs_no_target(ws, tmp_path):
    """Under DDP the second epoch's shuffle hands each process rows the other one computed: with the cache (on disk in
    output_dir/hidden-cache, shared), that epoch reads every row from it and the target never runs; the heads equal a
    run without the cache (one process taking the same 4 rows a step as 2 x 2: the equal split is
    test_a_run_resumes_on_another_number_of_processes's). The run says its 2 processes."""
    from runs import max_diff, read_jsonl

    args = [str(ws / "base.yaml"), "train.epochs=2", "train.keep_best=last"]
    cached = torchrun_train([*args, "train.cache_hidden=true"], tmp_path / "cached", timeout=120)
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert "processes: 2 (MULTI_CPU, backend gloo, device cpu)" in cached.stdout
    assert f"hidden cache: on disk in {tmp_path / 'cached' / 'hidden-cache'}, where the 2 processes share" in \
        cached.stdout
    rows = [r for r in read_jsonl(tmp_path / "cached" / "metrics.jsonl") if "train/loss" in r]
    first = [r for r in rows if r["train/epoch"] == 0]
    assert first and len(rows) == 2 * len(first)
    computed = first[-1]["train/rows_from_target"]
    assert computed > 0 and first[-1]["train/rows_from_cache"] < computed  # epoch 1: (nearly) every row computed
    assert rows[-1]["train/rows_from_target"] == computed  # epoch 2: not one
    assert rows[-1]["train/rows_from_cache"] - first[-1]["train/rows_from_cache"] >= computed
    plain = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "train.batch_size=2", "train.grad_accum=2",
                            f"output_dir={tmp_path / 'plain'}"], capture_output=True, text=True, env=ENV, timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert max_diff(tmp_path / "cached", tmp_path / "plain") <= 1e-6


def test_fp16_mixed_precision_is_refused_before_the_model_loads(ws, tmp_path):
    """`--mixed_precision fp16`: the loss's gradients, computed in its forward, would underflow before the loss scaler
    scales them; refused in one line (exit 2) before the target loads, naming the launch flags that work."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--cpu", "--num_machines", "1",
           "--num_processes", "1", "--mixed_precision", "fp16", "--dynamo_backend", "no", str(ROOT / "train.py"),
           str(ws / "base.yaml"), f"output_dir={tmp_path / 'out'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: mixed precision fp16: ") and \
        "--mixed_precision bf16 (GPUs since Ampere) or no" in errors[0], proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "train.py: exit code 2 (bad input, nothing trained)"
    assert "Loading weights" not in proc.stderr  # refused before the target loads


@pytest.mark.parametrize("first, then, grouped", [(2, 1, "true"), (1, 2, "false")])
def test_a_run_resumes_on_another_number_of_processes(ws, tmp_path, first, then, grouped):
    """A job resized between a checkpoint and its resume, with each process's forward taking the rows one took before
    (2 processes at train.batch_size=4 <-> 1 process at batch_size 2 and grad_accum 2: the same 4 rows a step): the
    resumed run takes the rows the uninterrupted run would have taken, in the same order (shuffled, or grouped by
    length), and ends with its heads; it says it was resized. Resized with the recipe unchanged, it says how to keep
    the steps the same."""
    from runs import max_diff, read_jsonl

    split = {2: ["train.batch_size=4", "train.grad_accum=1"], 1: ["train.batch_size=2", "train.grad_accum=2"]}
    args = [str(ws / "base.yaml"), "train.max_steps=12", "train.save_every=6", "train.keep_best=last",
            f"data.group_by_length={grouped}"]

    def run(processes: int, out: Path, *more: str) -> subprocess.CompletedProcess:
        if processes == 2:
            return torchrun_train([*args, *split[2], *more], out, timeout=120)
        return subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *split[1], *more, f"output_dir={out}"],
                              capture_output=True, text=True, env=ENV, timeout=120)

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    done = run(first, whole)
    assert done.returncode == 0, done.stderr[-3000:]
    # one process group (not independent runs): each process saved its own random state
    assert sorted(p.name for p in (whole / "checkpoints" / "step-6").glob("random_states_*")) == \
        [f"random_states_{i}.pkl" for i in range(first)]
    shutil.copytree(whole / "checkpoints" / "step-6", resumed / "checkpoints" / "step-6")
    again = run(then, resumed)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"resume: the checkpoint was written by {first} process{'es' if first > 1 else ''}, this run has {then}: "
            "the same rows a step, in the same order, split as before") in again.stdout
    steps = {r["step"]: r for r in read_jsonl(resumed / "metrics.jsonl") if "train/loss" in r}
    assert list(steps) == list(range(7, 13))
    assert max_diff(whole, resumed) <= 1e-6
    for r in read_jsonl(whole / "metrics.jsonl"):  # the same steps: the same loss and tokens, however split
        if r.get("step", 0) > 6 and "train/loss" in r:
            assert r["train/loss"] == pytest.approx(steps[r["step"]]["train/loss"], rel=1e-4)
            assert r["train/tokens"] == steps[r["step"]]["train/tokens"]
    if first == 2:  # the recipe unchanged on 1 process: allowed, and told how to keep the very same steps
        plain = tmp_path / "plain"
        shutil.copytree(whole / "checkpoints" / "step-6", plain / "checkpoints" / "step-6")
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *split[2], f"output_dir={plain}"],
                              capture_output=True, text=True, env=ENV, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "each forward now taking 4 rows instead of 2 (a step weighs every supervised position alike" in \
            proc.stdout
        assert max_diff(whole, plain) <= 1e-5  # split otherwise, the same steps: a token weighs what it did

        def tokens(d: Path) -> list[int]:  # the real tokens each step took: which rows it took, when lengths differ
            rows = [r for r in read_jsonl(d / "metrics.jsonl") if "train/loss" in r]
            return [b["train/tokens"] - a["train/tokens"] for a, b in zip(rows, rows[1:])][-5:]
        assert tokens(plain) == tokens(whole) and len(set(tokens(whole))) > 1  # the same rows a step, in order

def test_processes_that_do_not_share_output_dir_are_refused_in_one_line(tmp_path, monkeypatch):
    """Two processes (threads here, with a barrier for the collectives): one output_dir seen by both passes; a
    process whose output_dir is a disk of its own is named, on every process, before anything loads."""
    import threading

    import accelerate.utils
    import torch

    from medusa_train.config import ConfigError
    from medusa_train.train.processes import check_output_dir_shared

    barrier, shared = threading.Barrier(2), {}

    class Process:
        num_processes, device = 2, torch.device("cpu")

        def __init__(self, rank: int) -> None:
            self.rank, self.is_main_process = rank, rank == 0

        def wait_for_everyone(self) -> None:
            barrier.wait()

        def gather(self, t):
            shared[self.rank] = t
            barrier.wait()
            out = torch.cat([shared[0], shared[1]])
            barrier.wait()
            return out

    def broadcast(objects):
        if threading.current_thread().name == "rank0":
            shared["token"] = list(objects)
        barrier.wait()
        objects[:] = shared["token"]
        return objects

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)

    def both(dirs):
        errors = {}

        def one(rank):
            try:
                check_output_dir_shared(Process(rank), dirs[rank])
            except ConfigError as e:
                errors[rank] = str(e)
        threads = [threading.Thread(target=one, args=(r,), name=f"rank{r}") for r in (0, 1)]
        [t.start() for t in threads]
        [t.join(timeout=30) for t in threads]
        return errors

    assert both([tmp_path / "out", tmp_path / "out"]) == {}
    assert not list((tmp_path / "out").glob(".shared-*"))  # the marker is removed
    errors = both([tmp_path / "out", tmp_path / "own-disk"])
    assert set(errors) == {0, 1} and errors[0].startswith(f"output_dir={tmp_path / 'out'}: process 1 cannot see")


def test_real_tau_keeps_every_process_at_work_none_waits_past_the_timeout(ws, tmp_path):
    """eval.tau_every under 2 processes with a 6-second process-group timeout (train.process_timeout_minutes=0.1),
    the real tau's generation ~20 s of one core's work: each process generates on its share of the prompts, so none
    waits in a collective for longer than the timeout (while the main process generated alone, the other timed out in
    its barrier), and every process logs the same tau."""
    from runs import read_jsonl

    data = tmp_path / "more.jsonl"
    write_text_data(data, documents=40)  # held out: 12 documents, ~65 rows
    out = tmp_path / "out"
    proc = torchrun_train([str(ws / "base.yaml"), f"data.dataset={data}", "data.eval_size=12", "train.max_steps=1",
                           "eval.tau_every=1", "eval.tau_num_prompts=48", "eval.tau_max_new_tokens=200",
                           "train.process_timeout_minutes=0.1"], out, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    taus = [r["eval/tau"] for r in read_jsonl(out / "metrics.jsonl") if "eval/tau" in r]
    assert len(taus) == 1 and taus[0] > 1.0
