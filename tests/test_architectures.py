"""Any causal LM is exact or refused in one line: a fixed selection of `scripts/arch_sweep.py`'s architectures (the
whole sweep, every model type transformers ships, is in docs/architectures.md), and the final-logit transforms
(Gemma-2's soft cap, Granite's and Cohere's scales) in training's teacher and loss."""

from __future__ import annotations

import pytest
import torch
from archs import sweep_one, tiny_model

from medusa_train.train.losses import FusedHeadLoss
from medusa_train.target.model import LogitTransform, logit_transform

EXACT = ["llama", "gpt2", "opt", "falcon", "phi3", "llama4_text", "gemma2 cap reached", "granite logits_scaling=8",
         "cohere logit_scale=4"]
REFUSED = {"bloom": "bloom: its ALiBi position bias", "falcon alibi=True": "falcon: its ALiBi position bias",
           "mpt": "mpt: its ALiBi", "lfm2 with conv layers": "lfm2: its conv layers keep a recurrent state",
           "qwen3_next": "qwen3_next: its linear_attention layers keep a recurrent state",
           "bert": "bert: tree verification self-check failed: its logits are not its output layer",
           "xlnet": "xlnet: its forward fails on a tree"}


@pytest.mark.parametrize("name", EXACT)
def test_exact_for_every_drafter_and_tree(name):
    """Planted oracles (full depth, rank 1), random chained / parallel / eagle3 heads and n-gram lookup, static and
    dynamic trees: greedy output equal to the model's own; sampling runs. (OPT keeps its layers one level lower,
    model.decoder.layers, where eagle3 heads must find them; Llama-4's base_model_prefix names no attribute of its
    own, so its decoder is found by name.)"""
    row = sweep_one(name)
    assert row.status == "exact", row


@pytest.mark.parametrize("name, message", REFUSED.items())
def test_refused_at_load_in_one_line(name, message):
    row = sweep_one(name)
    assert row.status == "refused", row
    assert row.detail.startswith(message) and "\n" not in row.detail


def test_the_transform_is_the_models_own():
    """What `logit_transform` reads from a config is what the model's forward does to lm_head(h), cap reached."""
    for name, (model_type, overrides) in {"gemma2": ("gemma2", dict(final_logit_softcapping=0.05)),
                                          "granite": ("granite", dict(logits_scaling=8.0)),
                                          "cohere": ("cohere", dict(logit_scale=4.0))}.items():
        model = tiny_model(model_type, **overrides)
        ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(0))
        h = model.model(ids).last_hidden_state
        raw, own = model.lm_head(h), model(ids).logits
        transform = logit_transform(model.config)
        assert not transform.identity and (raw - own).abs().max() > 0.1, name
        torch.testing.assert_close(transform(raw), own, rtol=0, atol=1e-12)
    assert logit_transform(tiny_model("llama").config).identity


@pytest.mark.parametrize("transform", [LogitTransform(softcap=0.7), LogitTransform(multiply=3.0),
                                       LogitTransform(divide=0.25)])
def test_fused_loss_gradient_through_the_transform(transform):
    """The heads' loss is KL(teacher' || softmax(transform(states @ W))) and CE on the transformed logits: its
    analytic gradient equals autograd's through the transform."""
    g = torch.Generator().manual_seed(0)
    n, d, V = 6, 5, 11
    states = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(transform(torch.randn(n, V, generator=g, dtype=torch.float64) * 3), -1).float()
    target = torch.randint(0, V, (n,), generator=g)
    pos_weight = torch.rand(n, generator=g, dtype=torch.float64)
    loss, *_ = FusedHeadLoss.apply(states, weight, teacher, target, pos_weight, 0.7, 0.3, transform)
    loss.backward()
    got = states.grad.clone(), weight.grad.clone()
    states.grad = weight.grad = None
    logq = torch.log_softmax(transform((states @ weight.t()).float()), -1)
    p = teacher.exp()
    kl = (p * (teacher - logq)).sum(-1)
    ce = -logq.gather(-1, target[:, None])[:, 0]
    ref = (pos_weight * (0.7 * kl + 0.3 * ce)).sum()
    ref.backward()
    torch.testing.assert_close(loss.float(), ref.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0].float(), states.grad.float(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[1].float(), weight.grad.float(), rtol=1e-4, atol=1e-6)
