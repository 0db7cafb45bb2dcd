"""Greedy speculative output equals `model.generate(do_sample=False)` token for token.

The tiny models run in float64: a tree forward and a sequential forward add the same numbers in a
different order, and in float32 a near-tie between two logits could flip an argmax on rounding alone;
in float64 such a flip would need logits equal to ~1e-15, which random weights never produce.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny import VOCAB, tiny_model, tiny_tokenizer

from inference import BigramDrafter, HeadsDrafter, HybridDrafter, NGramDrafter, SpeculativeGenerator, TreeDrafter
from inference.engine.drafters import DraftContext
from medusa_train.kinds.heads import DraftHeads

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]



def float64_model(arch: str, seed: int = 0):
    """A tiny random model in float64. Rotary models get query and key projections 20x their random init, so
    attention is sharp enough that a node's position moves the output: with the init's weights a tree verified
    one position off still produced the target's greedy tokens."""
    model = tiny_model(arch, seed=seed).double()
    with torch.no_grad():
        for module in model.modules():
            for name in ("q_proj", "k_proj"):
                if hasattr(module, name):
                    getattr(module, name).weight.mul_(20.0)
    return model


def random_heads(model, kind: str, num_heads: int, seed: int = 0, scale: float = 0.2,
                 context_layers: int = 0) -> DraftHeads:
    """Untrained heads, perturbed away from their identity-like initialisation (chained heads alternate
    between the residual and the mlp_speculator block with the seed)."""
    block = ("residual", "mlp_speculator")[seed % 2] if kind == "chained" else "residual"
    heads = DraftHeads.for_target(model, kind=kind, num_heads=num_heads, block=block, context_layers=context_layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return heads


def greedy_reference(model, input_ids: torch.Tensor, n: int, eos_token_id=None) -> torch.Tensor:
    """The target's own greedy continuation (new tokens only)."""
    kw = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    out = model.generate(input_ids, do_sample=False, max_new_tokens=n, attention_mask=torch.ones_like(input_ids),
                         pad_token_id=259, **kw)
    return out[0, input_ids.shape[1]:]


class PlantedDrafter(TreeDrafter):
    """A drafter that knows the target's greedy sequence `truth` (prompt + continuation). After every node
    at depth k < good_depth it proposes the true next token at rank `true_rank` among filler tokens that
    are all wrong; `true_rank=None` never proposes it (adversarial)."""

    def __init__(self, truth: list[int], vocab: int, max_depth: int, true_rank: int | None = 0,
                 good_depth: int | None = None):
        super().__init__()
        self.truth, self.vocab, self.max_depth = truth, vocab, max_depth
        self.true_rank = true_rank
        self.good_depth = max_depth if good_depth is None else good_depth
        self.base = 0

    def draft(self, ctx: DraftContext):
        self.base = len(ctx.tokens)  # truth[base + k] is the token after a depth-k node on the true path
        return super().draft(ctx)

    def propose(self, k, tokens, states, num):
        pos = self.base + k
        true = self.truth[pos] if pos < len(self.truth) else 0
        cand = [(true + 1 + j) % self.vocab for j in range(num)]
        if self.true_rank is not None and self.true_rank < num and k < self.good_depth:
            cand[self.true_rank] = true
        m = tokens.shape[0]
        cand_t = torch.tensor(cand, device=tokens.device).expand(m, num)
        logq = -torch.arange(num, dtype=torch.float32, device=tokens.device).expand(m, num)
        return cand_t, logq, None


def _case(i: int) -> dict:
    """Case i of the randomized sweep: architecture and drafter family cycle; the rest is drawn."""
    rng = random.Random(1000 + i)
    return dict(
        arch=ARCHS[i % 4],
        drafter=["planted", "chained", "planted", "parallel", "eagle3", "ngram", "bigram", "planted"][(i // 4) % 8],
        tree=["static", "dynamic", "paths"][(i // 32 + i) % 3],
        budget=rng.choice([1, 2, 3, 5, 8, 12]),
        num_heads=rng.choice([1, 2, 3, 4]),
        prompt_len=rng.choice([1, 2, 5, 13, 31, 60]),
        max_new=rng.choice([1, 2, 7, 17, 25, 33, 33, 40, 40]),
        eos_mid=rng.random() < 0.3,
        true_rank=rng.choice([0, 0, 1, 2, None]),
        good_depth=rng.choice([1, 2, 3, 4]),
        seed=rng.randrange(1 << 16),
    )


PATH_SHAPES = [[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)],
               [(1,), (0, 1), (0, 0, 1, 0)], [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]]


@pytest.mark.parametrize("i", range(64))
def test_greedy_equals_target_generate(i):
    c = _case(i)
    model = float64_model(c["arch"], seed=c["seed"] % 3)
    torch.manual_seed(c["seed"])
    input_ids = torch.randint(0, 256, (1, c["prompt_len"]))
    if c["drafter"] in ("ngram", "bigram"):  # give lookup something to find: repeat a chunk of the prompt
        input_ids = torch.cat([input_ids, input_ids[:, : c["prompt_len"] // 2]], dim=1)
    depth = c["num_heads"]
    truth_new = greedy_reference(model, input_ids, c["max_new"] + depth + 2, eos_token_id=[])
    eos = None
    if c["eos_mid"] and c["max_new"] > 6:
        eos = int(truth_new[c["max_new"] // 2])  # stop on a token met half way through (first occurrence)
    want = greedy_reference(model, input_ids, c["max_new"], eos_token_id=eos if eos is not None else [])

    truth = input_ids[0].tolist() + truth_new.tolist()
    if c["drafter"] in ("chained", "parallel", "eagle3"):
        drafter = HeadsDrafter(random_heads(model, c["drafter"], depth, seed=c["seed"],
                                            context_layers=(c["seed"] // 2) % 2 if c["drafter"] != "eagle3" else 0),
                               model)
    elif c["drafter"] == "planted":
        drafter = PlantedDrafter(truth, VOCAB, depth, c["true_rank"], c["good_depth"])
    elif c["drafter"] == "ngram":
        drafter = NGramDrafter(max_ngram=3, max_depth=depth, branches=2)
    else:
        drafter = BigramDrafter.from_token_ids([truth[: len(truth) // 2], input_ids[0]], VOCAB, top_k=3,
                                               max_depth=depth)
    tree = c["tree"]
    if tree == "paths":
        tree = [p for p in PATH_SHAPES[i % len(PATH_SHAPES)] if len(p) <= depth and max(p) < 3]
    gen = SpeculativeGenerator(model, tiny_tokenizer(), drafter)
    out = gen.generate(input_ids, max_new_tokens=c["max_new"], tree=tree, tree_budget=c["budget"],
                       eos_token_id=eos if eos is not None else [])
    assert out.token_ids.tolist() == want.tolist(), c
    assert out.stats.new_tokens == len(want)
    assert out.stats.target_forwards == out.stats.steps + 1
    assert sum(out.stats.accept_lengths) >= len(want) - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_max_new_tokens_zero_and_one(arch):
    model = float64_model(arch)
    input_ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    gen = SpeculativeGenerator(model, tiny_tokenizer(), HeadsDrafter(random_heads(model, "chained", 3), model))
    out0 = gen.generate(input_ids, max_new_tokens=0)
    assert out0.token_ids.tolist() == [] and out0.stats.target_forwards == 0 and out0.text == ""
    out1 = gen.generate(input_ids, max_new_tokens=1)
    assert out1.token_ids.tolist() == greedy_reference(model, input_ids, 1).tolist()
    assert out1.stats.steps == 0 and out1.stats.target_forwards == 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_oracle_accepts_full_depth_every_step(arch, shape):
    model = float64_model(arch, seed=1)
    input_ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    depth, steps = 3, 6
    max_new = 1 + steps * (depth + 1)  # prefill's token + full steps
    truth_new = greedy_reference(model, input_ids, max_new + depth + 2, eos_token_id=[])
    truth = input_ids[0].tolist() + truth_new.tolist()
    paths = ([(0,), (0, 0), (0, 0, 0)] if shape == "chain"
             else [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)])
    gen = SpeculativeGenerator(model, tiny_tokenizer(), PlantedDrafter(truth, VOCAB, depth, true_rank=0))
    out = gen.generate(input_ids, max_new_tokens=max_new, tree=paths, eos_token_id=[])
    assert out.token_ids.tolist() == truth_new[:max_new].tolist()
    assert out.stats.accept_lengths == [depth + 1] * steps
    assert out.stats.tau == pytest.approx(max_new / (steps + 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_adversarial_accepts_nothing_and_output_is_identical(arch):
    model = float64_model(arch, seed=2)
    input_ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(5))
    truth_new = greedy_reference(model, input_ids, 30, eos_token_id=[])
    truth = input_ids[0].tolist() + truth_new.tolist()
    gen = SpeculativeGenerator(model, tiny_tokenizer(), PlantedDrafter(truth, VOCAB, 3, true_rank=None))
    for tree in ("static", "dynamic"):
        out = gen.generate(input_ids, max_new_tokens=25, tree=tree, tree_budget=8, eos_token_id=[])
        assert out.token_ids.tolist() == truth_new[:25].tolist()
        assert out.stats.tau == 1.0
        assert out.stats.accept_lengths == [1] * 24


def test_partial_oracle_accepts_up_to_its_good_depth():
    model = float64_model("llama", seed=3)
    input_ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(6))
    truth_new = greedy_reference(model, input_ids, 40, eos_token_id=[])
    truth = input_ids[0].tolist() + truth_new.tolist()
    # the truth sits at rank 1 for two levels, then disappears: every step accepts exactly 2 drafts
    drafter = PlantedDrafter(truth, VOCAB, 4, true_rank=1, good_depth=2)
    gen = SpeculativeGenerator(model, tiny_tokenizer(), drafter)
    out = gen.generate(input_ids, max_new_tokens=31, tree=[(1, 1, 0, 0), (0,), (0, 0)], eos_token_id=[])
    assert out.token_ids.tolist() == truth_new[:31].tolist()
    assert out.stats.accept_lengths == [3] * 10


def test_string_prompt_chat_and_streamer():
    model = float64_model("qwen2")
    tok = tiny_tokenizer()
    gen = SpeculativeGenerator(model, tok, NGramDrafter(max_depth=3))

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], 0

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended += 1

    rec = Recorder()
    out = gen.generate("hello hello hello", max_new_tokens=12, streamer=rec, eos_token_id=[])
    ids = torch.tensor([tok("hello hello hello")["input_ids"]])
    assert out.token_ids.tolist() == greedy_reference(model, ids, 12, eos_token_id=[]).tolist()
    assert rec.puts[0] == ids.tolist() and sum(rec.puts[1:], []) == out.token_ids.tolist() and rec.ended == 1
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)

    chat = gen.generate("hi", max_new_tokens=5, chat=True, eos_token_id=[])
    chat_ids = tok(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert chat.token_ids.tolist() == greedy_reference(model, torch.tensor([chat_ids]), 5, eos_token_id=[]).tolist()


def test_default_eos_comes_from_generation_config():
    model = float64_model("llama")
    input_ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(8))
    truth_new = greedy_reference(model, input_ids, 20, eos_token_id=[])
    model.generation_config.eos_token_id = [int(truth_new[9]), 258]
    gen = SpeculativeGenerator(model, tiny_tokenizer(), NGramDrafter(max_depth=2))
    out = gen.generate(input_ids, max_new_tokens=20)
    assert out.token_ids.tolist() == greedy_reference(model, input_ids, 20).tolist()
    assert out.token_ids[-1] == truth_new[9] and len(out.token_ids) <= 10


@pytest.mark.parametrize("kind", ["chained", "eagle3"])
def test_budget_zero_is_plain_decoding_and_drafts_nothing(kind, monkeypatch):
    """A budget of 0 drafts nothing: output equal to `generate`'s, and no drafting work at all (no drafter method,
    no head module, no captured layers), heads with history (eagle3, context heads) included."""
    import medusa_train.target.model as target_module

    model = float64_model("qwen2", seed=6)
    heads = random_heads(model, kind, 3, context_layers=1 if kind == "chained" else 0)
    drafter = HybridDrafter(HeadsDrafter(heads, model), lookup_nodes=2)
    gen = SpeculativeGenerator(model, tiny_tokenizer(), drafter)
    calls = []
    for name in ("draft", "observe", "root_state", "propose"):
        for d in (drafter, drafter.primary, drafter.lookup):
            if hasattr(d, name):
                monkeypatch.setattr(d, name, lambda *a, _n=name, **k: calls.append(_n))
    for module in heads.modules():
        module.register_forward_hook(lambda *a: calls.append("heads forward"))
    real_capture = target_module.capture_layers
    monkeypatch.setattr(target_module, "capture_layers",
                        lambda *a, **k: calls.append("capture") or real_capture(*a, **k))
    ids = torch.randint(0, 256, (1, 13), generator=torch.Generator().manual_seed(7))
    out = gen.generate(ids, max_new_tokens=20, tree_budget=0, eos_token_id=[])
    assert out.token_ids.tolist() == greedy_reference(model, ids, 20, eos_token_id=[]).tolist()
    assert calls == [] and out.stats.tau == 1.0 and out.stats.verified_nodes == 19
    sampled = gen.generate(ids, max_new_tokens=5, tree_budget=0, temperature=1.0, seed=1, eos_token_id=[])
    assert len(sampled.token_ids) == 5 and calls == []
