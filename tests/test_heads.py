"""Heads on their own: the two chained blocks, the sensible start, and the mlp_speculator export."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny import tiny_model

from medusa_train.kinds.heads import DraftHeads


def test_untrained_residual_and_parallel_heads_start_as_the_targets_own_guess():
    target = tiny_model("llama")
    h = torch.randn(2, 7, 32)
    ids = torch.randint(0, 260, (2, 7))
    for kind in ("chained", "parallel"):
        heads = DraftHeads.for_target(target, kind, 3)
        states = heads(h, ids, target.get_input_embeddings())
        assert torch.equal(states, h.expand(3, -1, -1, -1)), kind
    # parallel heads read no tokens, so they need no embedding
    assert torch.equal(DraftHeads.for_target(target, "parallel", 3)(h, ids), h.expand(3, -1, -1, -1))


def test_mlp_speculator_export_reproduces_the_heads(tmp_path):
    """Running vLLM's mlp_speculator math on the exported tensors gives our chained heads' logits."""
    torch.manual_seed(0)
    target = tiny_model("llama")
    heads = DraftHeads.for_target(target, "chained", 3, block="mlp_speculator")
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    heads.export_mlp_speculator(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    w = load_file(str(tmp_path / "model.safetensors"))
    assert cfg["model_type"] == "mlp_speculator" and cfg["n_predict"] == 3 and cfg["emb_dim"] == 32
    assert w["emb.0.weight"].shape == (260, 32) and w["head.2.weight"].shape == (260, 32)

    h, tokens = torch.randn(5, 32), torch.randint(0, 260, (5, 3))
    n = cfg["n_predict"]
    state_weight = 0.5 ** (0.5 / n)
    emb_weight = (1 - state_weight**2) ** 0.5 * (cfg["inner_dim"] / 2) ** 0.5
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    s = rms(h) / 2**0.5  # scale_input
    s_ours = heads.start(h)
    for k in range(n):
        z = F.embedding(tokens[:, k], w[f"emb.{k}.weight"])
        s = s @ w[f"proj.{k}.weight"].t() + z * (emb_weight / state_weight)
        s = F.gelu(rms(s) * w[f"ln.{k}.weight"] + w[f"ln.{k}.bias"])
        s_ours = heads.step(k, s_ours, tokens[:, k], target.get_input_embeddings())
        ours = heads.logits(k, s_ours, target.get_output_embeddings())
        torch.testing.assert_close(s @ w[f"head.{k}.weight"].t(), ours, atol=1e-5, rtol=1e-5)


def test_export_refuses_heads_it_cannot_represent(tmp_path):
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="heads.block=mlp_speculator"):
        DraftHeads.for_target(target, "chained", 2).export_mlp_speculator(tmp_path, target)


def test_saved_heads_are_readable_by_others_like_any_new_file(tmp_path):
    """safetensors creates its files 0600; the heads (and every atomic write) get what an ordinary new file gets."""
    import os

    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    want = os.stat(plain).st_mode & 0o777
    DraftHeads.for_target(tiny_model("llama"), "chained", 2).save_pretrained(tmp_path / "heads")
    for name in ("model.safetensors", "config.json"):
        assert os.stat(tmp_path / "heads" / name).st_mode & 0o777 == want, name


@pytest.mark.parametrize("kind", ["chained", "parallel", "eagle3", "dflash"])
def test_heads_saved_before_the_kinds_had_options_of_their_own_load_as_they_were(tmp_path, kind):
    """Heads saved before the kinds had modules kept every kind's fields flat in config.json (a chained spec held
    aux_layers [], norms [], mask_token_id -1; eagle3 heads before the norms held none): they load, each kind taking
    its own fields and passing over the others', with the same weights and the same states; saved again, config.json
    holds only its own kind's options."""
    from medusa_train.kinds import KINDS

    target = tiny_model("llama")
    heads = DraftHeads.for_target(target, kind, 2, norms=[]) if kind == "eagle3" else DraftHeads.for_target(
        target, kind, 2)
    heads.save_pretrained(tmp_path / "new")
    raw = json.loads((tmp_path / "new" / "config.json").read_text())
    old = {"layers_per_head": 1, "block": "residual", "own_embed": False, "own_lm_head": False,
           "draft_vocab_size": 0, "context_layers": 0, "aux_layers": [], "layer_config": {}, "mask_token_id": -1,
           "norms": []} | raw
    old.pop("anchors", None)  # dflash heads before heads.anchors was saved
    if kind == "eagle3":
        old.pop("norms")  # eagle3 heads before the norms
    (tmp_path / "new" / "config.json").write_text(json.dumps(old))
    back = DraftHeads.from_pretrained(tmp_path / "new", target)
    assert type(back) is KINDS[kind]
    own = {f.name for f in dataclasses.fields(KINDS[kind].Options)}
    common = {f.name for f in dataclasses.fields(back.spec)} - {"options"}
    assert set(raw) == set(back.spec.to_json()) == common | own  # saved: its own kind's options, none of the others'
    for name in own - {"anchors"}:
        assert getattr(back.spec, name) == getattr(heads.spec, name), name
    h = torch.randn(1, 6, back.feature_size)
    ids = torch.randint(0, 260, (1, 6))
    embed = target.get_input_embeddings()
    torch.testing.assert_close(back(h, ids, embed), heads(h, ids, embed))
    if kind == "eagle3":
        assert back.spec.norms == []
