"""One acceptance step, computed exactly: lossless sampling is the target's distribution, to 1e-12.

`accept_lossless` draws one uniform u_i per tree node and takes child i where u_i falls below its residual
probability (recursive rejection sampling over deterministic candidates), then samples the bonus token from
the residual of the last accepted node. Written here from the definition (SpecInfer / Medusa), node by node:
child i of an accepted node, reached when every earlier sibling was rejected, is accepted with probability

    r_i = p(c_i) / (1 - sum of p(c_j) over the distinct tokens of the earlier siblings),   0 if c_i repeats one,

and with every child rejected the bonus comes from p with the children's tokens removed. Every u_i is
independent, so the output distribution is a finite sum: for each of the 2^(N-1) pass/fail patterns of the
non-root nodes, the step runs with each u_i just below r_i (pass) or just above it (fail), weighted by the
product of r_i or 1 - r_i, and the bonus distribution it would sample from is read off `sample_token`'s
argument. Continuing every output with the target's own conditionals to a fixed length gives a distribution
over sequences that must equal the target's joint one exactly. A sampler that takes several siblings, keeps
a repeated sibling's probability, or forgets to remove rejected children from the residual misses by far more
than the tolerance (the tests' docstrings give the margins, measured by planting each bug).

`sample_token` itself is tested apart, with enough batched draws that the inverted exponential trick fails by
a wide margin; typical acceptance against a case computed by hand.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

import inference.engine.verify as verify
from inference import HeadsDrafter, HybridDrafter
from inference.engine.drafters import DraftContext
from inference.engine.tree import graft_branches, tree_from_parents
from inference.engine.verify import accept_lossless, accept_typical, sample_token, target_probs

V = 5


def target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A synthetic target: fixed pseudo-random logits for every prefix (float64, spread from rare to common)."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return 3.0 * torch.randn(V, generator=g, dtype=torch.float64)


@functools.lru_cache(maxsize=None)
def target_p(prefix: tuple[int, ...], temperature: float, top_p: float) -> torch.Tensor:
    p = target_probs(target_logits(prefix), temperature, top_p).double()  # the engine's warp (float32)
    return p / p.sum()  # renormalised in float64, so that exact sums hold to 1e-15


def make_tree(tokens: list[int], parents: list[int]):
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    return tree_from_parents(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth), max(depth))


def path_of(tree, i: int) -> list[int]:
    """Node indices from the root to node i."""
    out = [i]
    while out[-1] != 0:
        out.append(int(tree.parents[out[-1]]))
    return out[::-1]


def node_probs(tree, prefix: tuple[int, ...], temperature: float, top_p: float) -> torch.Tensor:
    """p[i]: the target's distribution for the token after node i (after the prefix and node i's path)."""
    rows = []
    for i in range(tree.size):
        path = tuple(int(tree.tokens[j]) for j in path_of(tree, i))
        rows.append(target_p(prefix + path, temperature, top_p))
    return torch.stack(rows)


def residual_acceptance(tree, p: torch.Tensor) -> list[float]:
    """r_i from the definition, sibling by sibling (the root: 1)."""
    r = [1.0] * tree.size
    for parent in range(tree.size):
        children = [i for i in range(1, tree.size) if int(tree.parents[i]) == parent]
        seen: set[int] = set()
        rejected_mass = 0.0
        for i in children:
            c = int(tree.tokens[i])
            if c in seen:
                r[i] = 0.0
                continue
            pc = float(p[parent, c])
            r[i] = min(1.0, pc / (1.0 - rejected_mass)) if 1.0 - rejected_mass > 1e-15 else 0.0
            seen.add(c)
            rejected_mass += pc
    return r


def step_distribution(tree, p: torch.Tensor, monkeypatch, accept=accept_lossless) -> dict[tuple[int, ...], float]:
    """The exact distribution of one step's output (accepted tokens after the root, then the bonus), by
    enumerating every pass/fail pattern of the non-root nodes' uniforms."""
    r = residual_acceptance(tree, p)
    n = tree.size
    captured: list[torch.Tensor] = []
    u_now: list[torch.Tensor] = []
    out: dict[tuple[int, ...], float] = {}
    with monkeypatch.context() as m:
        m.setattr(verify.torch, "rand", lambda *a, **k: u_now[0].clone())
        m.setattr(verify, "sample_token", lambda q, generator: captured.append(q.double()) or q.argmax(-1))
        for pattern in itertools.product((True, False), repeat=n - 1):
            weight = math.prod(r[i] if ok else 1 - r[i] for i, ok in zip(range(1, n), pattern))
            if weight == 0:
                continue
            u = [0.5] + [r[i] * (1 - 1e-9) if ok else r[i] + (1 - r[i]) * 1e-9
                         for i, ok in zip(range(1, n), pattern)]
            u_now[:] = [torch.tensor(u, dtype=p.dtype)]
            captured.clear()
            acc = accept(tree, p, None)
            (bonus_p,) = captured
            accepted = [int(tree.tokens[i]) for i in acc.path[1:int(acc.n)].tolist()]
            for token in range(V):
                if bonus_p[token] > 0:
                    key = tuple(accepted + [token])
                    out[key] = out.get(key, 0.0) + weight * float(bonus_p[token])
    return out


def continued(step: dict[tuple[int, ...], float], prefix: tuple[int, ...], length: int, temperature: float,
              top_p: float) -> torch.Tensor:
    """Each step output continued with the target's own conditionals to `length` tokens: [V] * length."""
    joint = torch.zeros((V,) * length, dtype=torch.float64)
    for out, w in step.items():
        if len(out) >= length:
            joint[out[:length]] += w
            continue
        for tail in itertools.product(range(V), repeat=length - len(out)):
            q, seq = w, list(out)
            for t in tail:
                q *= float(target_p(prefix + (ROOT,) + tuple(seq), temperature, top_p)[t])
                seq.append(t)
            joint[tuple(seq)] += q
    return joint


def target_joint(prefix: tuple[int, ...], length: int, temperature: float, top_p: float) -> torch.Tensor:
    joint = torch.zeros((V,) * length, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=length):
        q = 1.0
        for j, t in enumerate(seq):
            q *= float(target_p(prefix + (ROOT,) + seq[:j], temperature, top_p)[t])
        joint[seq] = q
    return joint


PREFIX = (3, 1, 4)
ROOT = 2


def check_lossless(tree, monkeypatch, temperature: float = 1.0, top_p: float = 1.0) -> float:
    """Max abs difference between the step's continued output distribution and the target's joint one."""
    p = node_probs(tree, PREFIX, temperature, top_p)
    step = step_distribution(tree, p, monkeypatch)
    length = tree.max_depth + 1
    got = continued(step, PREFIX, length, temperature, top_p)
    want = target_joint(PREFIX, length, temperature, top_p)
    assert abs(float(got.sum()) - 1) < 1e-12
    return float((got - want).abs().max())


# siblings in every position, depth 3, candidates the target finds likely and unlikely
WIDE = make_tree([ROOT, 0, 1, 4, 2, 3, 0, 1, 4], [0, 0, 0, 0, 1, 1, 2, 4, 4])
# repeated siblings (the same token twice under one parent, as an unshared graft or a short bigram row makes)
REPEATS = make_tree([ROOT, 1, 1, 3, 1, 0, 0, 2], [0, 0, 0, 0, 1, 1, 1, 4])


@pytest.mark.parametrize("tree", [WIDE, REPEATS], ids=["wide", "repeats"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.6, 0.9)])
def test_lossless_step_is_exactly_the_target_distribution(tree, temperature, top_p, monkeypatch):
    """Bugs planted in `accept_lossless`, one at a time, and what this file then reads (the tolerance is 1e-12):
    every sibling that passes taken, not only the first: off by 1.1e-5 to 6.0e-3 (wide at T=1 and both real heads
    trees); a repeated sibling's probability not zeroed: 0.018 to 0.089 (repeats at T=1 and 1.6, the unshared
    graft); the rejected mass counting a repeated sibling twice: repeats at T=1; the rejected children left in
    the bonus's residual: 1.5e-4 to 0.13 (8 of the 12 cases)."""
    if top_p < 1:  # the nucleus really cuts drafted tokens out
        p = node_probs(tree, PREFIX, temperature, top_p)
        assert (p[tree.parents[1:], tree.tokens[1:]] == 0).any()
    assert check_lossless(tree, monkeypatch, temperature, top_p) < 1e-12


def test_repeated_siblings_carry_probability(monkeypatch):
    """The repeats case is not vacuous: a repeated token has non-zero probability where it repeats, so a sampler
    that does not zero it would accept it a second time."""
    p = node_probs(REPEATS, PREFIX, 1.0, 1.0)
    for i in (2, 6):  # node 2 repeats node 1's token under the root, node 6 node 5's under node 1
        assert p[int(REPEATS.parents[i]), int(REPEATS.tokens[i])] > 0.01


def test_unshared_graft_layout_is_lossless(monkeypatch):
    """On a GPU, HybridDrafter appends the lookup's branch under the root without merging it into the heads'
    nodes (`share=False`), so the same token can stand twice under one parent: the tree the real graft builds
    from a heads tree is verified exactly."""
    heads_tree = make_tree([ROOT, 1, 3, 0, 4], [0, 0, 0, 1, 1])
    grafted = graft_branches(heads_tree, [[1, 0, 2], [3, 3]], 5, share=False)
    parents, tokens = grafted.parents.tolist(), grafted.tokens.tolist()
    root_children = [tokens[i] for i in range(1, grafted.size) if parents[i] == 0]
    assert len(root_children) > len(set(root_children))  # repeated siblings under the root
    assert check_lossless(grafted, monkeypatch) < 1e-12


@pytest.mark.parametrize("tree_kind", ["static", "dynamic"])
def test_real_heads_trees_are_lossless(tree_kind, monkeypatch):
    """The trees a HeadsDrafter (with lookup grafted on, unshared) really builds, verified exactly."""
    from test_inference_greedy import float64_model, random_heads

    model = float64_model("llama")
    vocab = model.get_output_embeddings().weight.shape[0]
    drafter = HybridDrafter(HeadsDrafter(random_heads(model, "chained", 2), model), lookup_nodes=2)
    drafter.share_nodes = False
    tokens = [3, 1, 4, 1, 3, 1, 4]
    hidden = torch.randn(model.config.hidden_size, dtype=torch.float64)
    tree = drafter.draft(DraftContext(torch.tensor([tokens[-1]]), hidden, tokens, tree_kind, 5))
    # map the real tree's tokens into this test's small vocabulary (the shape, repeats included, is what counts)
    ids = {t: k % V for k, t in enumerate(dict.fromkeys(tree.tokens.tolist()))}
    small = make_tree([ROOT] + [ids[t] for t in tree.tokens.tolist()[1:]], tree.parents.tolist())
    assert small.size == tree.size and tree.max_depth >= 2 and vocab > V
    assert check_lossless(small, monkeypatch) < 1e-12


def test_sample_token_draws_from_p():
    """400,000 batched draws from a 6-token distribution, chi-square at p = 1e-6 (threshold 35.9 at 5 degrees of
    freedom): this sampler scores 11.8. With the same noise, the inverted exponential trick (argmax p * E instead
    of p / E) scores 38,831, and drawing from p without its least likely token (3%) 12,381."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03], dtype=torch.float64)
    n = 400_000
    draws = sample_token(p.expand(n, -1).clone(), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=6).double()
    stat = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert stat < 35.9, stat
    # zero-probability tokens are never drawn
    q = torch.tensor([0.0, 0.5, 0.0, 0.5], dtype=torch.float64)
    assert set(sample_token(q.expand(10_000, -1).clone(), torch.Generator().manual_seed(1)).tolist()) == {1, 3}


def test_typical_acceptance_against_a_hand_computed_case(monkeypatch):
    """Medusa's rule: node i is right when p_parent(token_i) > min(0.09, 0.3 * exp(-H(p_parent))).

    Root distribution [0.5, 0.3, 0.1, 0.1]: H = 1.168 nats, 0.3 exp(-H) = 0.0933, limit 0.09: tokens 0, 1, 2, 3
    all pass (0.1 > 0.09). Node 1's (token 1) distribution [0.97, 0.01, 0.01, 0.01]: H = 0.168, limit
    min(0.09, 0.254) = 0.09: token 0 passes, token 2 fails. Node 2's (token 3) distribution is uniform: H =
    1.386, limit 0.075, token 3 (0.25) passes. The tree: root -> [1, 3]; 1 -> [2, 0]; 3 -> [3]. Deepest right
    node: node 4 (token 0 under node 1) and node 5 (token 3 under node 2), both depth 2: the lower index, node 4
    wins; the bonus is drawn from p at node 4. An acceptance that takes every node would end at depth 2 too
    but on node 3 (token 2, the first of the deepest), so the path and the bonus's distribution tell them apart."""
    tree = make_tree([ROOT, 1, 3, 2, 0, 3], [0, 0, 0, 1, 1, 2])
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1],
                      [0.97, 0.01, 0.01, 0.01],
                      [0.25, 0.25, 0.25, 0.25],
                      [0.1, 0.2, 0.3, 0.4],
                      [0.6, 0.2, 0.1, 0.1],
                      [0.7, 0.1, 0.1, 0.1]], dtype=torch.float64)
    captured = []
    monkeypatch.setattr(verify, "sample_token", lambda q, generator: captured.append(q) or q.argmax(-1))
    acc = accept_typical(tree, p, None)
    assert acc.path[:int(acc.n)].tolist() == [0, 1, 4] and int(acc.best) == 4
    assert torch.equal(captured[0], p[4])
