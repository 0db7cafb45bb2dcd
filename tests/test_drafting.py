"""Every drafter drafts what its training forward ranks, and a drafter that is always right is always accepted.

Greedy output is exact whatever a drafter proposes, so a drafting bug (parallel heads all reading head 1's
logits, children hung under the wrong parent, draft-vocabulary indices left unmapped) would only lower tau,
silently. Here every node of a drafted tree is checked against the heads' teacher-forced training forward
(`DraftHeads.forward` over the committed tokens followed by the node's path), for chained and parallel heads,
with a draft vocabulary and with a context encoder, and for eagle3 heads, in static and dynamic trees; heads
trained by the trainer with a draft vocabulary are checked the same way in a real generation; and heads that
predict the target's own greedy continuation accept every level of every tree.

Bugs planted in `inference/engine/drafters.py` to check these tests, and what caught each: parallel heads all scoring
with head 1's logits (static, dynamic and always-right tests of both parallel kinds); dynamic-tree children
hung under the wrong frontier node (every dynamic test); draft-vocabulary indices not mapped back to target ids
(every draft-vocabulary test, the trained one included); a chained head fed a sibling's token instead of its
parent's (static and dynamic tests of chained heads); the context encoder fed positions shifted by one (both
context tests, and the older ones in test_context_heads.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_inference_greedy import float64_model, greedy_reference
from tiny import VOCAB, tiny_tokenizer

from inference import HeadsDrafter, HybridDrafter, SpeculativeGenerator
from inference.engine.drafters import DraftContext
from medusa_train.kinds.dflash import DFlashDrafting
from medusa_train.kinds.heads import DraftHeads
from medusa_train.target.model import target_hidden

K = 3
STATIC_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 1)]
KINDS = {  # name: (kind, draft vocabulary size, context layers)
    "chained": ("chained", 0, 0),
    "parallel": ("parallel", 0, 0),
    "chained-draft-vocab": ("chained", 40, 0),
    "parallel-draft-vocab": ("parallel", 40, 0),
    "chained-context": ("chained", 0, 1),
    "eagle3": ("eagle3", 0, 0),
    "eagle3-draft-vocab": ("eagle3", 40, 0),
    "dflash": ("dflash", 0, 0),
    "dflash-draft-vocab": ("dflash", 40, 0),
    "dspark": ("dspark", 0, 0),
    "dspark-draft-vocab": ("dspark", 40, 0),
}


def drafting_model(arch: str, seed: int):
    """A tiny float64 target whose token embeddings are large enough (std 1, not 0.02) that the token a chained
    head reads moves its ranking: a head fed the wrong token then drafts something else."""
    model = float64_model(arch, seed=seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(50.0)
    return model


def make_heads(model, name: str, seed: int = 0) -> DraftHeads:
    kind, vocab, context = KINDS[name]
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(VOCAB, generator=g)[:vocab].sort().values if vocab else None
    heads = DraftHeads.for_target(model, kind, K, draft_ids=draft_ids, context_layers=context).double()
    with torch.no_grad():  # far enough from the identity-like start that every head ranks differently
        for p in heads.parameters():
            if p.is_floating_point():
                p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return heads.eval()


def path_nodes(tree, i: int) -> list[int]:
    out = [i]
    while out[-1] != 0:
        out.append(int(tree.parents[out[-1]]))
    return out[::-1]


@torch.no_grad()
def training_ranking(heads: DraftHeads, model, committed: list[int], path: list[int]) -> tuple[list[int], torch.Tensor]:
    """What the training forward ranks for the node after `path` (tokens after the root, the root being
    committed[-1]): head len(path)+1's candidates as target ids, best first, and their log-probabilities.

    Training computes head k at position t from x_{t+1}..x_{t+k} (teacher forcing); the engine drafts at
    t = n - 2, the position before the root, so the sequence is the committed tokens followed by the path."""
    seq = torch.tensor([committed + path])
    h = target_hidden(model, seq, torch.ones_like(seq), heads.target_layers)  # eagle3: its layers after h
    states = heads(h, seq, model.get_input_embeddings())  # [K, 1, T, d]
    k, t = len(path), len(committed) - 2
    logits = heads.logits(k, states[k, 0, t], model.get_output_embeddings()).double()
    order = torch.argsort(logits, descending=True, stable=True)
    return heads.to_target_ids(order).tolist(), torch.log_softmax(logits, -1)[order]


def draft_context(model, drafter: HeadsDrafter, committed: list[int], tree: str | list, budget: int) -> DraftContext:
    """The context the generator builds: h at the root's predecessor, and (context heads) every committed
    position observed."""
    seq = torch.tensor([committed])
    h = target_hidden(model, seq, torch.ones_like(seq), drafter.target_layers)[0]
    drafter.reset()
    if drafter.needs_history:
        drafter.observe(h[:-1], seq[0, 1:])
    return DraftContext(seq[0, -1:], h[-2, :model.config.hidden_size], committed, tree, budget)


def check_static_tree(tree, heads, model, committed: list[int], paths) -> None:
    """Every node's token is the candidate of its rank path's last rank in the training forward's ranking after
    its parent's path, and its score the sum of its path's draft log-probabilities (what the calibrated trim and
    lossless sampling read); together the nodes hold exactly the rank paths of the tree's shape."""
    got = set()
    for i in range(1, tree.size):
        nodes = path_nodes(tree, i)
        tokens = [int(tree.tokens[j]) for j in nodes[1:]]
        ranks, logq = [], 0.0
        for d in range(len(tokens)):
            ranking, logp = training_ranking(heads, model, committed, tokens[:d])
            assert tokens[d] in ranking, f"node {i}: token {tokens[d]} is not a candidate of head {d + 1}"
            ranks.append(ranking.index(tokens[d]))
            logq += float(logp[ranks[-1]])
        if tree.scores is not None:  # (a tree cut out of a hybrid's carries none)
            assert float(tree.scores[i].detach()) == pytest.approx(logq, rel=1e-4, abs=1e-4), f"node {i}: score"
        got.add(tuple(ranks))
    assert got == set(map(tuple, paths))


@pytest.mark.parametrize("name", list(KINDS))
def test_static_tree_nodes_are_the_training_forwards_candidates(name):
    model = drafting_model("llama", seed=1)
    heads = make_heads(model, name)
    committed = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    drafter = HeadsDrafter(heads, model)
    tree = drafter.draft(draft_context(model, drafter, committed, STATIC_PATHS, len(STATIC_PATHS)))
    assert tree.size == len(STATIC_PATHS) + 1
    check_static_tree(tree, heads, model, committed, STATIC_PATHS)
    if heads.spec.draft_vocab_size:
        assert set(tree.tokens[1:].tolist()) <= set(heads.draft_ids.tolist())


@pytest.mark.parametrize("name", list(KINDS))
def test_dynamic_tree_nodes_hang_under_the_parent_that_ranks_them(name):
    """Each node is one of the candidates the training forward ranks after its own parent's path, among the
    best `width` the drafter expands, and its score is the sum of the path's log-probabilities there."""
    model = drafting_model("qwen2", seed=2)
    heads = make_heads(model, name, seed=1)
    committed = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    budget = 10
    drafter = HeadsDrafter(heads, model)
    with torch.no_grad():  # as the generator drafts
        tree = drafter.draft(draft_context(model, drafter, committed, "dynamic", budget))
    width = min(drafter.dynamic_topk, math.ceil(math.sqrt(budget)) + 1, budget)
    assert tree.size == budget + 1 and tree.max_depth >= 2
    for i in range(1, tree.size):
        nodes = path_nodes(tree, i)
        tokens = [int(tree.tokens[j]) for j in nodes[1:]]
        ranking, logq = training_ranking(heads, model, committed, tokens[:-1])
        assert tokens[-1] in ranking[:width], f"node {i} is not among its parent's {width} best candidates"
        parent = int(tree.parents[i])
        step = float(logq[ranking.index(tokens[-1])])
        assert float(tree.scores[i]) == pytest.approx(float(tree.scores[parent]) + step, abs=1e-5)


class OracleMixin:
    """Heads whose every logit row puts all its mass on the target's true greedy token at that depth (a
    one-hot over the scored vocabulary): the drafter's own machinery (chained states, topk, the draft
    vocabulary's id map, static and dynamic trees) decides whether the engine sees it."""

    def __init__(self, heads, target, truth: list[int]):
        super().__init__(heads, target)
        self.truth, self.base = truth, 0
        ids = heads.draft_ids.tolist() if heads.spec.draft_vocab_size else list(range(heads.spec.vocab_size))
        self.index = {t: i for i, t in enumerate(ids)}

    def draft(self, ctx):
        self.base = len(ctx.tokens)
        return super().draft(ctx)

    def head_logits(self, k, s):
        # parallel and block drafters (dflash, dspark) score every depth at once: row j is head j
        every_depth = not self.chained or isinstance(self._drafting, DFlashDrafting)
        rows = range(s.shape[0]) if every_depth else [k] * s.shape[0]
        out = torch.full((s.shape[0], self.heads.spec.scored_vocab), -30.0, dtype=s.dtype)
        for r, depth in enumerate(rows):
            pos = self.base + depth
            out[r, self.index[self.truth[pos]] if pos < len(self.truth) else 0] = 0.0
        return out


def oracle_heads(heads, target, truth: list[int]) -> HeadsDrafter:
    """OracleMixin over `HeadsDrafter` (whatever the heads' kind)."""
    return type("OracleHeads", (OracleMixin, HeadsDrafter), {})(heads, target, truth)


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_heads_that_are_always_right_accept_every_level(name, tree):
    model = drafting_model("mistral", seed=3)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    steps = 5
    max_new = 1 + steps * (K + 1)
    truth_new = greedy_reference(model, prompt, max_new + K + 2, eos_token_id=[])
    truth = prompt[0].tolist() + truth_new.tolist()
    heads = make_heads(model, name)
    if heads.spec.draft_vocab_size:  # every true token must be in the draft vocabulary to be drafted
        ids = sorted(set(truth) | set(heads.draft_ids.tolist()))
        heads = DraftHeads.for_target(model, heads.spec.kind, K, draft_ids=torch.tensor(ids)).double()
    gen = SpeculativeGenerator(model, tiny_tokenizer(), oracle_heads(heads, model, truth))
    out = gen.generate(prompt, max_new_tokens=max_new, tree=tree, tree_budget=6, eos_token_id=[])
    assert out.token_ids.tolist() == truth_new[:max_new].tolist()
    assert out.stats.accept_lengths == [K + 1] * steps  # tau = tree depth + 1


def test_heads_trained_with_a_draft_vocabulary_draft_what_training_predicts(tmp_path):
    """End to end: the trainer picks a draft vocabulary, saves the heads; loaded from disk they generate with
    every drafted id inside that vocabulary, mapped to the target id the training forward ranks there, and the
    output is the target's."""
    import json
    import random

    from tiny import save_tiny

    from medusa_train.config import load_config
    from medusa_train.train.trainer import train

    model = save_tiny(tmp_path / "model", "llama", seed=4)
    words = "one two three four five six seven eight nine ten apples and oranges fall from trees".split()
    rng = random.Random(0)
    with open(tmp_path / "text.jsonl", "w") as f:
        for _ in range(12):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(30))}) + "\n")
    cfg = load_config(None, [f"target.model={tmp_path / 'model'}", f"data.dataset={tmp_path / 'text.jsonl'}",
                             "data.format=text", "data.max_length=24", "data.eval_size=2", "heads.num_heads=3",
                             "heads.draft_vocab_size=48", "train.max_steps=12", "train.batch_size=4",
                             "train.lr=3e-3", "eval.max_batches=1", f"output_dir={tmp_path / 'heads'}"], world_size=1)
    train(cfg)

    target = model.double()
    heads = DraftHeads.from_pretrained(tmp_path / "heads", target=target).double().eval()
    assert heads.spec.draft_vocab_size == 48
    recorded = []

    class Recording(HeadsDrafter):
        def draft(self, ctx):
            tree = super().draft(ctx)
            recorded.append((list(ctx.tokens), tree))
            return tree

    gen = SpeculativeGenerator(target, tiny_tokenizer(), Recording.from_pretrained(tmp_path / "heads", target))
    prompt = tiny_tokenizer()("one two three four", return_tensors="pt")["input_ids"]
    paths = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    gen.auto_tree_budget()  # times drafting at every budget first (not the trees checked here)
    recorded.clear()
    out = gen.generate(prompt, max_new_tokens=20, tree=paths, eos_token_id=[])
    assert out.token_ids.tolist() == greedy_reference(target, prompt, 20, eos_token_id=[]).tolist()
    vocab = set(heads.draft_ids.tolist())
    assert len(recorded) >= 3
    for committed, tree in recorded:
        assert set(tree.tokens[1:].tolist()) <= vocab
        check_static_tree(tree, heads, target, committed, paths)


def test_lookup_grafted_on_keeps_the_heads_nodes():
    """HybridDrafter: the heads' part of the tree is still what the training forward ranks."""
    model = drafting_model("llama", seed=5)
    heads = make_heads(model, "chained")
    committed = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    drafter = HybridDrafter(HeadsDrafter(heads, model), lookup_nodes=2)
    drafter.share_nodes = False  # appended after the heads' nodes: those come first, in their own order
    paths = [(0,), (1,), (0, 0)]
    ctx = draft_context(model, drafter.primary, committed, paths, 5)
    tree = drafter.draft(ctx)
    heads_part = 1 + len(paths)
    assert tree.size > heads_part  # the lookup added its continuation of "5 6" -> "7 8"
    sub = type(tree)(tree.tokens[:heads_part], tree.parents[:heads_part], tree.depth[:heads_part],
                     tree.ancestors[:heads_part, :heads_part], int(tree.depth[:heads_part].max()))
    check_static_tree(sub, heads, model, committed, paths)
    lookup = [int(tree.tokens[i]) for i in range(heads_part, tree.size)]
    assert lookup == [7, 8]
