"""SGLang's EAGLE3 and DFLASH loaders, read from their own source (sglang 0.5.23, pinned; SGLang does not run on a CPU
machine): every tensor of our `--format eagle3` export maps to a parameter its `LlamaForCausalLMEagle3.load_weights`
loads (it skips a name it does not know without a word, so a renamed tensor would serve a random weight), the config
says what that model reads, its draft layer computes what ours does, and the documented launch line uses flags its
argument parser has; the same for `--format dflash` and its `DFlashDraftModel`. The wheel is downloaded once (no
dependencies, nothing imported) into the project's cache."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_tiny
from wheels import wheel_source

from medusa_train.export import main as export_main
from medusa_train.kinds.heads import DraftHeads

SGLANG = "0.5.23"
ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("sglang/srt/models/llama_eagle3.py", "sglang/srt/models/llama.py", "sglang/srt/arg_groups/fields/",
          "sglang/srt/models/dflash.py")


@pytest.fixture(scope="session")
def sglang_src() -> Path:
    """The few source files of sglang 0.5.23 this test reads, from its wheel."""
    return wheel_source("sglang", SGLANG, NEEDED)


def _literal(source: str, function: str, name: str):
    """The literal assigned to `name` inside `function` (sglang's own tables, read, not copied)."""
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function)
    node = next(n for n in ast.walk(fn) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == name)
    return ast.literal_eval(node.value)


def _assigned(source: str, cls: str) -> set[str]:
    """The attributes `self.X = ...` that class `cls` sets anywhere in its body."""
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def sglang_parameters(src: Path, norms: list[str] = ()) -> set[str]:
    """LlamaForCausalLMEagle3's parameter names for a draft layer with these of the optional norms, each checked
    against the attributes its classes set in 0.5.23's source."""
    eagle3 = (src / NEEDED[0]).read_text()
    llama = (src / NEEDED[1]).read_text()
    assert {"model", "lm_head"} <= _assigned(eagle3, "LlamaForCausalLMEagle3")
    assert {"embed_tokens", "fc", "layers", "norm"} <= _assigned(eagle3, "LlamaModel")
    assert {"hidden_norm"} <= _assigned(eagle3, "LlamaDecoderLayer")
    assert {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"} <= _assigned(llama, "LlamaDecoderLayer")
    assert {"qkv_proj", "o_proj"} <= _assigned(llama, "LlamaAttention")
    assert {"gate_up_proj", "down_proj"} <= _assigned(llama, "LlamaMLP")
    layer = "model.layers.0."
    extra = set()
    if "norm_before_fc" in norms:
        assert "input_norm" in _assigned(eagle3, "LlamaModel")
        extra.add("model.input_norm.weight")
    return extra | {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
            layer + "hidden_norm.weight", layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight",
            layer + "self_attn.qkv_proj.weight", layer + "self_attn.o_proj.weight", layer + "mlp.gate_up_proj.weight",
            layer + "mlp.down_proj.weight"}


def loaded_as(name: str, src: Path, params: set[str]) -> str | None:
    """The parameter sglang's `load_weights` puts tensor `name` into (its steps, with its own tables read from its
    source): legacy names renamed, d2t kept as its hot-token map, t2d dropped, q/k/v and gate/up stacked, `model.`
    prefixed where needed; None where it would skip the tensor without a word."""
    eagle3 = (src / NEEDED[0]).read_text()
    legacy = _literal(eagle3, "load_weights", "legacy_name_map")
    stacked = _literal(eagle3, "load_weights", "stacked_params_mapping")
    for old, new in legacy.items():
        if old in name:
            name = name.replace(old, new)
    if "d2t" in name:
        return "hot_token_id"
    if "t2d" in name:
        return "(dropped)"
    for param_name, weight_name, _ in stacked:
        if weight_name in name:
            name = name.replace(weight_name, param_name)
            break
    name = name if name in params else f"model.{name}"
    return name if name in params else None


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    target = save_tiny(root / "target", "llama", layers=6)
    heads = DraftHeads.for_target(target, "eagle3", 3, target_name=str(root / "target"),
                                  draft_ids=torch.arange(64))
    heads.save_pretrained(root / "heads")
    assert export_main([str(root / "heads"), str(root / "eagle3"), "--format", "eagle3"]) == 0
    return root / "eagle3", heads


def check_export(out: Path, heads: DraftHeads, src: Path) -> list[str]:
    """What sglang 0.5.23 would do wrong with this export (empty: nothing)."""
    params = sglang_parameters(src, heads.spec.norms)
    problems = [f"{n}: skipped by sglang's loader" for n in load_file(str(out / "model.safetensors"))
                if loaded_as(n, src, params) is None]
    loaded = {loaded_as(n, src, params) for n in load_file(str(out / "model.safetensors"))}
    problems += [f"{p}: never loaded" for p in sorted(params - loaded - {"model.embed_tokens.weight"})]
    config = json.loads((out / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLMEagle3"]:
        problems.append(f"architectures {config.get('architectures')}")
    # sglang counts an aux layer by the layer whose output it takes: ours (the input of layer i) minus one
    if config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") != [i - 1 for i in heads.spec.aux_layers]:
        problems.append(f"aux layer ids {config.get('eagle_config')} for heads reading {heads.spec.aux_layers}")
    for flag in ("fc_norm", "use_aux_norm"):  # norms our draft layer never has
        if config.get(flag) or config.get("eagle_config", {}).get(flag):
            problems.append(f"{flag} set")
    for flag in ("norm_before_fc", "norm_output"):  # read from the config's top level (or eagle_config), as trained
        if bool(config.get("eagle_config", {}).get(flag, config.get(flag, False))) != (flag in heads.spec.norms):
            problems.append(f"{flag} is not as trained")
    return problems


def test_norms_sglang_has_export_and_the_one_it_lacks_is_refused(tmp_path, sglang_src, capsys):
    """norm_before_fc and norm_output travel (SGLang reads both, and loads input_norm); SGLang's layer has no
    norm_before_residual, so heads trained with it do not export to its layout: exit 2, one line."""
    target = save_tiny(tmp_path / "target", "llama", layers=6)
    for norms, code in ((["norm_before_fc", "norm_output"], 0), (["norm_before_residual"], 2)):
        heads = DraftHeads.for_target(target, "eagle3", 3, target_name=str(tmp_path / "target"), norms=norms)
        name = "-".join(norms)
        heads.save_pretrained(tmp_path / name)
        capsys.readouterr()
        assert export_main([str(tmp_path / name), str(tmp_path / f"{name}-out"), "--format", "eagle3"]) == code
        if code == 0:
            assert "input_norm.weight" in load_file(str(tmp_path / f"{name}-out" / "model.safetensors"))
            assert check_export(tmp_path / f"{name}-out", heads, sglang_src) == []
        else:
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and "without norm_before_residual" in err, err
            assert err.endswith("(heads.norms=[norm_before_residual]): export them with --format speculators"), err
            assert not (tmp_path / f"{name}-out").exists()


def test_sglang_loads_every_tensor_of_our_eagle3_export(export, sglang_src):
    out, heads = export
    assert check_export(out, heads, sglang_src) == []
    names = load_file(str(out / "model.safetensors"))
    assert {"d2t", "t2d"} <= set(names)  # the draft vocabulary travels, as sglang's hot-token map
    assert loaded_as("midlayer.self_attn.k_proj.weight", sglang_src, sglang_parameters(sglang_src)) == \
        "model.layers.0.self_attn.qkv_proj.weight"


def test_sglangs_draft_layer_adds_the_raw_state_as_its_residual(sglang_src):
    """Our layer (and vLLM's with norm_before_residual false) keeps the fused state itself as the residual and feeds
    its norm to attention: sglang's first layer must do the same, in that order."""
    source = (sglang_src / NEEDED[0]).read_text()
    start = source.index("if self.is_input_layer:")
    block = source[start:source.index("else:", start)]
    assert re.search(r"residual = hidden_states\s+hidden_states = self\.hidden_norm\(hidden_states\)", block), block


@pytest.mark.parametrize("plant", ["renamed tensor", "aux ids not shifted", "a norm flag"])
def test_a_broken_export_is_caught(export, sglang_src, tmp_path, plant):
    out, heads = export
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    if plant == "renamed tensor":
        w = load_file(str(broken / "model.safetensors"))
        w["midlayer.hidden_layernorm.weight"] = w.pop("midlayer.hidden_norm.weight")
        save_file(w, str(broken / "model.safetensors"))
    else:
        config = json.loads((broken / "config.json").read_text())
        if plant == "aux ids not shifted":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = heads.spec.aux_layers
        else:  # the flag says the opposite of how the heads were trained
            config["norm_before_fc"] = not config["norm_before_fc"]
        (broken / "config.json").write_text(json.dumps(config))
    assert check_export(broken, heads, sglang_src) != []


def test_the_readme_launch_line_uses_flags_sglang_has(sglang_src):
    """sglang builds its command line from dataclass fields (`arg_groups/fields/*.py`, `--` + the name with dashes,
    plus aliases); every flag of the two `sglang.launch_server` lines of docs/serving.md (the README's "Serve" goes on
    there) must be one, and EAGLE3 and DFLASH algorithms its help names."""
    fields: set[str] = set()
    spec_help = ""
    for path in (sglang_src / NEEDED[2]).glob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                segment = ast.get_source_segment(source, node) or ""
                if "no_cli=True" in segment:
                    continue
                fields.add("--" + node.target.id.replace("_", "-"))
                aliases = re.search(r"aliases=\[([^\]]*)\]", segment)
                if aliases:
                    fields.update(re.findall(r'"(--[\w-]+)"', aliases.group(1)))
                if node.target.id == "speculative_algorithm":
                    spec_help = segment
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "serving.md").read_text()
    lines = re.findall(r"python -m sglang\.launch_server((?:[^\n]*\\\n)*[^\n]*)", readme)  # with continuations
    assert len(lines) == 2  # EAGLE3 and DFLASH
    for line in lines:
        flags = set(re.findall(r"(--[\w-]+)", line))
        assert {"--model-path", "--speculative-algorithm", "--speculative-draft-model-path"} <= flags
        assert flags - fields == set()
        algorithm = re.search(r"--speculative-algorithm (\w+)", line).group(1)
        assert algorithm in ("EAGLE3", "DFLASH") and algorithm in spec_help, algorithm


def sglang_dflash_parameters(src: Path, num_layers: int) -> set[str]:
    """DFlashDraftModel's parameter names (0.5.23) for a drafter of `num_layers` layers, checked against the
    attributes its classes set; the LM head and the embedding are the target's."""
    dflash = (src / NEEDED[3]).read_text()
    assert {"embed_tokens", "layers", "norm", "fc", "hidden_norm"} <= _assigned(dflash, "DFlashDraftModel")
    layer = _assigned(dflash, "DFlashDecoderLayer")
    assert {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"} <= layer
    assert {"qkv_proj", "o_proj", "q_norm", "k_norm"} <= _assigned(dflash, "DFlashAttention")
    assert {"gate_up_proj", "down_proj"} <= _assigned(dflash, "DFlashMLP")
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "self_attn.q_norm",
            "self_attn.k_norm", "mlp.gate_up_proj", "mlp.down_proj")}
    return names


def dflash_loaded_as(name: str, src: Path, params: set[str]) -> str | None:
    """Where DFlashDraftModel.load_weights puts tensor `name`: q/k/v and gate/up stacked (its own table, read from its
    source); None where it skips it without a word."""
    stacked = _literal((src / NEEDED[3]).read_text(), "load_weights", "stacked_params_mapping")
    for param_name, weight_name, _ in stacked:
        if f".{weight_name}." in name:
            name = name.replace(weight_name, param_name)
            break
    return name if name in params else None


def check_dflash_export(out: Path, heads: DraftHeads, src: Path) -> list[str]:
    """What sglang 0.5.23 would do wrong with this `--format dflash` export (empty: nothing)."""
    params = sglang_dflash_parameters(src, heads.spec.layers_per_head)
    names = load_file(str(out / "model.safetensors"))
    problems = [f"{n}: skipped by sglang's loader" for n in names if dflash_loaded_as(n, src, params) is None]
    problems += [f"{p}: never loaded" for p in sorted(params - {dflash_loaded_as(n, src, params) for n in names})]
    config = json.loads((out / "config.json").read_text())
    dflash = config.get("dflash_config", {})
    if config.get("architectures") != ["DFlashDraftModel"]:
        problems.append(f"architectures {config.get('architectures')}")
    # DFlash's target_layer_ids count the layer whose output is taken: ours (the input of layer i) minus one
    if dflash.get("target_layer_ids") != [i - 1 for i in heads.spec.aux_layers]:
        problems.append(f"target_layer_ids {dflash.get('target_layer_ids')} for heads reading {heads.spec.aux_layers}")
    if dflash.get("mask_token_id") != heads.spec.mask_token_id or config.get("block_size") != heads.spec.num_heads + 1:
        problems.append(f"mask token {dflash.get('mask_token_id')} / block {config.get('block_size')} not as trained")
    # every layer full attention and nothing saying causal: sglang runs them as ENCODER_ONLY (non-causal), as trained
    if config.get("layer_types") != ["full_attention"] * heads.spec.layers_per_head or config.get("is_causal"):
        problems.append(f"layer_types {config.get('layer_types')}, is_causal {config.get('is_causal')}")
    return problems


@pytest.fixture(scope="module")
def dflash_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-dflash")
    target = save_tiny(root / "target", "llama", layers=6)
    heads = DraftHeads.for_target(target, "dflash", 5, 2, target_name=str(root / "target"), mask_token_id=257)
    heads.save_pretrained(root / "heads")
    assert export_main([str(root / "heads"), str(root / "dflash"), "--format", "dflash"]) == 0
    return root, heads


def test_sglang_loads_every_tensor_of_our_dflash_export(dflash_export, sglang_src):
    root, heads = dflash_export
    assert check_dflash_export(root / "dflash", heads, sglang_src) == []
    names = load_file(str(root / "dflash" / "model.safetensors"))
    assert "lm_head.weight" not in names and "embed_tokens.weight" not in names  # the target's, shared


@pytest.mark.parametrize("plant", ["renamed tensor", "ids not shifted", "causal"])
def test_a_broken_dflash_export_is_caught(dflash_export, sglang_src, tmp_path, plant):
    root, heads = dflash_export
    broken = tmp_path / "broken"
    shutil.copytree(root / "dflash", broken)
    if plant == "renamed tensor":
        w = load_file(str(broken / "model.safetensors"))
        w["context_norm.weight"] = w.pop("hidden_norm.weight")
        save_file(w, str(broken / "model.safetensors"))
    else:
        config = json.loads((broken / "config.json").read_text())
        if plant == "ids not shifted":
            config["dflash_config"]["target_layer_ids"] = heads.spec.aux_layers
        else:
            config["is_causal"] = True
        (broken / "config.json").write_text(json.dumps(config))
    assert check_dflash_export(broken, heads, sglang_src) != []


def test_dflash_heads_with_a_draft_vocabulary_are_refused_for_sglang(dflash_export, tmp_path, capsys):
    """SGLang's DFlash drafter scores with the target's LM head and reads no vocabulary map: heads with a draft
    vocabulary export to speculators' format only, and the refusal says so in one line."""
    root, _ = dflash_export
    heads = DraftHeads.for_target(save_tiny(tmp_path / "t", "llama", layers=6), "dflash", 3,
                                  draft_ids=torch.arange(64), target_name=str(tmp_path / "t"))
    heads.save_pretrained(tmp_path / "heads")
    capsys.readouterr()
    assert export_main([str(tmp_path / "heads"), str(tmp_path / "out"), "--format", "dflash"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("export them with --format speculators"), err
    assert not (tmp_path / "out").exists()
