"""The frozen target sharded across processes, launched as users launch it: `accelerate launch --config_file
recipes/accelerate/fsdp2.yaml --num_processes 2 train.py RECIPE` (FSDP2) or `.../deepspeed_zero3.yaml` (DeepSpeed
ZeRO-3), here on 2 CPU processes (gloo). Each process holds half of every decoder layer; the heads equal a 1-process
run's; a run stopped at a checkpoint and resumed ends where the uninterrupted run ends; the hidden-state cache keeps the
processes in step; ZeRO-3's CPU offload runs a target on one process; what either cannot run is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from runs import ROOT, launch_twice, max_diff, read_jsonl, write_text_data
from safetensors.torch import load_file

ENV = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
pytestmark = pytest.mark.timeout(300)  # a launch may be tried twice
# 40 rows of <= 24 tokens, 2 per process per step: 10 steps an epoch; 14 steps reach into the second epoch, whose
# shuffle hands each process rows that only the other one has cached
COMMON = ["train.max_steps=14", "train.save_every=7", "data.eval_size=4", "eval.every=0", "train.keep_best=last"]
LAUNCHERS = {"fsdp2": "FSDP2", "deepspeed_zero3": "DeepSpeed ZeRO-3"}


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


def launch(ws: Path, out: Path, *args: str, config: str = "fsdp2", processes: int = 2, flags: tuple = (),
           timeout: int = 90) -> subprocess.CompletedProcess:
    """The documented launch with recipes/accelerate/CONFIG.yaml, on CPU processes; a hang (a process left waiting in
    a collective) fails the test."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(ROOT / "recipes" / "accelerate" / f"{config}.yaml"), "--num_processes", str(processes),
           "--mixed_precision", "no", "--dynamo_backend", "no", *flags, str(ROOT / "train.py"), str(ws / "base.yaml"),
           # 4 rows a step, as one_process takes them: 2 a process, or 2 twice on one process
           "train.batch_size=4" if processes == 2 else "train.batch_size=2", f"train.grad_accum={3 - processes}", *args,
           f"output_dir={out}"]
    return launch_twice(cmd, out, timeout)


def one_process(ws: Path, out: Path, *args: str) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), str(ws / "base.yaml"), "train.batch_size=2", "train.grad_accum=2",
           *args, f"output_dir={out}"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def binary_checkpoint(ws: Path) -> Path:
    """The tiny target saved as a pytorch_model.bin (no safetensors to read a share of)."""
    import torch
    from transformers import AutoModelForCausalLM

    binary = ws / "model-bin"
    if not binary.exists():
        shutil.copytree(ws / "model", binary, ignore=shutil.ignore_patterns("*.safetensors"))
        torch.save(AutoModelForCausalLM.from_pretrained(ws / "model").state_dict(), binary / "pytorch_model.bin")
    return binary


def target_of(ws: Path, config: str) -> list[str]:
    """The sharded runs' target: FSDP2's from the .bin, ZeRO-3's from safetensors."""
    return [f"target.model={binary_checkpoint(ws)}"] if config == "fsdp2" else []


@pytest.fixture(scope="module", params=list(LAUNCHERS))
def sharded(ws, request):
    """chained heads, 14 steps, checkpoints at 7 and 14, the hidden-state cache on, the target sharded by each
    launcher's config; FSDP2's from a pytorch_model.bin checkpoint (which no process can read a share of: the main
    process loads it and sends each its share), ZeRO-3's from safetensors (each process reads its own share)."""
    out = ws / f"sharded-{request.param}"
    proc = launch(ws, out, *COMMON, "train.cache_hidden=true", *target_of(ws, request.param), config=request.param)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return request.param, out, proc


@pytest.fixture(scope="module")
def one_chained(ws) -> Path:
    one = ws / "one-chained"
    one_process(ws, one, *COMMON)
    return one


def test_each_process_holds_half_of_every_decoder_layer(sharded):
    config, out, proc = sharded
    assert "processes: 2 (MULTI_CPU, backend gloo" in proc.stdout
    row = next(r for r in read_jsonl(out / "metrics.jsonl") if "target/bytes_whole" in r)
    assert row["target/bytes_processes"] == 2
    assert row["target/bytes_layers_here"] * 2 == pytest.approx(row["target/bytes_layers_whole"], rel=0.02)
    # the embedding, final norm and LM head stay whole: the process holds the whole less half of the layers
    assert row["target/bytes_here"] == pytest.approx(
        row["target/bytes_whole"] - row["target/bytes_layers_whole"] + row["target/bytes_layers_here"], rel=1e-6)
    assert f"target sharded over 2 processes ({LAUNCHERS[config]}, one unit per decoder layer)" in proc.stdout
    if config == "fsdp2":  # a .bin checkpoint: read whole on the main process, a share sent to each
        assert "the main process loads it and sends each process its share" in proc.stdout
    else:
        assert "target: each process reads its own share of the checkpoint's files" in proc.stdout  # none holds it all
    assert "host memory while loading the target: peak " in proc.stdout  # each process's, as it loaded
    assert len(row["target/host_peak_bytes_by_process"]) == 2 and min(row["target/host_peak_bytes_by_process"]) > 0


def test_sharded_target_trains_the_heads_a_single_process_trains(sharded, one_chained):
    """The heads of a sharded run (FSDP2's target loaded from a .bin on the main process, ZeRO-3's read a share at a
    time) equal a single process's."""
    _, out, _ = sharded
    assert max_diff(one_chained, out) <= 1e-5
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 15))
    final = load_file(str(out / "model.safetensors"))  # heads only, loadable by the engine
    assert final and all(not k.startswith(("model.", "lm_head")) for k in final)


@pytest.mark.parametrize("config, processes, flags", [
    ("fsdp2", 2, ()),
    # one process, ZeRO-3's shards in CPU memory: the layers gathered from there for each forward
    ("deepspeed_zero3", 1, ("--offload_param_device", "cpu")),
])
def test_eagle3_heads_read_the_sharded_layers(ws, config, processes, flags):
    """eagle3 reads three of the target's layers through hooks on the (now sharded) decoder layers."""
    args = ["train.max_steps=4", "data.eval_size=0", "eval.every=0", "heads.kind=eagle3", "heads.num_heads=2"]
    out, one = ws / f"sharded-eagle3-{config}", ws / "one-eagle3"
    proc = launch(ws, out, *args, config=config, processes=processes, flags=flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if flags:
        assert "one unit per decoder layer, kept in CPU memory" in proc.stdout
    if not one.exists():
        one_process(ws, one, *args)
    assert max_diff(one, out) <= 1e-5


def test_resume_under_sharding_ends_where_the_uninterrupted_run_ends(ws, sharded):
    config, out, _ = sharded
    resumed = ws / f"sharded-resumed-{config}"
    shutil.copytree(out / "checkpoints" / "step-7", resumed / "checkpoints" / "step-7")
    proc = launch(ws, resumed, *COMMON, "train.cache_hidden=true", *target_of(ws, config), config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume" in proc.stdout and "step 7" in proc.stdout
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl") if "train/loss" in r] == list(range(8, 15))
    assert max_diff(out, resumed) <= 1e-6


def test_what_a_sharded_target_cannot_run_is_refused_in_one_line(ws, tmp_path):
    proc = launch(ws, tmp_path / "tau", "train.max_steps=2", "eval.tau_every=1", "data.eval_size=4")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "eval.tau_every generates on each process's own prompts" in errors[0], proc.stderr
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
    from medusa_train.target.sharding import Sharding, check_shardable
    from runs import config

    check_shardable(config(ws, "ok", "data.eval_size=4"), world_size=2)  # the base recipe is fine
    with pytest.raises(ConfigError, match=says):
        check_shardable(config(ws, "bad", "data.eval_size=4", override), world_size=2)
    with pytest.raises(ConfigError, match="with one process: launch with --num_processes 2"):
        check_shardable(config(ws, "one", "data.eval_size=4"), world_size=1)

    offload = Sharding("zero3", offload=True)
    check_shardable(config(ws, "one-offload", "data.eval_size=4"), world_size=1, sharding=offload)
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO-3 .* one process: .*or offload_param_device: cpu"):
        check_shardable(config(ws, "one-zero3", "data.eval_size=4"), world_size=1, sharding=Sharding("zero3"))


def test_fsdp_over_the_heads_on_cpus_says_that_it_runs_as_ddp(ws, tmp_path):
    """fsdp.yaml (FSDP v1 over the heads) is Accelerate's to run, on GPUs only (on CPUs its plugin stopped with a
    traceback): on CPUs the heads train under DDP, and the run says so."""
    proc = launch(ws, tmp_path / "fsdp1", "train.max_steps=2", "data.eval_size=0", "eval.every=0", config="fsdp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "processes: 2 (MULTI_CPU, backend gloo" in proc.stdout
    assert "warning: the launch config asks for FSDP over the heads (fsdp.yaml), which Accelerate runs only on " \
           "GPUs: here the heads train replicated under DDP (the same heads)" in proc.stdout


def test_a_deepspeed_stage_that_would_shard_the_heads_is_refused_at_launch(ws, tmp_path):
    proc = launch(ws, tmp_path / "zero2", "train.max_steps=2", config="deepspeed_zero3", flags=("--zero_stage", "2"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "DeepSpeed zero_stage 2: stages 0-2 shard the heads'" in errors[0], proc.stderr
    assert "use zero_stage 3 (recipes/accelerate/deepspeed_zero3.yaml" in errors[0]
    assert proc.stdout.strip().splitlines()[-1] == "train.py: exit code 2 (bad input, nothing trained)"


DEEPSPEED_ENV = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                 "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
                 "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none"}


@pytest.mark.parametrize("env, says", [
    ({}, None),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"}, None),
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"}, "zero_stage 1: stages 0-2 shard the heads'"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, "set offload_optimizer_device: none"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}, "set offload_param_device: cpu or none"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "/nonexistent/ds.json"}, "deepspeed_config_file /nonexistent/ds.json "
                                                                    "cannot be read"),
])
def test_what_the_deepspeed_config_asks_for_is_read_or_refused_in_one_line(monkeypatch, env, says):
    from medusa_train.config import ConfigError
    from medusa_train.target.sharding import Sharding, take_over_sharding

    for key, value in (DEEPSPEED_ENV | env).items():
        monkeypatch.setenv(key, value)
    if says is not None:
        with pytest.raises(ConfigError, match=says):
            take_over_sharding()
        assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "true"  # a refusal takes nothing over
        return
    assert take_over_sharding() == Sharding("zero3", offload=env.get(
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE") == "cpu")
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"  # the Accelerator runs the heads under DDP


def test_a_deepspeed_json_config_is_read_for_its_stage_and_offload(monkeypatch, tmp_path):
    from medusa_train.config import ConfigError
    from medusa_train.target.sharding import Sharding, sharding_requested

    path = tmp_path / "ds.json"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")  # the file wins over Accelerate's own keys
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    assert sharding_requested() == Sharding("zero3", offload=True)
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    with pytest.raises(ConfigError, match="offload_optimizer_device cpu"):
        sharding_requested()


def test_deepspeed_asked_for_but_not_installed_says_how_to_install_it(monkeypatch):
    from medusa_train.config import ConfigError
    from medusa_train.target.sharding import sharding_requested

    for key, value in DEEPSPEED_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    with pytest.raises(ConfigError, match="deepspeed is not installed: pip install deepspeed"):
        sharding_requested()
