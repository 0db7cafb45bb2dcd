"""dflash heads: random anchors, the anchored training forward and loss against the dense ones, exact greedy output
with trained heads on every tree, sampling, and the trainer end to end. (The drafter's nodes against the training
forward: tests/test_drafting.py; the exports: test_export.py and test_sglang.py; every architecture:
test_architectures.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from runs import config, write_text_data
from fitted import exact_on_every_tree, fitted
from test_inference_greedy import float64_model
from tiny import save_tiny, tiny_tokenizer

from inference import HeadsDrafter, SpeculativeGenerator
from medusa_train.config import LossConfig
from medusa_train.kinds.dflash import resolve_mask_token, sample_anchors
from medusa_train.kinds.heads import DraftHeads
from medusa_train.train.losses import anchored_head_losses, chunked_head_losses
from medusa_train.target.model import target_hidden
from medusa_train.train.trainer import train

ARCHS = ["llama", "qwen2", "mistral"]


def _heads(model, K: int = 4, layers: int = 2, draft: int = 0, seed: int = 0) -> DraftHeads:
    draft_ids = torch.arange(0, 260, 260 // draft) if draft else None
    heads = DraftHeads.for_target(model, "dflash", K, layers, draft_ids=draft_ids)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return heads.double()


def _batch(model, heads, T: int = 22):
    """Two rows, the second right-padded from position 16, its prompt unsupervised."""
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 16:] = 0
    labels = ids.clone()
    labels[:, :4] = -100
    labels[mask == 0] = -100
    feats = target_hidden(model, ids, mask, heads.target_layers)
    greedy = model.get_output_embeddings()(feats[..., :model.config.hidden_size]).argmax(-1)
    return ids, mask, labels, feats, greedy


def test_anchored_blocks_compute_what_the_dense_forward_does_at_those_positions():
    """Blocks after some positions, run together, give what the forward with a block after every position gives
    there: each block attends to the context up to its anchor and to itself, never to another block or to padding."""
    model = float64_model("llama", seed=1)
    heads = _heads(model)
    ids, mask, labels, feats, _ = _batch(model, heads)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        dense = heads.dflash_states(feats, ids, torch.arange(22).expand(2, 22), mask, embed)  # [K, B, T, d]
        anchors = torch.tensor([[0, 3, 4, 9, 17], [1, 2, 8, 12, 15]])
        some = heads.dflash_states(feats, ids, anchors, mask, embed)
    for b in range(2):
        torch.testing.assert_close(some[:, b], dense[:, b, anchors[b]], rtol=0, atol=1e-6)
    # a block past the padding of row 1 sees only the real context: the padded positions' states change nothing
    noisy = feats.clone()
    noisy[1, 16:] += 5.0
    with torch.no_grad():
        again = heads.dflash_states(noisy, ids, anchors, mask, embed)
    assert torch.equal(again[:, 1], some[:, 1])


def test_the_anchored_loss_with_every_position_is_the_dense_loss():
    """Training on anchors gathers, per head, the data token, the teacher's distribution and the weights the dense loss
    reads by shifting: with an anchor at every position the two losses and their statistics agree."""
    model = float64_model("qwen2", seed=3)
    heads = _heads(model, draft=4)
    ids, mask, labels, feats, greedy = _batch(model, heads)
    cfg = LossConfig(distill_weight=1.0, ce_weight=0.5, decay=0.8, chunk_size=7)
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    h = feats[..., :model.config.hidden_size]
    anchors = torch.arange(22).expand(2, 22)
    states = heads.dflash_states(feats, ids, anchors, mask, embed)
    dense_loss, dense_stats = chunked_head_losses(heads, states, h, greedy, ids, labels, mask, lm_head, cfg)
    loss, stats = anchored_head_losses(heads, states, anchors, torch.ones(2, 22, dtype=torch.bool), h, greedy, ids,
                                       labels, mask, lm_head, cfg)
    torch.testing.assert_close(loss, dense_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(stats, dense_stats, rtol=1e-6, atol=1e-6)
    # invalid anchors count for nothing: the same anchors twice, the second copy marked invalid
    twice = torch.cat([anchors, anchors], dim=1)
    valid = torch.cat([torch.ones(2, 22, dtype=torch.bool), torch.zeros(2, 22, dtype=torch.bool)], dim=1)
    loss2, stats2 = anchored_head_losses(heads, torch.cat([states, states], dim=2), twice, valid, h, greedy, ids,
                                         labels, mask, lm_head, cfg)
    torch.testing.assert_close(loss2, dense_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(stats2, dense_stats, rtol=1e-6, atol=1e-6)


def test_anchors_are_distinct_sorted_supervised_and_redrawn():
    supervised = torch.zeros(3, 12, dtype=torch.bool)
    supervised[0, 5:] = True  # candidates t with x_{t+2} supervised: 3..9
    supervised[1, 2:4] = True  # candidates 0, 1: two real anchors, the rest padding
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(20):
        anchors, valid = sample_anchors(supervised, 4, gen)
        assert anchors.shape == valid.shape == (3, 4)
        row = anchors[0].tolist()
        assert valid[0].all() and row == sorted(row) and len(set(row)) == 4 and set(row) <= set(range(3, 10))
        seen.add(tuple(row))
        assert valid[1].tolist() == [True, True, False, False] and anchors[1, :2].tolist() == [0, 1]
        assert not valid[2].any()
    assert len(seen) > 5  # redrawn: different anchors from call to call


def test_the_mask_token_comes_from_the_tokenizer_as_speculators_picks_it_skipping_zero_rows():
    """speculators' order (the tokenizer's mask token, a spare embedding row, pad, EOS, unknown), passing over a row
    of zeros (a padding row: the mask slots would get no input, and the first layer could not tell them apart)."""
    tok = tiny_tokenizer()  # no mask token; pad 259, EOS 258
    embedding = torch.randn(260, 8)
    assert resolve_mask_token(tok, embedding) == tok.pad_token_id == 259
    assert resolve_mask_token(tok, torch.randn(300, 8)) == 260  # the first embedding row no token uses
    embedding[259] = 0.0  # the pad row of a model with padding_idx
    assert resolve_mask_token(tok, embedding) == tok.eos_token_id == 258
    assert resolve_mask_token(tok, embedding, explicit=7) == 7
    for bad, message in ((259, "all zeros"), (260, "has 260 rows")):
        with pytest.raises(ValueError, match=message):
            resolve_mask_token(tok, embedding, explicit=bad)
    model = float64_model("llama", seed=0)  # pad 259 is its padding_idx: a zero row
    assert not model.get_input_embeddings().weight[259].any()
    assert DraftHeads.for_target(model, "dflash", 2).spec.mask_token_id == 258


def _trained_dflash(model, K: int = 4, iters: int = 90) -> tuple[DraftHeads, torch.Tensor]:
    heads = DraftHeads.for_target(model, "dflash", K, 2).double()
    return fitted(model, heads, iters, lr=1.5e-2)  # max tau 2.5 / 1.8 / 2.7 on llama / qwen2 / mistral


@pytest.mark.parametrize("arch", ARCHS)
def test_dflash_greedy_output_is_the_targets_on_every_tree_and_with_lookup(arch):
    model = float64_model(arch, seed=0)
    heads, prompts = _trained_dflash(model)
    taus = exact_on_every_tree(model, heads, prompts[:1])
    assert max(taus) > 1.5, taus  # drafts were accepted: the checks crossed accepted paths


def test_dflash_sampling_runs_through_the_same_drafter():
    """Temperature > 0 with dflash heads (the distribution itself is tested in test_inference_sampling): the same seed
    gives the same output from one generate call to the next, so nothing of a sequence outlives its call."""
    model = float64_model("llama", seed=0)
    heads, prompts = _trained_dflash(model, iters=40)
    gen = SpeculativeGenerator(model, tiny_tokenizer(), HeadsDrafter(heads, model))
    assert isinstance(gen.drafter, HeadsDrafter) and not gen.drafter.chained
    a = gen.generate(prompts[1:2], max_new_tokens=20, temperature=0.8, seed=5, tree_budget=4, eos_token_id=[])
    gen.generate(prompts[2:3], max_new_tokens=9, temperature=0.8, seed=1, tree_budget=4, eos_token_id=[])
    b = gen.generate(prompts[1:2], max_new_tokens=20, temperature=0.8, seed=5, tree_budget=4, eos_token_id=[])
    assert a.token_ids.tolist() == b.token_ids.tolist() and len(a.token_ids) == 20


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-train")
    save_tiny(root / "model", "llama")
    write_text_data(root / "text.jsonl")
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}}}\n"
        "heads: {kind: dflash, num_heads: 3, layers_per_head: 2, draft_vocab_size: 64, anchors: 8}\n"
        f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24, eval_size: 4}}\n"
        "train: {batch_size: 4, lr: 3.0e-3, warmup_steps: 2, log_every: 4, seed: 0}\n"
        "loss: {distill_weight: 1.0, ce_weight: 0.5, chunk_size: 32}\n"
        "eval: {max_batches: 2}\n")
    return root


def test_dflash_heads_train_through_the_same_loop_cache_their_layers_and_resume(ws, tmp_path, monkeypatch):
    """heads.kind=dflash through the ordinary trainer: every trainable parameter moves (the LM head, the target's rows,
    stays), the target stays bit-identical, the hidden-state cache changes nothing, the saved heads record the mask
    token the tokenizer gave and the layers, and resuming from step 6 ends where the uninterrupted run ends (the anchors
    are drawn from the checkpointed random state)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    plain = train(config(ws, "plain", "train.max_steps=12", "train.save_every=6"))
    fresh = DraftHeads.for_target(plain.target, "dflash", 3, 2, mask_token_id=258)
    trained = dict(plain.heads.named_parameters())
    for name, p0 in fresh.named_parameters():
        moved = not torch.equal(p0, trained[name].detach().cpu())
        assert moved == p0.requires_grad or name == "dflash.lm_head.weight", name
    on_disk = AutoModelForCausalLM.from_pretrained(ws / "model", dtype=torch.float32).state_dict()
    assert all(torch.equal(w, plain.target.state_dict()[k]) for k, w in on_disk.items())
    spec = json.loads((ws / "plain" / "config.json").read_text())
    # the tokenizer's pad (259) is the model's padding row, all zeros: its EOS instead
    assert spec["kind"] == "dflash" and spec["mask_token_id"] == 258 and spec["aux_layers"] == [1, 2]
    assert spec["layer_config"]["num_hidden_layers"] == 2 and spec["layer_config"]["model_type"] == "qwen3"
    metrics = [json.loads(x) for x in (ws / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/head3/top1_target" in m for m in metrics) and any("eval/expected_tau" in m for m in metrics)

    cached = train(config(ws, "cached", "train.max_steps=12", f"train.hidden_cache_dir={tmp_path / 'h'}"))
    resumed = train(config(ws, "plain", "train.max_steps=12", "resume=" + str(ws / "plain" / "checkpoints" / "step-6")))
    final = load_file(str(ws / "plain" / "model.safetensors"))
    for other in (cached, resumed):
        assert other.step == 12
        state = other.heads.state_dict()
        assert max((final[k] - v.detach().cpu()).abs().max().item() for k, v in state.items()) <= 1e-6
    drafter = HeadsDrafter.from_pretrained(ws / "plain", plain.target)
    assert isinstance(drafter, HeadsDrafter) and drafter.target_layers == (1, 2)
