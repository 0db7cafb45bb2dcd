"""dspark heads: the loss terms DSpark adds (total variation, the Markov head's columns, the confidence head), exact
greedy output with fitted heads on every tree, the trainer end to end with DSpark's own objective, and its export.
(The drafter's nodes against the training forward: tests/test_drafting.py; sampling: test_inference_sampling.py;
served by vLLM: test_vllm.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from fitted import exact_on_every_tree, fitted
from runs import config, write_text_data
from test_inference_greedy import float64_model
from tiny import save_tiny

from inference import HeadsDrafter
from medusa_train.config import ConfigError, LossConfig, load_config
from medusa_train.kinds.heads import DraftHeads
from medusa_train.train.losses import FusedHeadLoss, HeadsObjective
from medusa_train.target.model import target_hidden
from medusa_train.train.trainer import train


def test_the_fused_loss_takes_total_variation_and_extra_columns_as_autograd_does():
    """FusedHeadLoss with loss.tv_weight and a kind's extra scoring columns (dspark's Markov head): its loss, its
    analytic gradients (states, LM head, and the extra matrix through its buffer) and its acceptance rates equal
    autograd's through TV = 1 - sum_v min(p_v, q_v) and logits s[:, :d] W^T + s[:, d:] E^T."""
    g = torch.Generator().manual_seed(0)
    n, d, r, V = 7, 5, 3, 13
    states = torch.randn(n, d + r, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    extra = torch.randn(V, r, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)
    target = torch.randint(0, V, (n,), generator=g)
    pos_weight = torch.rand(n, generator=g, dtype=torch.float64)
    pos_weight[2] = 0.0  # a position outside the loss
    buffer = torch.zeros(V, r, dtype=torch.float64)
    loss, kl, ce, _, tv, accept = FusedHeadLoss.apply(states, weight, teacher, target, pos_weight, 0.3, 0.2, None,
                                                      None, 0.9, extra.detach(), buffer, True)
    loss.backward()
    got = states.grad.clone(), weight.grad.clone()
    states.grad = weight.grad = None
    logq = torch.log_softmax(states[:, :d] @ weight.t() + states[:, d:] @ extra.t(), -1)
    p, q = teacher.exp(), logq.exp()
    ref_tv = 0.5 * (p - q).abs().sum(-1)
    ref = (pos_weight * (0.3 * (p * (teacher - logq)).sum(-1) - 0.2 * logq.gather(-1, target[:, None])[:, 0]
                         + 0.9 * ref_tv)).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(got[0], states.grad)
    torch.testing.assert_close(got[1], weight.grad)
    torch.testing.assert_close(buffer, extra.grad)
    torch.testing.assert_close(accept, 1 - ref_tv.detach())
    torch.testing.assert_close(tv, (ref_tv * (pos_weight != 0)).sum().detach())


def test_dspark_greedy_output_is_the_targets_on_every_tree_and_with_lookup():
    """Heads fitted to the target's continuations (the Markov head moved off zero) draft trees whose accepted paths
    run through nodes the Markov bias ranked; the output is the target's on every tree, with lookup grafted on too."""
    model = float64_model("qwen2", seed=0)
    heads, prompts = fitted(model, DraftHeads.for_target(model, "dspark", 4, 2, markov_rank=16).double(), 90,
                            lr=1.5e-2)  # max tau 1.9
    assert heads.dflash.markov_head.markov_w2.weight.abs().max() > 0.1
    taus = exact_on_every_tree(model, heads, prompts[:1])
    assert max(taus) > 1.5, taus  # drafts were accepted: the checks crossed accepted paths


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_the_engine_reads_the_confidence_head_for_each_parents_best_child(tree):
    """A trimmed step's tree carries each node's confidence, the head's sigmoid(proj([s_k; markov_w1[parent's
    token]])) as the training forward computes it after the node's parent's path; the calibrated trim keys each
    parent's best child by its confidence bin (kind "confident", whose prior is the bin's centre) and the other
    children by their own probability, as before."""
    from test_drafting import draft_context, drafting_model, path_nodes

    from inference.engine.calibrate import CONFIDENT, SCORED, AcceptanceCalibrator

    model = drafting_model("llama", seed=1)
    heads = DraftHeads.for_target(model, "dspark", 3, markov_rank=8).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    committed = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    drafter = HeadsDrafter(heads.eval(), model)
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    ctx = draft_context(model, drafter, committed, paths if tree == "static" else tree, len(paths))
    assert drafter.draft(ctx).confidence is None  # untrimmed (a GPU's step): not computed
    ctx.trimmed = True
    got = drafter.draft(ctx)
    assert torch.isnan(got.confidence[0])
    for i in range(1, got.size):
        path = [int(got.tokens[j]) for j in path_nodes(got, i)[1:-1]]
        seq = torch.tensor([committed + path])
        with torch.no_grad():
            states = heads(target_hidden(model, seq, torch.ones_like(seq), heads.target_layers), seq,
                           model.get_input_embeddings())
            want = torch.sigmoid(heads.confidence(len(path), states[len(path), 0, len(committed) - 2]))
        assert float(got.confidence[i].detach()) == pytest.approx(float(want), rel=1e-6), i
    calibrator = AcceptanceCalibrator(max_depth=3)
    kind, rest = divmod(calibrator.keys(got).numpy(), calibrator.max_depth * calibrator.bins)
    cell = rest % calibrator.bins
    logq = (got.scores - got.scores[got.parents]).detach().numpy()
    for i in range(1, got.size):
        siblings = [j for j in range(1, got.size) if got.parents[j] == got.parents[i]]
        best = max(siblings, key=lambda j: logq[j])
        assert kind[i] == (CONFIDENT if i == best else SCORED), i
        if i == best:
            assert cell[i] == min(int(float(got.confidence[i].detach()) * calibrator.bins), calibrator.bins - 1)
            prior = float(calibrator.probabilities(calibrator.keys(got)[i:i + 1]))
            assert prior == pytest.approx(max((cell[i] + 0.5) / calibrator.bins, 1e-3))


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark-train")
    save_tiny(root / "model", "llama")
    write_text_data(root / "text.jsonl")
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}}}\n"
        "heads: {kind: dspark, num_heads: 3, layers_per_head: 1, draft_vocab_size: 64, anchors: 8, markov_rank: 8}\n"
        f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24, eval_size: 4}}\n"
        "train: {batch_size: 4, lr: 3.0e-3, warmup_steps: 2, log_every: 2, seed: 0}\n"
        "loss: {chunk_size: 32}\n"
        "eval: {max_batches: 2}\n")
    return root


def test_dspark_heads_train_with_their_own_objective_and_resume(ws):
    """heads.kind=dspark through the ordinary trainer: the recipe's silent loss keys take DSpark's objective (TV 0.9,
    CE 0.1, no KL) and a key it sets is kept; every trainable parameter moves (the LM head, the target's rows,
    stays frozen), the Markov head among them; the confidence head's error against the measured acceptance rate falls
    as it trains; resuming from step 6 ends where the uninterrupted run ends; the saved heads load into the engine."""
    cfg = config(ws, "plain", "train.max_steps=12", "train.save_every=6")
    assert (cfg.loss.distill_weight, cfg.loss.tv_weight, cfg.loss.ce_weight) == (0.0, 0.9, 0.1)
    assert config(ws, "x", "loss.ce_weight=0.5").loss.ce_weight == 0.5
    plain = train(cfg)
    fresh = DraftHeads.for_target(plain.target, "dspark", 3, 1, markov_rank=8, mask_token_id=258)
    trained = dict(plain.heads.named_parameters())
    for name, p0 in fresh.named_parameters():
        moved = not torch.equal(p0, trained[name].detach().cpu())
        assert moved == p0.requires_grad or name == "dflash.lm_head.weight", name
    metrics = [json.loads(x) for x in (ws / "plain" / "metrics.jsonl").read_text().splitlines()]
    errors = [m["train/head1/confidence_error"] for m in metrics if "train/head1/confidence_error" in m]
    assert len(errors) == 6 and errors[-1] < errors[0], errors
    assert all("train/head1/tv" in m and "train/head1/kl" not in m for m in metrics if "train/loss" in m)
    spec = json.loads((ws / "plain" / "config.json").read_text())
    assert spec["kind"] == "dspark" and spec["markov_rank"] == 8 and spec["confidence_head"] is True

    resumed = train(config(ws, "plain", "train.max_steps=12", "resume=" + str(ws / "plain" / "checkpoints" / "step-6")))
    final = plain.heads.state_dict()
    assert max((final[k] - v).abs().max().item() for k, v in resumed.heads.state_dict().items()) <= 1e-6
    drafter = HeadsDrafter.from_pretrained(ws / "plain", plain.target)
    assert drafter.chained and drafter.target_layers == (1, 2)


def test_dspark_refuses_what_it_cannot_take_in_one_line(ws):
    """A rank of 0 (that is dflash), dspark's keys on another kind, a negative weight of the new loss term."""
    for overrides, says in ((["heads.markov_rank=0"], "heads.markov_rank must be >= 1"),
                            (["heads.kind=dflash", "heads.markov_rank=8"],
                             "heads.markov_rank is for heads.kind=dspark"),
                            (["loss.tv_weight=-1"], "loss.tv_weight must be >= 0")):
        with pytest.raises(ConfigError, match=says):
            load_config(ws / "base.yaml", [f"output_dir={ws / 'bad'}", *overrides], world_size=1)
