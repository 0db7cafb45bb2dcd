"""The frozen target sharded across processes (FSDP2, recipes/accelerate/fsdp2.yaml), launched as users launch it:
`accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 2 train.py RECIPE`, here on 2 CPU
processes (gloo). Each process holds half of every decoder layer; the heads equal a 1-process run's; a run stopped at
a checkpoint and resumed ends where the uninterrupted run ends; the hidden-state cache keeps the processes in step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from runs import ROOT, launch_twice, read_jsonl, write_text_data
from safetensors.torch import load_file

ENV = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
pytestmark = pytest.mark.timeout(300)  # a launch may be tried twice (fsdp2)
# 40 rows of <= 24 tokens, 2 per process per step: 10 steps an epoch; 14 steps reach into the second epoch, whose
# shuffle hands each process rows that only the other one has cached
COMMON = ["train.max_steps=14", "train.save_every=7", "data.eval_size=4", "eval.every=0", "train.keep_best=last"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("fsdp")
    save_tiny(root / "model", "llama")
    write_text_data(root / "text.jsonl")
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}}}\n"
        "heads: {num_heads: 2}\n"
        f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24}}\n"
        "train: {lr: 3.0e-3, warmup_steps: 2, log_every: 1, seed: 0}\n"
        "eval: {max_batches: 1}\n")
    return root


def fsdp2(ws: Path, out: Path, *args: str, timeout: int = 90) -> subprocess.CompletedProcess:
    """The documented launch, on 2 CPU processes; a hang (a process left waiting in a collective) fails the test."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(ROOT / "recipes" / "accelerate" / "fsdp2.yaml"), "--num_processes", "2", "--mixed_precision", "no",
           "--dynamo_backend", "no", str(ROOT / "train.py"), str(ws / "base.yaml"), "train.batch_size=4", *args,
           f"output_dir={out}"]
    return launch_twice(cmd, out, timeout)


def one_process(ws: Path, out: Path, *args: str) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), str(ws / "base.yaml"), "train.batch_size=2", "train.grad_accum=2",
           *args, f"output_dir={out}"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def max_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa if wa[k].numel())


@pytest.fixture(scope="module")
def sharded(ws):
    """chained heads, 14 steps, checkpoints at 7 and 14, the hidden-state cache on, the target sharded."""
    out = ws / "sharded"
    proc = fsdp2(ws, out, *COMMON, "train.cache_hidden=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_each_process_holds_half_of_every_decoder_layer(sharded):
    out, proc = sharded
    assert "processes: 2 (MULTI_CPU, backend gloo" in proc.stdout
    row = next(r for r in read_jsonl(out / "metrics.jsonl") if "target/bytes_whole" in r)
    assert row["target/bytes_processes"] == 2
    assert row["target/bytes_layers_here"] * 2 == pytest.approx(row["target/bytes_layers_whole"], rel=0.02)
    # the embedding, final norm and LM head stay whole: the process holds the whole less half of the layers
    assert row["target/bytes_here"] == pytest.approx(
        row["target/bytes_whole"] - row["target/bytes_layers_whole"] + row["target/bytes_layers_here"], rel=1e-6)
    assert "target sharded over 2 processes (FSDP2, one unit per decoder layer)" in proc.stdout


def test_sharded_target_trains_the_heads_a_single_process_trains(ws, sharded):
    out, _ = sharded
    one = ws / "one-chained"
    one_process(ws, one, *COMMON)
    assert max_diff(one, out) <= 1e-5
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 15))
    final = load_file(str(out / "model.safetensors"))  # heads only, loadable by the engine
    assert final and all(not k.startswith(("model.", "lm_head")) for k in final)


def test_eagle3_heads_read_the_sharded_layers(ws):
    """eagle3 reads three of the target's layers through hooks on the (now FSDP) decoder layers."""
    args = ["train.max_steps=4", "data.eval_size=0", "eval.every=0", "heads.kind=eagle3", "heads.num_heads=2"]
    out, one = ws / "sharded-eagle3", ws / "one-eagle3"
    proc = fsdp2(ws, out, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one_process(ws, one, *args)
    assert max_diff(one, out) <= 1e-5


def test_resume_under_fsdp2_ends_where_the_uninterrupted_run_ends(ws, sharded):
    out, _ = sharded
    resumed = ws / "sharded-resumed"
    shutil.copytree(out / "checkpoints" / "step-7", resumed / "checkpoints" / "step-7")
    proc = fsdp2(ws, resumed, *COMMON, "train.cache_hidden=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume" in proc.stdout and "step 7" in proc.stdout
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl") if "train/loss" in r] == list(range(8, 15))
    assert max_diff(out, resumed) <= 1e-6


def test_what_a_sharded_target_cannot_run_is_refused_in_one_line(ws, tmp_path):
    proc = fsdp2(ws, tmp_path / "tau", "train.max_steps=2", "eval.tau_every=1", "data.eval_size=4")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "eval.tau_every generates on the main process alone" in errors[0], proc.stderr
    assert "set eval.tau_every=0" in errors[0]
    assert proc.stdout.strip().splitlines()[-1] == "train.py: exit code 2 (bad input, nothing trained)"
    assert not json.loads((tmp_path / "tau" / "exit_status.json").read_text())["code"] == 0


@pytest.mark.parametrize("override, says", [
    ("target.lora.r=8", "target.lora trains the target's adapters"),
    ("target.forward_dtype=bfloat16", "keeps a second whole copy of the target"),
    ("eval.tau_every=5", "set eval.tau_every=0"),
])
def test_each_refusal_names_its_key_and_the_fix(ws, override, says):
    from medusa_train.config import ConfigError
    from medusa_train.sharding import check_shardable
    from runs import config

    check_shardable(config(ws, "ok", "data.eval_size=4"), world_size=2)  # the base recipe is fine
    with pytest.raises(ConfigError, match=says):
        check_shardable(config(ws, "bad", "data.eval_size=4", override), world_size=2)
    with pytest.raises(ConfigError, match="with one process: launch with --num_processes 2"):
        check_shardable(config(ws, "one", "data.eval_size=4"), world_size=1)
