"""Every command in the README runs as written, as far as it can without a GPU, the hub or trained heads: each
`python -m MODULE` and `train.py` command line parses with the parser its program uses (so a renamed flag or module
fails here), recipes and launcher configs exist and the recipe keys it sets exist, `accelerate launch`'s own flags
are accepted by accelerate's parser, scripts exist and parse, and the Python snippet's imports resolve. What cannot
run here (pip, vLLM, SGLang) is named below; anything else unrecognised fails."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXTERNAL = {"pip", "vllm", "sglang.launch_server", "pytest"}  # other programs, not ours to parse here


def readme_commands() -> list[str]:
    """The command lines of the README's bash blocks and docs/serving.md's (the README's "Serve" continued there),
    continuations joined, comments dropped."""
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "serving.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in line.split("&&"))
    return out


class Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def parse_with_program(module: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """Run `module`'s main up to its argument parsing: the namespace its own parser makes of `argv` (an error
    there exits 2, which fails the test with the parser's message)."""
    for method in ("parse_args", "parse_intermixed_args"):
        real = getattr(argparse.ArgumentParser, method)

        def stop(self, args=None, namespace=None, _real=real):
            raise Parsed(_real(self, args, namespace))

        monkeypatch.setattr(argparse.ArgumentParser, method, stop)
    main = importlib.import_module(module).main
    with pytest.raises(Parsed) as parsed:
        main(argv)
    monkeypatch.undo()
    return parsed.value.namespace


def check_recipe(recipe: str, overrides: list[str], tmp_path: Path, monkeypatch) -> None:
    """The recipe exists and takes the overrides (keys and values checked by the config itself); local files the
    overrides name are made in an empty folder first, since the README's point there is the key, not the file."""
    from medusa_train.config import load_config

    monkeypatch.chdir(tmp_path)
    for override in overrides:
        value = override.partition("=")[2]
        if "/" in value and value.endswith((".jsonl", ".json")):
            Path(value).parent.mkdir(parents=True, exist_ok=True)
            Path(value).write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return load_config(str(ROOT / recipe), overrides)


def rows_that_fit_80gb(kind: str) -> int:
    """Rows of 2048 tokens a process fits on an 80 GB card, at an 8B target, by head kind (docs/training.md, "What
    fits a card": `python scripts/gpu_sizing.py` wrote it)."""
    table = json.loads((ROOT / "docs" / "results" / "gpu-sizing.json").read_text())["table"]
    return next(r["rows_that_fit"]["80"] for r in table if r["shape"] == "8B" and r["kind"] == kind)


def check_fits(launch, cfg) -> None:
    """An `accelerate launch` of training names its config (its processes and precision), and the rows each process
    takes a micro-step fit an 80 GB card (the GPU recipes: 7-8B targets)."""
    assert launch.config_file, "accelerate launch without --config_file: it runs Accelerate's defaults (no bf16)"
    processes = launch.num_processes or yaml.safe_load((ROOT / launch.config_file).read_text())["num_processes"]
    if cfg.target.model.startswith(("meta-llama/", "Qwen/", "lmsys/")):
        rows = cfg.train.batch_size / processes
        fit = rows_that_fit_80gb(cfg.heads.kind)
        assert rows <= fit, (f"{rows:g} rows of {cfg.data.max_length} tokens a process a micro-step; {fit} fit an "
                             f"80 GB card for {cfg.heads.kind} heads: lower train.batch_size, raise train.grad_accum")


def check_command(command: str, tmp_path: Path, monkeypatch) -> str:
    """Checks one command line; returns what kind it was."""
    words = shlex.split(command.replace("$RANK", "0").replace("$MASTER", "10.0.0.1"))
    launch = None
    if words[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        launch = launch_command_parser().parse_args(words[2:])  # accelerate's own flags
        if launch.config_file:
            assert (ROOT / launch.config_file).is_file(), launch.config_file
        rest = [launch.training_script, *launch.training_script_args]
        if launch.module:
            words = ["python", "-m", *rest]
        else:
            words = ["python", *rest]
    if words[0] == "bash":
        script = ROOT / words[1]
        assert script.is_file(), words[1]
        subprocess.run(["bash", "-n", str(script)], check=True)
        return "script"
    if words[0] in EXTERNAL or words[:3] == ["python", "-m", "pytest"]:
        return "external"
    if words[:3] == ["python", "-m", "sglang.launch_server"]:
        return "external"
    assert words[0] == "python", f"an unknown program in the README: {command}"
    if words[1] == "train.py":
        args = parse_with_program("medusa_train.train.cli", words[2:], monkeypatch)
        cfg = check_recipe(args.recipe, args.overrides, tmp_path, monkeypatch)
        if launch is not None:
            check_fits(launch, cfg)
        return "train"
    assert words[1] == "-m", command
    args = parse_with_program(words[2], words[3:], monkeypatch)
    assert launch is None or launch.config_file, f"accelerate launch without --config_file: {command}"
    if getattr(args, "recipe", None):  # distill and evaluate take a recipe and overrides too
        check_recipe(args.recipe, getattr(args, "overrides", []) or [], tmp_path, monkeypatch)
    return words[2]


def test_every_readme_command_parses(tmp_path, monkeypatch):
    kinds = [check_command(c, tmp_path, monkeypatch) for c in readme_commands()]
    # what the README shows: the main job, the tests, training in all three launches, distillation, the generate
    # and bench commands, evaluation, the export in two formats
    for kind in ("script", "train", "medusa_train.data.distill", "inference.generate", "inference.bench",
                 "medusa_train.train.evaluate", "medusa_train.export"):
        assert kind in kinds


def test_the_readme_snippet_and_inline_modules_resolve():
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    compile(snippet, "README.md", "exec")
    for module, names in re.findall(r"^from ([\w.]+) import ([\w, ]+)$", snippet, re.M):
        for name in names.split(","):
            assert hasattr(importlib.import_module(module), name.strip())
    inline = set(re.findall(r"python -m ([\w.]+)", text)) - EXTERNAL
    for module in sorted(inline):
        assert hasattr(importlib.import_module(module), "main"), module


def test_a_renamed_flag_is_caught(tmp_path, monkeypatch):
    """The check above fails where the README would: a flag its program does not take, a recipe key that does not
    exist, a missing recipe."""
    with pytest.raises(SystemExit):
        check_command("python -m inference.generate --heads h --prompt p --max-tokens 64", tmp_path, monkeypatch)
    from medusa_train.config import ConfigError

    with pytest.raises(ConfigError, match="unknown config key"):
        check_command("python train.py recipes/smollm2-135m.yaml train.learning_rate=1e-3", tmp_path, monkeypatch)
    with pytest.raises((ConfigError, FileNotFoundError)):
        check_command("accelerate launch train.py recipes/nope.yaml", tmp_path, monkeypatch)


def test_a_launch_that_would_not_fit_an_80gb_card_or_names_no_config_is_caught(tmp_path, monkeypatch):
    """Training commands are launched with a config, at a batch a card holds: the 8-GPU batch on one GPU fails, the
    same with the recipe's one-GPU override passes, and a launch without --config_file fails."""
    eagle3 = "recipes/llama-3.1-8b-instruct-eagle3.yaml"
    one = "accelerate launch --config_file recipes/accelerate/single_gpu.yaml train.py "
    with pytest.raises(AssertionError, match="32 rows of 2048 tokens a process a micro-step; 5 fit an 80 GB card"):
        check_command(one + eagle3, tmp_path, monkeypatch)
    assert check_command(one + eagle3 + " train.batch_size=4 train.grad_accum=8", tmp_path, monkeypatch) == "train"
    assert check_command("accelerate launch --config_file recipes/accelerate/multi_gpu_ddp.yaml train.py " + eagle3,
                         tmp_path, monkeypatch) == "train"
    with pytest.raises(AssertionError, match="without --config_file"):
        check_command("accelerate launch train.py " + eagle3, tmp_path, monkeypatch)

