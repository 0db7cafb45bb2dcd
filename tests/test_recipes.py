"""Every shipped recipe passes the validator, opens with its launch command, and the accelerate configs
load; a typo in a recipe fails here, not on a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from medusa_train.config import load_config
from medusa_train.base.files import looks_local

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TARGETS = ["llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "vicuna-7b-v1.3"]
GPU_RECIPES = [f"{t}{suffix}.yaml" for t in TARGETS for suffix in ("", "-eagle3")]


def test_the_gpu_recipes_exist():
    """Per target, one for our engine (chained) and one that vLLM and SGLang serve (eagle3)."""
    names = {p.name for p in RECIPES}
    assert set(GPU_RECIPES) <= names
    for target in TARGETS:
        kinds = [yaml.safe_load((ROOT / "recipes" / f"{target}{s}.yaml").read_text())["heads"]["kind"]
                 for s in ("", "-eagle3")]
        assert kinds == ["chained", "eagle3"], target


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path: Path, tmp_path: Path, monkeypatch):
    """Hub names are not loaded; local paths (a prepared model, a distilled data file) are replaced by
    stand-ins so the check does not depend on what this machine has built."""
    monkeypatch.chdir(ROOT)  # recipes name repository-relative files (chat templates)
    raw = yaml.safe_load(path.read_text())
    overrides = []
    if looks_local(raw["target"]["model"]):
        (tmp_path / "model").mkdir()
        overrides.append(f"target.model={tmp_path / 'model'}")
    if looks_local(raw["data"]["dataset"]):
        (tmp_path / "data.jsonl").write_text('{"text": "x"}\n')
        overrides.append(f"data.dataset={tmp_path / 'data.jsonl'}")
    cfg = load_config(path, overrides, world_size=1)
    assert cfg.heads.num_heads >= 1 and cfg.train.lr > 0
    assert cfg.train.batch_size % 8 == 0 or path.name not in GPU_RECIPES  # splits over 1, 2, 4 or 8 GPUs


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_opens_with_its_launch_command_and_an_override(name: str):
    text = (ROOT / "recipes" / name).read_text()
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert header, f"{name} must open with a comment"
    commands = [h for h in header if "train.py" in h]
    assert any("accelerate launch" in c and f"train.py recipes/{name}" in c for c in commands)
    for config in ("multi_gpu_ddp.yaml", "single_gpu.yaml"):  # its launch for 8 GPUs and for one
        assert any(f"--config_file recipes/accelerate/{config} train.py recipes/{name}" in c for c in commands), config
    assert any(re.search(r"\b[a-z_]+\.[a-z_]+=\S+", h) for h in header), "no example key=value override"
    cfg = yaml.safe_load(text)
    assert not looks_local(cfg["target"]["model"])  # a hub name, loaded only on the GPU machine


@pytest.mark.parametrize("name, kind", [("single_gpu", "NO"), ("multi_gpu_ddp", "MULTI_GPU"), ("fsdp", "FSDP")])
def test_accelerate_configs_load(name: str, kind: str):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(ROOT / "recipes" / "accelerate" / f"{name}.yaml"))
    assert cfg.distributed_type.value == kind
    assert cfg.mixed_precision == "bf16"


def test_vicuna_template_supervises_exactly_the_replies():
    """The recipe's own chat template for Vicuna (whose tokenizer has none), through the data pipeline."""
    from tiny import tiny_tokenizer

    from medusa_train.data.chat import tokenize_chat

    tok = tiny_tokenizer()
    tok.chat_template = (ROOT / "recipes" / "templates" / "vicuna_v1.1.jinja").read_text()
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    row = tokenize_chat(messages, tok, 512)
    text = tok.decode(row["input_ids"])
    assert text.startswith("<|endoftext|>A chat between a curious user")
    assert " USER: Hi there ASSISTANT: Hello!<|im_end|> USER: 2+2? ASSISTANT: 4<|im_end|>" in text
    supervised = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert tok.decode(supervised) == " Hello!<|im_end|> 4<|im_end|>"


@pytest.mark.parametrize("kind", ["chained", "parallel"])
def test_main_job_training_overrides_are_valid_recipe_keys(kind: str, tmp_path: Path, monkeypatch):
    """The main job shortens recipes/smollm2-135m.yaml with overrides; a key renamed in the config must fail
    here, not 10 minutes into the demo."""
    from medusa_train import demo

    monkeypatch.chdir(ROOT)
    (tmp_path / "model").mkdir()
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    args = demo.parser().parse_args(["--dtype", "bfloat16", "--batch-size", "2", "--max-length", "128"])
    cmd = demo.train_cmd(str(tmp_path / "model"), str(tmp_path / "d.jsonl"), kind, 40, tmp_path / "out", args)
    recipe = cmd.index(str(demo.RECIPE))
    cfg = load_config(cmd[recipe], cmd[recipe + 1:], world_size=1)
    assert (cfg.heads.kind, cfg.train.max_steps, cfg.train.batch_size) == (kind, 40, 2)
    assert (cfg.target.dtype, cfg.data.max_length, cfg.output_dir) == ("bfloat16", 128, str(tmp_path / "out"))
    # the recipe itself is the full-length run; the main job shortens it to the settings its numbers came from
    full = load_config(cmd[recipe], [f"target.model={tmp_path / 'model'}"], world_size=1)
    assert (full.heads.draft_vocab_size, full.heads.context_layers, full.train.lr) == (8192, 1, 2e-3)
    assert (cfg.heads.draft_vocab_size, cfg.heads.context_layers, cfg.train.lr) == (4096, 0, 3e-3)
    assert demo.target_dtype("float32") == "float32" and demo.target_dtype("auto") in ("float32", "bfloat16")
