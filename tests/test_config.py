"""Bad input exits with code 2 and one clear `error:` line before any model is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from medusa_train.train.cli import main
from medusa_train.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    """A valid recipe whose target directory holds only a tokenizer: loading a model from it would fail,
    so an error about anything else proves it was raised before the model load."""
    from tiny import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "tok_only")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"row {i} some text"}) + "\n"
                                                 for i in range(4)))
    path = tmp_path / "r.yaml"
    path.write_text(f"target: {{model: {tmp_path / 'tok_only'}}}\n"
                    f"data: {{dataset: {tmp_path / 'data.jsonl'}, format: text, eval_size: 0}}\n"
                    f"train: {{batch_size: 4, max_steps: 1}}\noutput_dir: {tmp_path / 'out'}\n")
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("override, message", [
    ("train.batchsize=4", "unknown config key: train.batchsize; did you mean train.batch_size?"),
    ("heads.num_head=2", "unknown config key: heads.num_head; did you mean heads.num_heads?"),
    # matched on the last part of the key, and on the names other trainers use
    ("train.lerning_rate=1e-3", "unknown config key: train.lerning_rate; did you mean train.lr?"),
    ("train.gradient_accumulation_steps=2", "unknown config key: train.gradient_accumulation_steps; did you mean "
                                            "train.grad_accum?"),
    ("tain.seed=1", "unknown config key: tain.seed; did you mean train.seed?"),
    ("train.foo=1", "unknown config key: train.foo"),
    ("train.batch_size=abc", "train.batch_size must be int, got 'abc'"),
    ("heads.num_heads=0", "heads.num_heads must be between 1 and 16, got 0"),
    ("heads.kind=serial", "heads.kind must be one of 'chained' | 'parallel' | 'eagle3' | 'dflash' | 'dspark', got 'serial'"),
    ("heads.kind=eagle3 heads.block=mlp_speculator heads.context_layers=1",
     "heads.context_layers is for heads.kind=chained or parallel, heads.block for heads.kind=chained only "
     "(heads.kind=eagle3): remove them"),
    ("heads.kind=eagle3 heads.aux_layers=[2,2]", "heads.aux_layers must be distinct layer ids >= 0, got [2, 2]"),
    ("heads.kind=eagle3 heads.aux_layers=3", "heads.aux_layers must be a list, got 3"),
    ("heads.aux_layers=[1,2]", "heads.aux_layers is for heads.kind=eagle3, dflash or dspark (heads.kind=chained): remove it"),
    ("heads.kind=dflash heads.own_lm_head=true",
     "heads.own_lm_head is for heads.kind=chained or parallel (heads.kind=dflash): remove it"),
    ("heads.kind=dflash heads.aux_layers=[3,3]", "heads.aux_layers must be distinct layer ids >= 0, got [3, 3]"),
    ("heads.kind=dflash heads.norms=[norm_output]", "heads.norms is for heads.kind=eagle3 only (heads.kind=dflash)"),
    ("heads.kind=dflash heads.mask_token_id=-1", "heads.mask_token_id must be a token id >= 0"),
    ("heads.kind=dflash heads.anchors=-2", "heads.anchors must be >= 0 (0: a block after every position), got -2"),
    ("heads.anchors=8", "heads.anchors is for heads.kind=dflash or dspark (heads.kind=chained): remove it"),
    ("heads.kind=eagle3 heads.mask_token_id=3",
     "heads.mask_token_id is for heads.kind=dflash or dspark (heads.kind=eagle3)"),
    ("heads.kind=eagle3 heads.norms=[norm_after_fc]", "heads.norms must be distinct names among norm_before_fc, "
     "norm_before_residual, norm_output (or auto), got ['norm_after_fc']"),
    ("heads.kind=eagle3 heads.norms=all", "heads.norms must be list | 'auto', got 'all'"),
    ("heads.kind=eagle3 heads.norms=[norm_output,norm_output]", "heads.norms must be distinct names among"),
    ("heads.norms=[norm_output]", "heads.norms is for heads.kind=eagle3 only (heads.kind=chained): remove it"),
    ("loss.decay=0", "loss.decay must be in (0, 1], got 0.0"),
    ("data.dataset=/nonexistent/train.jsonl", "data.dataset: file not found: /nonexistent/train.jsonl"),
    ("target.model=/nonexistent/model", "target.model: directory not found: /nonexistent/model"),
    ("resume=/nonexistent/step-10", "resume: checkpoint directory not found: /nonexistent/step-10"),
    ("train.lr", "override 'train.lr' must look like section.key=value"),
])
def test_config_error_exits_2_with_one_line(recipe, capsys, override, message):
    code, err = run_cli(capsys, str(recipe), *override.split(" "))
    assert code == 2
    assert err.startswith("error: ") and message in err
    assert len(err.splitlines()) == 1


def test_missing_recipe(capsys, tmp_path):
    code, err = run_cli(capsys, str(tmp_path / "nope.yaml"))
    assert (code, err) == (2, f"error: recipe file not found: {tmp_path / 'nope.yaml'}")


def test_batch_size_must_divide_across_processes(recipe, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = run_cli(capsys, str(recipe), "train.batch_size=3")
    assert code == 2
    assert err == "error: train.batch_size=3 does not divide across 2 processes; use a multiple of 2"


def test_empty_dataset_fails_before_the_model_loads(recipe, capsys, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    code, err = run_cli(capsys, str(recipe), f"data.dataset={tmp_path / 'empty.jsonl'}")
    assert code == 2
    assert "empty" in err and "data.dataset" in err  # a data error, not "cannot load the model"


def test_unreachable_hub_target_is_a_clear_error(recipe, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time, so also patch the live constant
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, err = run_cli(capsys, str(recipe), "target.model=no-such-org/no-such-model")
    assert code == 2
    assert err.startswith("error: target.model: cannot load the tokenizer of 'no-such-org/no-such-model'")
    assert "hf download no-such-org/no-such-model" in err or "local directory" in err


def test_chat_template_must_be_a_file_or_a_template(recipe, capsys):
    code, err = run_cli(capsys, str(recipe), "target.chat_template=missing.jinja")
    assert (code, err) == (2, "error: target.chat_template: missing.jinja is neither a file nor a Jinja template")


def test_overrides_apply_and_types_coerce(recipe):
    cfg = load_config(recipe, ["train.lr=5e-4", "heads.num_heads=3", "train.epochs=2", "tracking.run_name=7"])
    assert (cfg.train.lr, cfg.heads.num_heads, cfg.train.epochs, cfg.tracking.run_name) == (5e-4, 3, 2.0, "7")


def test_train_py_subprocess_exit_code(tmp_path):
    """The real entry point: exit status 2 and a single stderr line."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), str(tmp_path / "missing.yaml")],
                          capture_output=True, text=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: recipe file not found: {tmp_path / 'missing.yaml'}"


def test_the_draft_vocabulary_defaults_to_a_quarter_of_a_large_vocabulary(recipe):
    """heads.draft_vocab_size: auto (the default) scores a quarter of the target's vocabulary where that is at least
    2048 tokens, else all of it; a number is used as is, capped at the vocabulary; a bad value is one line."""
    from medusa_train.config import HeadsConfig

    auto = HeadsConfig()
    assert auto.draft_vocab_size == "auto"
    assert [auto.draft_vocab(v) for v in (260, 8191, 8192, 49152, 128256)] == [0, 0, 2048, 12288, 32064]
    assert HeadsConfig(draft_vocab_size=0).draft_vocab(128256) == 0
    assert HeadsConfig(draft_vocab_size=4096).draft_vocab(260) == 260
    assert HeadsConfig(draft_vocab_size=4096).draft_vocab(49152) == 4096
    with pytest.raises(ConfigError, match="heads.draft_vocab_size must be 'auto' or >= 0"):
        load_config(recipe, ["heads.draft_vocab_size=-1"])
    with pytest.raises(ConfigError, match="heads.draft_vocab_size must be"):
        load_config(recipe, ["heads.draft_vocab_size=most"])


def test_eagle3_heads_get_two_norms_unless_the_recipe_says_otherwise(tmp_path):
    """heads.norms auto: norm_before_fc and norm_output for eagle3 (docs/results.md measures them); a list is taken as
    written (in the norms' own order), [] for none; the other kinds have no norms."""
    from archs import tiny_model
    from transformers import LlamaConfig

    from medusa_train.config import HeadsConfig
    from medusa_train.kinds import DraftHeads
    from medusa_train.kinds.eagle3 import Eagle3Heads

    target = LlamaConfig(num_hidden_layers=6)

    def norms(**keys):
        return Eagle3Heads.resolve(Eagle3Heads.options_from(HeadsConfig(kind="eagle3", **keys)), target).norms

    assert norms() == ["norm_before_fc", "norm_output"]
    assert norms(norms=[]) == []
    assert norms(norms=["norm_output"]) == ["norm_output"]
    assert norms(norms=["norm_output", "norm_before_fc"]) == ["norm_before_fc", "norm_output"]
    chained = DraftHeads.for_target(tiny_model("llama"), "chained", 2).spec
    assert not hasattr(chained, "norms") and "norms" not in chained.to_json()


def test_activation_checkpointing_is_for_kinds_with_draft_layers(recipe):
    """train.activation_checkpointing: taken for eagle3, dflash and dspark, refused in one line for kinds without
    layers."""
    for kind in ("eagle3", "dflash", "dspark"):
        assert load_config(recipe, [f"heads.kind={kind}", "train.activation_checkpointing=true"]
                           ).train.activation_checkpointing
    with pytest.raises(ConfigError, match="train.activation_checkpointing recomputes draft layers, which chained heads "
                                          r"do not have \(only eagle3, dflash and dspark do\): remove it"):
        load_config(recipe, ["heads.kind=chained", "train.activation_checkpointing=true"])


def test_a_kind_trains_at_its_own_lr_and_warm_up_where_the_recipe_is_silent_and_a_checkpoint_records_them(
        recipe, tmp_path):
    """train.lr unset is `auto`, resolved for the target's width (resolve_lr, which the trainer calls with the
    target's config): chained and parallel heads at 3 / hidden size with a 10% warm-up (OnTargetHeads, the panel's
    choice), the other kinds at 1e-3 with none, Muon's lr following; an lr or warm-up the recipe or an override sets
    is kept whatever the kind. recipe.yaml records the values resolved, so a checkpoint of a silent recipe from before the
    default moved (lr 4e-3) is refused on resume, naming train.lr, rather than resumed at another lr."""
    import yaml

    from medusa_train.config import MUON_LR_SCALE, resolve_lr
    from medusa_train.train.checkpoints import RECIPE_NAME, check_resumable

    def resolved(*overrides: str, hidden_size: int = 384):
        cfg = load_config(recipe, list(overrides), world_size=1)
        resolve_lr(cfg, hidden_size)
        return cfg

    assert load_config(recipe, world_size=1).train.lr == "auto"
    for kind in ("chained", "parallel"):
        for hidden_size, lr in ((384, 3 / 384), (576, 3 / 576), (4096, 3 / 4096)):
            train = resolved(f"heads.kind={kind}", hidden_size=hidden_size).train
            assert (train.lr, train.warmup_steps) == (pytest.approx(lr), 0.1)
    eagle3 = resolved("heads.kind=eagle3").train
    assert (eagle3.lr, eagle3.muon_lr, eagle3.warmup_steps) == (1e-3, MUON_LR_SCALE * 1e-3, 0)
    for kind in ("chained", "parallel", "eagle3"):
        train = resolved(f"heads.kind={kind}", "train.lr=3e-4", "train.warmup_steps=5").train
        assert (train.lr, train.warmup_steps) == (3e-4, 5)
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(recipe.read_text().replace("train: {", "train: {lr: 5.0e-4, warmup_steps: 0, "))
    train = load_config(pinned, world_size=1).train
    assert (train.lr, train.warmup_steps) == (5e-4, 0)
    old = resolved().to_dict()
    old["train"]["lr"] = 4e-3
    (tmp_path / RECIPE_NAME).write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError, match=rf"train.lr={3 / 384!r} \(the checkpoint has 0.004\)"):
        check_resumable(resolved(), tmp_path)
