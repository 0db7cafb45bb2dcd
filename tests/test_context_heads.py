"""Context heads (heads.context_layers > 0): the inference-time encoder with its KV cache computes exactly
what the teacher-forced training forward computes, greedy output stays the target's, and training moves
every encoder parameter."""

from __future__ import annotations

import pytest
import torch
from test_inference_greedy import ARCHS, float64_model, greedy_reference
from test_train import config, ws  # noqa: F401  (the tiny training workspace fixture)
from tiny import tiny_model, tiny_tokenizer

from inference import HeadsDrafter, SpeculativeGenerator
from inference.drafters import DraftContext
from medusa_train.heads import DraftHeads
from medusa_train.trainer import train


def perturbed(heads: DraftHeads, seed: int = 0, scale: float = 0.3) -> DraftHeads:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return heads


@pytest.mark.parametrize("layers", [1, 2])
def test_extend_in_pieces_equals_the_teacher_forced_forward(layers):
    target = tiny_model("llama").double()
    heads = perturbed(DraftHeads.for_target(target, "chained", 2, context_layers=layers).double())
    T = 23
    h, e = torch.randn(1, T, 32, dtype=torch.float64), torch.randn(1, T, 32, dtype=torch.float64)
    want = heads.context(h, e)[0]  # [T, d]
    assert want.abs().max() > 1e-3  # the perturbed encoder says something
    cache, start = None, 0
    for n in (7, 1, 3, 1, 1, 5, 2, 3):  # a prefill, then steps of various accepted lengths
        c, cache = heads.context.extend(h[0, start:start + n], e[0, start:start + n], cache)
        start += n
        torch.testing.assert_close(c[0], want[start - 1], atol=1e-10, rtol=1e-10)
    assert start == T and cache[0][0].shape[2] == T


def test_untrained_context_heads_are_plain_heads_and_round_trip(tmp_path):
    target = tiny_model("llama")
    ids, h = torch.randint(0, 260, (2, 9)), torch.randn(2, 9, 32)
    embed = target.get_input_embeddings()
    plain = DraftHeads.for_target(target, "chained", 3)
    ctx = DraftHeads.for_target(target, "chained", 3, context_layers=1)
    with torch.no_grad():
        torch.testing.assert_close(ctx(h, ids, embed), plain(h, ids, embed))  # c starts at exactly 0
    perturbed(ctx)
    ctx.save_pretrained(tmp_path)
    again = DraftHeads.from_pretrained(tmp_path, target=target)
    assert again.spec.context_layers == 1
    torch.testing.assert_close(again(h, ids, embed), ctx(h, ids, embed))
    with pytest.raises(ValueError, match="context_layers=0"):
        again.export_mlp_speculator(tmp_path / "x", target)


class Recording(HeadsDrafter):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.roots: list[tuple[int, torch.Tensor]] = []

    def root_state(self, ctx: DraftContext):
        s0 = super().root_state(ctx)
        self.roots.append((len(ctx.tokens), s0[0].clone()))
        return s0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_drafting_sees_the_same_state_as_training_and_output_is_exact(arch, tree):
    """At every step the drafter's s_0 equals the training forward's s_0 at that position, computed from
    one plain forward over the final sequence; and greedy output equals the target's."""
    model = float64_model(arch, seed=1)
    heads = DraftHeads.for_target(model, "chained", 3, context_layers=1).double()
    perturbed(heads, seed=5)
    drafter = Recording(heads, model)
    input_ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(7))
    gen = SpeculativeGenerator(model, tiny_tokenizer(), drafter)
    for _ in range(2):  # a second call starts from a reset cache
        drafter.roots.clear()
        out = gen.generate(input_ids, max_new_tokens=30, tree=tree, tree_budget=6, eos_token_id=[])
        assert out.token_ids.tolist() == greedy_reference(model, input_ids, 30, eos_token_id=[]).tolist()
    seq = torch.cat([input_ids[0], out.token_ids])[None]
    with torch.no_grad():
        h = model.base_model(input_ids=seq).last_hidden_state  # [1, L, d]
        e = model.get_input_embeddings()(seq)
        s0 = heads.start(h) + heads.context(h, torch.nn.functional.pad(e[:, 1:], (0, 0, 0, 1)))
    assert len(drafter.roots) == out.stats.steps > 0
    for n_tokens, got in drafter.roots:  # tokens include the root; h_t sits one position before it
        torch.testing.assert_close(got, s0[0, n_tokens - 2], atol=1e-8, rtol=1e-8)


def test_drafting_without_history_is_refused():
    model = tiny_model("llama")
    drafter = HeadsDrafter(DraftHeads.for_target(model, "chained", 2, context_layers=1), model)
    ctx = DraftContext(torch.tensor([3]), torch.randn(32), [1, 2, 3], "static", 3)
    with pytest.raises(RuntimeError, match="observe"):
        drafter.draft(ctx)


def test_training_moves_every_context_parameter(ws, monkeypatch):  # noqa: F811
    import medusa_train.trainer as trainer

    initial = {}
    setup = trainer._setup_heads

    def recording(*a, **kw):
        heads = setup(*a, **kw)
        initial.update({n: p.detach().clone() for n, p in heads.named_parameters()})
        return heads

    monkeypatch.setattr(trainer, "_setup_heads", recording)
    cfg = config(ws, "ctx", "heads.context_layers=1", "train.max_steps=8", "eval.every=0")
    result = train(cfg)
    trained = dict(result.heads.named_parameters())
    assert any(n.startswith("context.") for n in initial) and initial.keys() == trained.keys()
    for name, p0 in initial.items():
        assert not torch.equal(p0, trained[name].detach().cpu()), f"head parameter {name} did not move"
    again = DraftHeads.from_pretrained(cfg.output_dir, target=result.target)
    assert again.spec.context_layers == 1
