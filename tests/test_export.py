"""python -m medusa_train.export: speculators' own Eagle3DraftModel loads our eagle3 export and gives our logits; the
config holds what vLLM reads; the medusa layout computes our parallel heads; bad input exits 2 with one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny import save_tiny

from medusa_train.kinds.eagle3 import NORMS
from medusa_train.export import ExportError, export, main
from medusa_train.kinds.eagle3 import import_speculators
from medusa_train.kinds.heads import DraftHeads
from medusa_train.base.files import cache_root
from medusa_train.target.model import target_hidden

SPECULATORS = "speculators==0.9.0"
# speculators 0.9 pins transformers<=5.19, so it is installed without its dependencies into a directory of its own,
# with the three modules it imports that this project does not need, and put on the PYTHONPATH of a subprocess that
# runs this very interpreter: it sees this environment's packages whether the suite runs in a venv or not
SPECULATORS_IMPORTS = ("openai", "hs-connectors", "loguru")
HERE = Path(__file__).resolve().parent


def speculators_env(where: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"PYTHONPATH": path}


@pytest.fixture(scope="session")
def speculators_env_vars() -> dict[str, str]:
    """The environment in which `sys.executable` imports speculators 0.9.0. Installed once per Python version under
    the project's cache (needs the package registry), into a staging directory renamed into place only after the
    import works: an interrupted or failed install never leaves a directory that a later run would trust."""
    where = cache_root() / f"speculators-0.9.0-py{sys.version_info.major}.{sys.version_info.minor}"
    probe = [sys.executable, "-c", "import speculators.models.eagle3, loguru"]
    works = where / ".imports"  # written once the probe passed there: the probe's imports cost ~10 s a run
    if works.is_file() or (where.is_dir() and subprocess.run(probe, env=speculators_env(where),
                                                              capture_output=True).returncode == 0):
        works.touch()
        return speculators_env(where)
    staging = where.with_name(f".{where.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--target", str(staging), SPECULATORS, *SPECULATORS_IMPORTS], check=True)
        subprocess.run(probe, env=speculators_env(staging), check=True)
        (staging / ".imports").touch()
        shutil.rmtree(where, ignore_errors=True)
        os.replace(staging, where)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return speculators_env(where)


def _eagle3_heads(root: Path, norms: tuple[str, ...] = ()):
    """A tiny Llama target on disk and eagle3 heads for it (perturbed, with a draft vocabulary, the given norms)."""
    return _heads_on_disk(root, "eagle3", 3, norms=norms)


def _heads_on_disk(root: Path, kind: str, num_heads: int, layers: int = 1, **kw):
    """A tiny Llama target on disk and heads of `kind` for it, perturbed, with a draft vocabulary of 48 tokens."""
    target = save_tiny(root / "target", "llama", layers=6)
    heads = DraftHeads.for_target(target, kind, num_heads, layers, draft_ids=torch.randperm(
        260, generator=torch.Generator().manual_seed(0))[:48], target_name=str(root / "target"), **kw)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    heads.save_pretrained(root / "heads")
    return root, target, heads


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    return _eagle3_heads(tmp_path_factory.mktemp("export"))


@pytest.fixture(scope="module")
def eagle3_norms_dir(tmp_path_factory):
    """The same with every one of EAGLE-3.1's norms (speculators' trainer's defaults)."""
    return _eagle3_heads(tmp_path_factory.mktemp("export-norms"), NORMS)


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory):
    """A tiny Llama target on disk and dflash heads for it: a block of 5, two layers, a draft vocabulary, perturbed."""
    return _heads_on_disk(tmp_path_factory.mktemp("export-dflash"), "dflash", 4, 2, mask_token_id=257)


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    """The same for dspark heads: a Markov head of rank 8 (moved off its zero start) and a confidence head."""
    return _heads_on_disk(tmp_path_factory.mktemp("export-dspark"), "dspark", 4, 2, mask_token_id=257, markov_rank=8)


EAGLE3_T, DFLASH_T = 20, 16  # the checks' sequence lengths


@pytest.fixture(scope="module")
def speculators_read(eagle3_dir, eagle3_norms_dir, dflash_dir, dspark_dir, speculators_env_vars, tmp_path_factory):
    """Each of the four heads exported `--format speculators` and read by speculators' own draft model, all in one
    run of its Python (tests/speculators_check.py; its imports are most of a run): {fixture name: (what speculators
    reported, our logits [K, T, V_draft], the heads, our confidence logits [K, T] or None)}, ours from the same
    target states and tokens."""
    work = tmp_path_factory.mktemp("speculators-read")
    jobs, ours = [], {}
    fixtures = {"eagle3_dir": eagle3_dir, "eagle3_norms_dir": eagle3_norms_dir, "dflash_dir": dflash_dir,
                "dspark_dir": dspark_dir}
    for name, (root, target, heads) in fixtures.items():
        out, inputs = work / name, work / f"{name}.pt"
        assert main([str(root / "heads"), str(out), "--format", "speculators"]) == 0
        T, K = (EAGLE3_T, 3) if heads.kind == "eagle3" else (DFLASH_T, heads.spec.num_heads)
        ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(2))
        feats = target_hidden(target, ids, None, heads.target_layers)
        with torch.no_grad():
            states = heads(feats, ids, target.get_input_embeddings())  # [K, 1, T, d]
            ours[name] = torch.stack([heads.logits(k, states[k]) for k in range(K)])[:, 0]  # by target id
            if heads.has_confidence:
                ours[name + "/confidence"] = torch.stack([heads.confidence(k, states[k]) for k in range(K)])[:, 0]
        if heads.kind == "eagle3":
            # speculators reads the aux states at t with x_{t+1} (its data pipeline shifts the ids) at position t+1
            data = {"aux": feats[..., 32:].contiguous(), "input_ids": F.pad(ids[:, 1:], (0, 1)), "steps": K}
        else:
            loss_mask = torch.ones(1, T, dtype=torch.long)
            loss_mask[0, 0] = 0  # an anchor at position 0 would have no context: our first block follows position 0
            data = {"aux": feats[..., 32:].contiguous(), "input_ids": ids, "loss_mask": loss_mask}
        torch.save(data, inputs)
        jobs += [heads.kind, str(out), str(inputs)]
    proc = subprocess.run([sys.executable, str(HERE / "speculators_check.py"), *jobs], capture_output=True, text=True,
                          env=speculators_env_vars)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: (got, ours[name], fixtures[name][2], ours.get(name + "/confidence"))
            for name, got in zip(fixtures, reports)}


@pytest.mark.timeout(600)  # the first run on a machine installs speculators
@pytest.mark.parametrize("heads_fixture", ["eagle3_dir", "eagle3_norms_dir"])
def test_speculators_loads_the_export_and_computes_our_logits(heads_fixture, speculators_read):
    got, ours, heads, _ = speculators_read[heads_fixture]
    # every tensor we wrote is one of theirs; what they miss is only the verifier's own LM head and norm, which
    # speculators never saves (it rebuilds them from the verifier for training)
    assert got["unexpected"] == [] and got["missing"] == ["verifier_lm_head.weight", "verifier_norm.weight"]
    assert got["norms"] == heads.spec.norms
    assert got["as_saved"] and got["aux_layers"] == heads.spec.aux_layers
    theirs = torch.tensor(got["logits"])[:, 0]  # [K, T, V_draft]
    for k in range(3):
        valid = EAGLE3_T - 1 - k  # past that, step k reads a token beyond the sequence (padding, differently filled)
        err = (theirs[k, :valid] - ours[k, :valid]).abs().max().item()
        assert err < 1e-5 * ours[k, :valid].abs().max().item() + 1e-6, (k, err)


@pytest.mark.timeout(600)  # the first run on a machine installs speculators
@pytest.mark.parametrize("heads_fixture", ["dflash_dir", "dspark_dir"])
def test_speculators_dflash_loads_the_export_and_computes_our_logits(heads_fixture, speculators_read):
    """speculators' own DFlashDraftModel (DSparkDraftModel), run over our export with an anchor at every position,
    gives for each block's slot i the logits our heads give head i at the position before the anchor (dspark: with
    the Markov bias of the token before the slot, and the confidence head's logits)."""
    got, ours, heads, our_confidence = speculators_read[heads_fixture]
    T, K = DFLASH_T, heads.spec.num_heads
    # every tensor we wrote is one of theirs; they miss only the verifier's LM head and norm (never saved)
    assert got["unexpected"] == [] and got["missing"] == ["verifier_lm_head.weight", "verifier_norm.weight"]
    assert got["as_saved"] and got["aux_layers"] == heads.spec.aux_layers
    assert got["block_size"] == K + 1 and got["mask_token_id"] == 257
    positions = [a for a, real in zip(got["positions"], got["trained"]) if real]
    assert positions == list(range(1, T - K - 1))  # speculators leaves the last block_size positions out
    theirs = torch.tensor(got["logits"])  # [blocks, block_size, V_draft]
    confidence = torch.tensor(got.get("confidence", []))
    for n, a in enumerate(positions):
        for i in range(1, K + 1):
            ref = ours[i - 1, a - 1]
            err = (theirs[n, i] - ref).abs().max().item()
            assert err < 1e-5 * ref.abs().max().item() + 1e-6, (a, i, err)
            if heads.kind == "dspark":
                ref = our_confidence[i - 1, a - 1]
                assert abs(confidence[n, i] - ref) < 1e-5 * abs(ref) + 1e-6, (a, i)
    if heads.kind == "dspark":  # (the Markov head is not at its zero start: the check above crossed its bias)
        assert heads.dflash.markov_head.markov_w2.weight.abs().max() > 0.01
        assert got["dspark"] == {"markov_rank": 8, "markov_head_type": "vanilla", "sample_from_anchor": False,
                                 "enable_confidence_head": True, "confidence_head_with_markov": True}


def test_speculators_config_holds_what_vllm_reads(eagle3_dir, tmp_path):
    """The fields vLLM's speculators loader reads (update_eagle3 and the proposal/verifier lookup), and the vocabulary
    maps as it applies them: target id = draft id + d2t[draft id]."""
    root, target, heads = eagle3_dir
    assert main([str(root / "heads"), str(tmp_path / "out"), "--format", "speculators", "--verifier", "org/tiny"]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["hidden_size"] == 32 and layer["num_hidden_layers"] == 1
    assert layer["num_attention_heads"] == 4 and layer["num_key_value_heads"] == 2 and layer["head_dim"] == 8
    assert layer["vocab_size"] == 260
    # vLLM takes a missing norm_before_residual as true: it must be written, and false as trained
    assert cfg["norm_before_residual"] is False
    assert not (cfg["norm_before_fc"] or cfg["fc_norm"] or cfg["norm_output"])
    assert cfg["draft_vocab_size"] == 48 and cfg["eagle_aux_hidden_state_layer_ids"] == heads.spec.aux_layers
    assert cfg.get("target_hidden_size") in (None, 32)
    spec_cfg = cfg["speculators_config"]
    assert spec_cfg["algorithm"] == "eagle3" and spec_cfg["default_proposal_method"] == "greedy"
    assert spec_cfg["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec_cfg["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec_cfg["verifier"] == {"architectures": ["LlamaForCausalLM"], "name_or_path": "org/tiny"}
    w = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 48
    draft_to_target = torch.arange(48) + w["d2t"]
    assert torch.equal(draft_to_target, torch.nonzero(w["t2d"])[:, 0])  # ascending: t2d's order is the draft order
    assert torch.equal(draft_to_target, torch.sort(heads.draft_ids).values)
    assert torch.equal(w["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert w["fc.weight"].shape == (32, 3 * 32) and w["layers.0.self_attn.q_proj.weight"].shape == (32, 64)
    assert {"norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"} <= set(w)
    # without the embedding the engine shares the target's
    assert main([str(root / "heads"), str(tmp_path / "lean"), "--format", "speculators", "--no-embed"]) == 0
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "lean" / "model.safetensors"))
    # SGLang's layout: the same tensors, the layer as midlayer.*, the config a Llama config naming the EAGLE-3 class,
    # its aux layers counted by the layer whose output is taken (ours minus one)
    assert main([str(root / "heads"), str(tmp_path / "sgl"), "--format", "eagle3"]) == 0
    sgl = load_file(str(tmp_path / "sgl" / "model.safetensors"))
    assert set(sgl) == {k.replace("layers.0.", "midlayer.") for k in w if k != "embed_tokens.weight"}
    assert all(torch.equal(sgl[k.replace("layers.0.", "midlayer.")], v) for k, v in w.items() if k in sgl
               or k.startswith("layers.0."))
    sgl_cfg = json.loads((tmp_path / "sgl" / "config.json").read_text())
    assert sgl_cfg["architectures"] == ["LlamaForCausalLMEagle3"] and sgl_cfg["model_type"] == "llama"
    assert sgl_cfg["draft_vocab_size"] == 48 and sgl_cfg["num_hidden_layers"] == 1 and sgl_cfg["hidden_size"] == 32
    assert sgl_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in heads.spec.aux_layers]


@pytest.mark.parametrize("heads_fixture", ["eagle3_dir", "eagle3_norms_dir"])
def test_a_speculators_drafter_imports_back_into_the_same_heads(heads_fixture, tmp_path, request):
    """`import_speculators` reads the export backwards: the same norms, aux layers, draft vocabulary and tensors, so
    the imported heads score exactly what the trained ones score, and the norm flags are written as trained."""
    root, target, heads = request.getfixturevalue(heads_fixture)
    assert main([str(root / "heads"), str(tmp_path / "out"), "--format", "speculators"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert [n for n in NORMS if config[n]] == heads.spec.norms and config["fc_norm"] is False
    back = import_speculators(tmp_path / "out", target, "tiny")
    for key in ("kind", "num_heads", "hidden_size", "vocab_size", "draft_vocab_size", "aux_layers", "norms"):
        assert getattr(back.spec, key) == getattr(heads.spec, key), key
    assert torch.equal(back.draft_ids, heads.draft_ids)
    mine, theirs = heads.state_dict(), back.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    feats = target_hidden(target, ids, None, heads.target_layers)
    with torch.no_grad():
        a, b = heads(feats, ids, target.get_input_embeddings()), back(feats, ids, target.get_input_embeddings())
    assert torch.equal(a, b)
    # what our layer cannot be is refused, naming it
    for key, value, message in (("fc_norm", True, "has fc_norm"), ("embed_requires_grad", True, "trained embedding"),
                                ("speculators_model_type", "dflash", "only eagle3")):
        edited = tmp_path / f"edited-{key}"
        shutil.copytree(tmp_path / "out", edited)
        (edited / "config.json").write_text(json.dumps(config | {key: value}))
        with pytest.raises(ExportError, match=message):
            import_speculators(edited, target)
    with pytest.raises(ExportError, match="not a speculators checkpoint"):
        import_speculators(root / "heads", target)


def test_medusa_export_computes_our_parallel_heads(tmp_path):
    target = save_tiny(tmp_path / "target", "qwen2")
    heads = DraftHeads.for_target(target, "parallel", 3, layers_per_head=2, target_name=str(tmp_path / "target"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    heads.save_pretrained(tmp_path / "heads")
    assert main([str(tmp_path / "heads"), str(tmp_path / "out"), "--format", "medusa"]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == 2
    assert cfg["medusa_fc_bias"] is True and cfg["hidden_size"] == 32 and cfg["vocab_size"] == 260
    # vLLM <= 0.32 maps any key holding both "num" and "heads" to the head count: only num_heads may
    assert [k for k in cfg if "num" in k and "heads" in k] == ["num_heads"]
    w = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(w) == sorted([f"blocks.{k}.layers.{i}.{p}" for k in range(3) for i in range(2)
                                for p in ("weight", "bias")] + [f"lm_heads.{k}.weight" for k in range(3)])
    h = torch.randn(5, 32)
    for k in range(3):  # vLLM's Medusa: x = x + silu(W x + b) per layer, then the head's LM head
        x = h
        for i in range(2):
            x = x + F.silu(F.linear(x, w[f"blocks.{k}.layers.{i}.weight"], w[f"blocks.{k}.layers.{i}.bias"]))
        want = heads.logits(k, heads.step(k, h, None), target.get_output_embeddings())
        assert torch.allclose(F.linear(x, w[f"lm_heads.{k}.weight"]), want, atol=1e-5), k


def test_bad_input_exits_2_with_one_line(eagle3_dir, tmp_path, capsys):
    root, target, heads = eagle3_dir
    parallel = DraftHeads.for_target(target, "parallel", 2, target_name=str(root / "target"))
    parallel.save_pretrained(tmp_path / "parallel")
    drafty = DraftHeads.for_target(target, "parallel", 2, draft_ids=torch.arange(10), target_name=str(root / "target"))
    drafty.save_pretrained(tmp_path / "drafty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    chained = DraftHeads.for_target(target, "chained", 2, target_name=str(root / "target"))
    chained.save_pretrained(tmp_path / "chained")
    # every suggestion leads somewhere that works: a format these heads fit, or the recipe keys of heads that export
    cases = [
        ([str(tmp_path / "parallel"), str(tmp_path / "o1"), "--format", "speculators"],
         r"the speculators format holds heads trained with heads.kind=eagle3\|dflash\|dspark, but .* holds parallel "
         r"heads: "
         r"export them with --format medusa$"),
        ([str(root / "heads"), str(tmp_path / "o2"), "--format", "medusa"],
         "holds eagle3 heads: export them with --format speculators or eagle3$"),
        ([str(root / "heads"), str(tmp_path / "o3"), "--format", "mlp_speculator"], "holds eagle3 heads"),
        ([str(tmp_path / "drafty"), str(tmp_path / "o4"), "--format", "medusa"],
         r"heads.draft_vocab_size=0 .* holds parallel heads \(heads.draft_vocab_size=10\): no format holds them; "
         r"heads that export are trained with .*heads.kind=eagle3 \(speculators: vLLM and SGLang\)"),
        ([str(tmp_path / "chained"), str(tmp_path / "o8"), "--format", "mlp_speculator"],
         r"holds heads trained with heads.kind=chained heads.block=mlp_speculator .* holds chained heads: no format "
         r"holds them"),
        ([str(root / "target"), str(tmp_path / "o5"), "--format", "speculators"],
         "is not a draft heads config .* is this a model directory"),
        ([str(tmp_path / "nowhere"), str(tmp_path / "o7"), "--format", "speculators"], "is not a heads directory"),
        ([str(root / "heads"), str(tmp_path / "full"), "--format", "speculators"], "exists and is not empty.*--force"),
        ([str(root / "heads"), str(tmp_path / "full" / "keep.txt"), "--format", "speculators"], "is a file"),
        ([str(root / "heads"), str(tmp_path / "o6"), "--format", "onnx"], "invalid choice: 'onnx'"),
    ]
    for argv, message in cases:
        assert run(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), (argv, err)
        assert not (tmp_path / argv[1]).exists() or argv[1].endswith(("full", "keep.txt"))
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"  # refused: untouched
    # --force replaces it whole, and no staging directory is left behind
    assert main([str(root / "heads"), str(tmp_path / "full"), "--format", "speculators", "--force"]) == 0
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_mlp_speculator_export_goes_through_the_same_cli(tmp_path):
    target = save_tiny(tmp_path / "target", "llama")
    heads = DraftHeads.for_target(target, "chained", 2, block="mlp_speculator", target_name=str(tmp_path / "target"))
    heads.save_pretrained(tmp_path / "heads")
    assert main([str(tmp_path / "heads"), str(tmp_path / "out"), "--format", "mlp_speculator"]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "mlp_speculator" and cfg["n_predict"] == 2
    w = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(w["proj.1.weight"], heads.blocks[1].proj.weight)
    assert torch.equal(w["head.0.weight"], target.get_output_embeddings().weight)


def run(argv: list[str]) -> int:
    """main's exit code, also where argparse exits."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_a_directory_is_written_whole_or_not_at_all(tmp_path):
    """`files.atomic_write_dir`, behind every export and a joint run's adapter: a failed write leaves the old
    directory as it was and nothing beside it; a finished one replaces it whole."""
    from medusa_train.base.files import _umask, atomic_write_dir

    out = tmp_path / "out"
    atomic_write_dir(out, lambda d: (d / "a.txt").write_text("old"))
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "a.txt").read_text() == "old"

    def broken(d):
        (d / "b.txt").write_text("half")
        raise ValueError("cut short")

    with pytest.raises(ValueError, match="cut short"):
        atomic_write_dir(out, broken)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and sorted(p.name for p in out.iterdir()) == ["a.txt"]
    atomic_write_dir(out, lambda d: (d / "c.txt").write_text("new"))
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and sorted(p.name for p in out.iterdir()) == ["c.txt"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()  # as an ordinary mkdir would make it


def test_exported_files_get_ordinary_permissions(eagle3_dir, tmp_path):
    """safetensors writes its files 0600 and mkdtemp its directories 0700: an export (like the heads themselves) gets
    what an ordinary new file and folder get, so other users of a shared machine can serve it."""
    root, _, _ = eagle3_dir
    plain, folder = tmp_path / "plain.txt", tmp_path / "folder"
    plain.write_text("x")
    folder.mkdir()
    assert main([str(root / "heads"), str(tmp_path / "out"), "--format", "speculators"]) == 0
    assert os.stat(tmp_path / "out").st_mode & 0o777 == os.stat(folder).st_mode & 0o777
    for f in (tmp_path / "out").iterdir():
        assert os.stat(f).st_mode & 0o777 == os.stat(plain).st_mode & 0o777, f


def test_the_export_reads_the_targets_two_tensors_not_the_model(eagle3_dir, tmp_path, monkeypatch):
    """The speculators export needs the target's embedding: it is read from the checkpoint's safetensors alone (the
    model built on the meta device to learn its name), never by loading the whole target (a 70B one is 280 GB in
    float32); a checkpoint of another model is refused by the same fingerprint, in one line."""
    import transformers

    root, target, heads = eagle3_dir

    def no_load(*args, **kwargs):
        raise AssertionError("the export loaded the whole target")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    assert main([str(root / "heads"), str(tmp_path / "out"), "--format", "speculators"]) == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(got, target.get_input_embeddings().weight.detach().float())
    save_tiny(tmp_path / "other", "llama", layers=6, seed=7)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="heads do not fit this target: its embedding weights differ"):
        export(root / "heads", tmp_path / "out2", "speculators", target=str(tmp_path / "other"))


def test_a_target_named_by_hub_id_is_read_from_the_hub_cache_not_loaded(eagle3_dir, tmp_path, monkeypatch):
    """`--target org/name` (the heads' default target_name is a hub id): its two tensors are read from the snapshot
    the Hugging Face cache holds, as for a local directory; the model is never loaded."""
    import huggingface_hub.constants
    import transformers

    root, target, heads = eagle3_dir
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(root / "target", snapshot)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_load(*args, **kwargs):
        raise AssertionError("the export loaded the whole target")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    export(root / "heads", tmp_path / "out", "speculators", target="org/tiny")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(got, target.get_input_embeddings().weight.detach().float())
