"""train.optimizer=muon: torch's Muon on the heads' hidden weight matrices, AdamW on the rest, as one optimizer that
resumes exactly."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from runs import config, max_diff, write_text_data

from medusa_train.config import ConfigError
from medusa_train.kinds.heads import DraftHeads
from medusa_train.train.optim import MuonAdamW, muon_matrices, param_groups
from medusa_train.train.trainer import train


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("muon")
    save_tiny(root / "model", "llama")
    write_text_data(root / "text.jsonl")
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}}}\n"
        "heads: {num_heads: 3, kind: eagle3, draft_vocab_size: 64}\n"
        f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24, eval_size: 0}}\n"
        "train: {batch_size: 4, lr: 3.0e-3, warmup_steps: 2, weight_decay: 0.1, optimizer: muon, log_every: 2}\n"
        "eval: {every: 0}\n")
    return root


def _named(heads, params):
    names = {id(p): n for n, p in heads.named_parameters()}
    return sorted(names[id(p)] for p in params)


def test_muon_takes_the_hidden_matrices_and_adamw_the_vocabulary_and_the_vectors():
    from tiny import tiny_model

    model = tiny_model()
    eagle3 = DraftHeads.for_target(model, "eagle3", 3, draft_ids=torch.arange(0, 260, 2))
    hidden = _named(eagle3, muon_matrices(eagle3))
    assert "eagle3.fc.weight" in hidden and "eagle3.layers.0.mlp.down_proj.weight" in hidden and len(hidden) == 8
    # chained heads with their own embedding and LM heads: those are the vocabulary's rows, AdamW's
    chained = DraftHeads.for_target(model, "chained", 3, own_embed=True, own_lm_head=True, context_layers=1)
    groups = param_groups(chained, 0.1, muon=True)
    muon = _named(chained, groups[0]["params"])
    assert groups[0]["muon"] and not any(g.get("muon") for g in groups[1:])
    assert muon and all("lm_head" not in n and "embed" not in n for n in muon)
    adamw = [n for g in groups[1:] for n in _named(chained, g["params"])]
    assert any("lm_heads" in n for n in adamw) and "embed.weight" in adamw
    assert sorted(muon + adamw) == sorted(n for n, p in chained.named_parameters() if p.requires_grad)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1, 0.0]  # vectors are never decayed


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, None])
def test_each_step_is_torchs_muon_on_the_matrices_and_torchs_adamw_on_the_rest(ns_dtype):
    """Three steps of MuonAdamW under a schedule, saved and loaded halfway, against torch.optim.Muon (lr matched to
    AdamW's update RMS) and torch.optim.AdamW run side by side on copies: the same weights, with the Newton-Schulz
    iteration in bfloat16 as torch runs it; in float32 (ours on a CPU) within bfloat16's rounding of them."""
    from tiny import tiny_model

    heads = DraftHeads.for_target(tiny_model(), "eagle3", 3, draft_ids=torch.arange(0, 260, 2))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ref, start = copy.deepcopy(heads), copy.deepcopy(heads)
    lr, wd, half = 0.02, 0.1, (lambda step: 0.5 ** step)
    opt = MuonAdamW(param_groups(heads, wd, muon=True), lr=lr, ns_dtype=ns_dtype)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [half] * len(opt.param_groups))
    groups = param_groups(ref, wd, muon=True)
    muon = torch.optim.Muon(groups[0]["params"], lr=lr, weight_decay=wd, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(groups[1:], lr=lr)
    refs = [torch.optim.lr_scheduler.LambdaLR(o, [half] * len(o.param_groups)) for o in (muon, adamw)]
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in heads.parameters()]
        for model, rows in ((heads, grads), (ref, grads)):
            for p, g in zip(model.parameters(), rows):
                p.grad = g.clone() if p.requires_grad else None
        opt.step()
        sched.step()
        for o, s in zip((muon, adamw), refs):
            o.step()
            s.step()
        if step == 0:  # a checkpoint: a fresh optimizer and schedule take the saved states
            state, sched_state = copy.deepcopy(opt.state_dict()), sched.state_dict()
            opt = MuonAdamW(param_groups(heads, wd, muon=True), lr=lr, ns_dtype=ns_dtype)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, [half] * len(opt.param_groups))
            opt.load_state_dict(state)
            sched.load_state_dict(sched_state)
    assert all(not torch.equal(p, p0) for p, p0 in zip(heads.parameters(), start.parameters()) if p.requires_grad)
    muon_ids = {id(p) for p in muon_matrices(heads)}
    for (name, p), q in zip(heads.named_parameters(), ref.parameters()):
        # bfloat16 keeps 8 bits: the float32 iteration lands within a few of its roundings of an lr-sized update
        atol = 1e-6 if ns_dtype is not None or id(p) not in muon_ids else 0.05 * lr
        torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=name)
    if ns_dtype is None:  # and it is not bfloat16's: the float32 iteration ran
        assert any(not torch.equal(p, q) for p, q in zip(muon_matrices(heads), muon_matrices(ref)))


def test_a_muon_run_resumes_where_it_stopped_and_differs_from_adamw(ws):
    full = train(config(ws, "muon12", "train.max_steps=12", "train.save_every=6", "train.keep_best=last"))
    assert full.step == 12
    shutil.copytree(ws / "muon12" / "checkpoints" / "step-6", ws / "resumed" / "checkpoints" / "step-6")
    resumed = train(config(ws, "resumed", "train.max_steps=12", "train.save_every=6", "train.keep_best=last"))
    assert resumed.step == 12 and max_diff(ws / "muon12", ws / "resumed") <= 1e-6
    train(config(ws, "adamw12", "train.max_steps=12", "train.optimizer=adamw", "train.keep_best=last"))
    assert max_diff(ws / "muon12", ws / "adamw12") > 1e-3
    with pytest.raises(ConfigError, match=r"train.optimizer='adamw' \(the checkpoint has 'muon'\)"):
        train(config(ws, "resumed", "train.max_steps=14", "train.optimizer=adamw"))


def test_auto_trains_eagle3_with_muon_and_a_checkpoint_from_before_the_key_resumes_with_adamw(ws, tmp_path):
    """train.optimizer: auto resolves when the recipe loads (recipe.yaml records which); a checkpoint whose recipe has
    no train.optimizer (written before it existed, with AdamW) is refused by a run that would load its AdamW state
    into Muon, naming the key, and taken by one with train.optimizer=adamw."""
    import yaml

    from medusa_train.train.checkpoints import RECIPE_NAME, check_resumable

    assert config(ws, "auto", "train.optimizer=auto").train.optimizer == "muon"
    chained = config(ws, "auto", "train.optimizer=auto", "heads.kind=chained", "heads.draft_vocab_size=0")
    assert chained.train.optimizer == "adamw"
    old = config(ws, "old", "train.optimizer=adamw").to_dict()
    del old["train"]["optimizer"]
    (tmp_path / RECIPE_NAME).write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError, match=r"train.optimizer='muon' \(the checkpoint has 'adamw'\)"):
        check_resumable(config(ws, "old", "train.optimizer=auto"), tmp_path)
    assert check_resumable(config(ws, "old", "train.optimizer=adamw"), tmp_path) == []


def test_muon_lr_moves_the_hidden_matrices_lr_alone_and_is_refused_without_muon(ws):
    """train.muon_lr is the Muon group's lr (the schedule applies to it as to the others); AdamW's groups keep
    train.lr; 0 (the default) resolves on load to 5 x train.lr, which recipe.yaml then records; set on a run that
    trains with AdamW it is refused, naming the key, and a run with AdamW keeps it 0."""
    from tiny import tiny_model

    from medusa_train.train.optim import build_optimizer

    heads = DraftHeads.for_target(tiny_model(), "eagle3", 3, draft_ids=torch.arange(0, 260, 2))
    assert config(ws, "lr").train.muon_lr == pytest.approx(1.5e-2)
    assert config(ws, "lr", "train.optimizer=adamw").train.muon_lr == 0
    for overrides, muon_lr in (([], 1.5e-2), (["train.muon_lr=0.02"], 0.02)):
        optimizer, _ = build_optimizer(config(ws, "lr", *overrides), heads, None, total_steps=10)
        (muon, *adamw) = [(g["muon"], g["initial_lr"]) for g in optimizer.param_groups]
        assert muon == (True, pytest.approx(muon_lr)) and adamw and all(group == (False, 3e-3) for group in adamw)
    for bad, match in ((["train.optimizer=adamw", "train.muon_lr=0.02"], "train.muon_lr is Muon's lr"),
                       (["train.muon_lr=-1"], "train.muon_lr must be >= 0")):
        with pytest.raises(ConfigError, match=match):
            config(ws, "bad", *bad)
