"""Context heads (heads.context_layers > 0): the inference-time encoder with its KV cache computes exactly
what the teacher-forced training forward computes, greedy output stays the target's, and training moves
every encoder parameter. And for chained heads with or without the encoder: every token the engine drafts
along a chain, up to its first miss, is the training forward's top-1 there."""

from __future__ import annotations

import pytest
import torch
from test_inference_greedy import ARCHS, float64_model, greedy_reference
from test_train import config, ws  # noqa: F401  (the tiny training workspace fixture)
from tiny import tiny_model, tiny_tokenizer

from inference import HeadsDrafter, SpeculativeGenerator
from inference.engine.drafters import DraftContext
from medusa_train.kinds.heads import DraftHeads
from medusa_train.train.trainer import train


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
    import medusa_train.train.run as run_setup

    initial = {}
    setup = run_setup.setup_heads

    def recording(*a, **kw):
        heads = setup(*a, **kw)
        initial.update({n: p.detach().clone() for n, p in heads.named_parameters()})
        return heads

    monkeypatch.setattr(run_setup, "setup_heads", recording)
    cfg = config(ws, "ctx", "heads.context_layers=1", "train.max_steps=8", "eval.every=0")
    result = train(cfg)
    trained = dict(result.heads.named_parameters())
    assert any(n.startswith("context.") for n in initial) and initial.keys() == trained.keys()
    for name, p0 in initial.items():
        assert not torch.equal(p0, trained[name].detach().cpu()), f"head parameter {name} did not move"
    again = DraftHeads.from_pretrained(cfg.output_dir, target=result.target)
    assert again.spec.context_layers == 1


class DraftRecording(HeadsDrafter):
    """Keeps every step's committed length and drafted chain (node tokens by depth)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps: list[tuple[int, list[int]]] = []

    def draft(self, ctx: DraftContext):
        tree = super().draft(ctx)
        order = torch.argsort(tree.depth[1:], stable=True) + 1
        self.steps.append((len(ctx.tokens), tree.tokens[order].tolist()))
        return tree


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("context_layers", [0, 1])
def test_every_engine_draft_is_the_training_forwards_top1(arch, context_layers):
    """Greedy output is exact whatever the heads draft, so a drafting bug would only show as a lower tau. With
    heads fitted to be right part of the time, every token a top-1 chain drafts, up to and including its first
    miss, is the teacher-forced training forward's top-1 at that position (one forward over the final
    sequence), so every step accepts exactly what that forward predicts."""
    from medusa_train.target.model import target_hidden

    model = float64_model(arch, seed=1)
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(11))
    max_new, K = 60, 3
    truth = greedy_reference(model, prompt, max_new, eos_token_id=[])
    seq = torch.cat([prompt[0], truth])[None]
    heads = perturbed(DraftHeads.for_target(model, "chained", K, context_layers=context_layers).double(), 3, 0.5)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    torch.manual_seed(0)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    with torch.no_grad():
        h = target_hidden(model, seq, torch.ones_like(seq))
    for _ in range(300):  # fit this very sequence until head 1 is right about half the time, not always
        states = heads(h, seq, embed)
        logits = [heads.logits(k, states[k], lm_head)[0, :-2 - k] for k in range(K)]
        if (logits[0].argmax(-1) == seq[0, 2:]).double().mean() >= 0.5:
            break
        loss = sum(torch.nn.functional.cross_entropy(logits[k], seq[0, 2 + k:]) for k in range(K))
        opt.zero_grad()
        loss.backward()
        opt.step()
    heads.eval()
    with torch.no_grad():
        states = heads(h, seq, embed)
        top = torch.stack([heads.logits(k, states[k], lm_head).argmax(-1)[0] for k in range(K)])  # [K, L]

    drafter = DraftRecording(heads, model)
    gen = SpeculativeGenerator(model, tiny_tokenizer(), drafter)
    out = gen.generate(prompt, max_new_tokens=max_new, tree=[(0,), (0, 0), (0, 0, 0)], tree_budget=K,
                       eos_token_id=[])
    assert out.token_ids.tolist() == truth.tolist()
    assert len(drafter.steps) == len(out.stats.accept_lengths)
    compared = 0
    for (n, drafts), accepted in zip(drafter.steps, out.stats.accept_lengths):
        # committed length n: the root is seq[n-1], s_0 comes from h at n-2, head k guesses seq[n+k]
        right = 0
        for k, d in enumerate(drafts):
            if n + k >= seq.shape[1]:
                break
            assert d == top[k, n - 2], f"step at {n}: head {k + 1} drafted {d}, the training forward {top[k, n - 2]}"
            compared += 1
            if d != seq[0, n + k]:
                break
            right += 1
        if n + K < seq.shape[1]:  # the last step may be cut short by max_new_tokens
            assert accepted == right + 1
    got = out.stats.accept_lengths[:-1]
    assert compared > len(got) and 1 in got and max(got) > 2  # misses and long accepts both happened
