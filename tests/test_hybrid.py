"""HybridDrafter: a primary drafter's tree with the n-gram lookup's continuation grafted on."""

from __future__ import annotations

import pytest
import torch
from test_inference_greedy import ARCHS, PlantedDrafter, float64_model, greedy_reference, random_heads
from tiny import VOCAB, save_tiny, tiny_tokenizer

from inference import HeadsDrafter, HybridDrafter, NGramDrafter, SpeculativeGenerator
from inference.engine.drafters import DraftContext, Drafter
from inference.generate import main
from inference.engine.tree import graft_branches, subtree, tree_from_parents, trim_keep


def _tree(tokens, parents, depth):
    return tree_from_parents(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth), max(depth))


def _paths(tree) -> set[tuple[int, ...]]:
    """Every node as its token path from the root (root excluded)."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out = set()
    for i in range(1, len(toks)):
        path, j = [], i
        while j:
            path.append(toks[j])
            j = pars[j]
        out.add(tuple(reversed(path)))
    return out


def _check_order(tree):
    pars, dep = tree.parents.tolist(), tree.depth.tolist()
    assert all(pars[i] < i for i in range(1, len(pars))), "parents must precede children"
    assert dep == sorted(dep), "nodes ordered by depth"
    assert all(dep[i] == dep[pars[i]] + 1 for i in range(1, len(pars)))
    rebuilt = tree_from_parents(tree.tokens, tree.parents, tree.depth, tree.max_depth)
    assert torch.equal(tree.ancestors, rebuilt.ancestors)


def test_graft_shares_existing_nodes_and_caps_new_ones():
    base = _tree([5, 7, 8, 9], [0, 0, 0, 1], [0, 1, 1, 2])  # 5 -> 7 -> 9, 5 -> 8
    grown = graft_branches(base, [[7, 9, 3, 4], [6]], max_new=3)
    _check_order(grown)
    assert _paths(grown) == _paths(base) | {(7, 9, 3), (7, 9, 3, 4), (6,)}
    assert grown.size == 7 and grown.max_depth == 4
    assert grown.tokens[:3].tolist() == [5, 7, 8]  # the base's own nodes keep their places within a depth
    capped = graft_branches(base, [[7, 9, 3, 4], [6]], max_new=1)  # the first branch goes first
    assert _paths(capped) == _paths(base) | {(7, 9, 3)}
    assert graft_branches(base, [[7, 9], [8]], max_new=5) is base  # nothing new: the same tree
    assert graft_branches(base, [[1, 2]], max_new=0) is base


def test_graft_without_sharing_appends_after_the_tree():
    """The GPU path: no host read of the tree, the branches go after its nodes as they are (sharing
    prefixes only among themselves), so a continuation the tree already holds repeats its nodes."""
    base = _tree([5, 7, 8, 9], [0, 0, 0, 1], [0, 1, 1, 2])
    grown = graft_branches(base, [[7, 9, 3], [7, 6]], max_new=4, share=False)
    assert grown.tokens.tolist() == [5, 7, 8, 9, 7, 9, 3, 6]
    assert grown.parents.tolist() == [0, 0, 0, 1, 0, 4, 5, 4]
    assert grown.depth.tolist() == [0, 1, 1, 2, 1, 2, 3, 2] and grown.max_depth == 3
    assert torch.equal(grown.ancestors, tree_from_parents(grown.tokens, grown.parents, grown.depth, 3).ancestors)
    assert graft_branches(base, [[7, 9, 3]], max_new=2, share=False).tokens.tolist() == [5, 7, 8, 9, 7, 9]
    assert graft_branches(base, [[7]], max_new=0, share=False) is base


class RecordingDrafter(Drafter):
    """A chain of a fixed token under the root, as long as the budget it is given (recorded)."""

    max_depth = 6

    def __init__(self):
        self.budgets: list[int] = []

    def draft(self, ctx):
        self.budgets.append(ctx.budget)
        n = ctx.budget
        return tree_from_parents(torch.cat([ctx.root, torch.full((n,), 99)]), (torch.arange(n + 1) - 1).clamp_min(0),
                                 torch.arange(n + 1), n)


def test_hybrid_splits_the_budget_between_lookup_and_primary():
    primary = RecordingDrafter()
    hybrid = HybridDrafter(primary, NGramDrafter(max_ngram=2, max_depth=5, branches=2), lookup_nodes=4)
    tokens = [7, 8, 1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2]  # "1 2" occurred twice: continuations [4 5 6 1 2], [3 9 1 ..]
    tree = hybrid.draft(DraftContext(torch.tensor([2]), torch.zeros(4), tokens, "static", budget=7))
    assert primary.budgets == [3]  # the lookup took 4 nodes: its best continuation's first 4 tokens
    _check_order(tree)
    assert tree.size == 8
    assert (4, 5, 6, 1) in _paths(tree) and (99, 99, 99) in _paths(tree)
    # the lookup never takes more than half the budget (rounded up)
    tree = hybrid.draft(DraftContext(torch.tensor([2]), torch.zeros(4), tokens, "static", budget=3))
    assert primary.budgets[-1] == 1 and (4, 5) in _paths(tree) and (4, 5, 6) not in _paths(tree)
    hybrid.draft(DraftContext(torch.tensor([2]), torch.zeros(4), tokens, "static", budget=1))
    assert primary.budgets[-1] == 0
    # no match anywhere: the primary drafter gets the whole budget
    tree = hybrid.draft(DraftContext(torch.tensor([42]), torch.zeros(4), [1, 2, 42], "static", budget=7))
    assert primary.budgets[-1] == 7 and tree.size == 8
    # a continuation the primary tree already holds costs nothing extra
    tree = hybrid.draft(DraftContext(torch.tensor([99]), torch.zeros(4), [99, 99, 99, 99], "static", budget=6))
    assert _paths(tree) == {(99,) * d for d in range(1, primary.budgets[-1] + 1)}
    assert hybrid.max_depth == 6
    # the generator trims (calibrated, CPU): the primary drafts its whole budget, the lookup adds its share on top
    tree = hybrid.draft(DraftContext(torch.tensor([2]), torch.zeros(4), tokens, "static", budget=3, trimmed=True))
    assert primary.budgets[-1] == 3 and tree.size == 1 + 3 + 4
    assert tree.lookup.tolist().count(2) == 4  # the lookup's nodes carry the 2-gram they matched
    with pytest.raises(ValueError, match="lookup_nodes"):
        HybridDrafter(primary, lookup_nodes=-1)


class PlantedLookup(NGramDrafter):
    """A lookup that always continues with the target's true greedy tokens."""

    def __init__(self, truth: list[int], depth: int):
        super().__init__(max_depth=depth, branches=1)
        self.truth = truth

    def matches(self, tokens, depth):
        return [self.truth[len(tokens):len(tokens) + depth]], 3


def test_hybrid_accepts_what_the_lookup_grafted():
    """An adversarial primary (never the true token) plus a lookup that is always right: every step takes
    the lookup's whole share, so the grafted nodes are verified and accepted like the primary's own."""
    model = float64_model("llama")
    input_ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = greedy_reference(model, input_ids, 30, eos_token_id=[])
    truth = input_ids[0].tolist() + want.tolist()
    primary = PlantedDrafter(truth, VOCAB, 4, true_rank=None)
    alone = SpeculativeGenerator(model, tiny_tokenizer(), primary).generate(input_ids, max_new_tokens=30,
                                                                            tree_budget=6, eos_token_id=[])
    assert alone.stats.tau == 1.0
    hybrid = HybridDrafter(primary, PlantedLookup(truth, 3), lookup_nodes=3)
    out = SpeculativeGenerator(model, tiny_tokenizer(), hybrid).generate(input_ids, max_new_tokens=30,
                                                                         tree_budget=6, eos_token_id=[])
    assert out.token_ids.tolist() == want.tolist()
    assert out.stats.accept_lengths[:-1] == [4] * (len(out.stats.accept_lengths) - 1)  # 3 drafts + the bonus


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_hybrid_greedy_equals_target_generate(arch, tree):
    """Chained heads (context heads on every other case) + real n-gram lookup on a prompt that repeats
    itself: output equals the target's greedy output, with EOS mid-way on some cases."""
    for seed in range(3):
        model = float64_model(arch, seed=seed)
        torch.manual_seed(seed)
        ids = torch.randint(0, VOCAB, (1, 12))
        input_ids = torch.cat([ids, ids[:, :8]], dim=1)
        truth_new = greedy_reference(model, input_ids, 40, eos_token_id=[])
        eos = int(truth_new[17]) if seed == 2 else None
        want = greedy_reference(model, input_ids, 30, eos_token_id=eos if eos is not None else [])
        heads = random_heads(model, "chained", 3, seed=seed, context_layers=seed % 2)
        hybrid = HybridDrafter(HeadsDrafter(heads, model), lookup_nodes=1 + seed)
        hybrid.share_nodes = seed != 1  # seed 1 takes the GPU path: appended, repeated nodes and all
        out = SpeculativeGenerator(model, tiny_tokenizer(), hybrid).generate(
            input_ids, max_new_tokens=30, tree=tree, tree_budget=2 + 3 * seed,
            eos_token_id=eos if eos is not None else [])
        assert out.token_ids.tolist() == want.tolist(), (arch, tree, seed)


def test_from_pretrained_and_cli_take_lookup_nodes(tmp_path, capsys):
    model = save_tiny(tmp_path / "target", "llama", seed=3)
    heads = random_heads(model, "chained", 3, seed=1)
    heads.spec.target_name = str(tmp_path / "target")
    heads.save_pretrained(tmp_path / "heads")
    gen = SpeculativeGenerator.from_pretrained(tmp_path / "heads", device="cpu", lookup_nodes=2)
    assert isinstance(gen.drafter, HybridDrafter) and gen.drafter.lookup_nodes == 2
    assert isinstance(gen.drafter.primary, HeadsDrafter)
    assert isinstance(SpeculativeGenerator.from_pretrained(tmp_path / "heads", device="cpu", lookup_nodes=0).drafter,
                      HeadsDrafter)
    assert SpeculativeGenerator.from_pretrained(tmp_path / "heads", device="cpu").drafter.lookup_nodes == 4
    prompt = "abcabcabc abcabc"
    ids = gen.encode(prompt)
    out = gen.generate(prompt, max_new_tokens=12, tree_budget=4, eos_token_id=[])
    assert out.token_ids.tolist() == greedy_reference(gen.target, ids.cpu(), 12, eos_token_id=[]).tolist()
    assert main(["--heads", str(tmp_path / "heads"), "--prompt", prompt, "--max-new-tokens", "12",
                 "--tree-budget", "4", "--lookup-nodes", "2", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.rstrip("\n").split("\n")[:-1] == [out.text]
    assert main(["--heads", str(tmp_path / "heads"), "--prompt", prompt, "--lookup-nodes", "-1"]) == 2
    assert "--lookup-nodes must be >= 0" in capsys.readouterr().err


# -- cost-aware trimming (tree.trim_keep + subtree; on a CPU with the auto budget) ---------------------


def trim_tree(tree, costs):
    """What Calibrator.trim does, ranked by the drafter's own path probabilities instead of calibrated ones."""
    keep = None if tree.scores is None else trim_keep(tree.scores, tree.depth, costs)
    return tree if keep is None else subtree(tree, keep)


def test_trim_tree_keeps_the_nodes_worth_their_verify_rows():
    # root -> a (p .6) -> c (p .6 * .5 = .3); root -> b (p .1)
    tree = tree_from_parents(torch.tensor([5, 7, 8, 9]), torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 1, 2]), 2,
                             torch.tensor([1.0, 0.6, 0.1, 0.3]).log())
    assert trim_tree(tree, [0.0, 1.0, 1.0, 1.0, 1.0]) is tree  # flat cost: every node pays
    assert trim_tree(tree, [0.0, 1.0, 10.0, 10.0, 10.0]).size == 1  # one extra row costs 10x: the root alone
    # costs 1, 1.5, 1.8, 2.4: rates 1, 1.6/1.5, 1.9/1.8, 2.0/2.4 -> keep a alone
    assert trim_tree(tree, [0.0, 1.0, 1.5, 1.8, 2.4]).tokens.tolist() == [5, 7]
    # costs 1, 1.5, 1.7, 2.4: rates 1, 1.6/1.5, 1.9/1.7, 2.0/2.4 -> keep a and c (the best two)
    kept = trim_tree(tree, [0.0, 1.0, 1.5, 1.7, 2.4])
    assert kept.tokens.tolist() == [5, 7, 9] and kept.parents.tolist() == [0, 0, 1] and kept.max_depth == 2
    assert torch.allclose(kept.scores.exp(), torch.tensor([1.0, 0.6, 0.3]))
    assert torch.equal(kept.ancestors, tree_from_parents(kept.tokens, kept.parents, kept.depth, 2).ancestors)
    # equal probabilities down a chain: the depth penalty keeps parents ahead of children
    chain = tree_from_parents(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]), 2,
                              torch.zeros(3))
    assert trim_tree(chain, [0.0, 1.0, 1.2, 10.0]).tokens.tolist() == [1, 2]
    assert trim_tree(_tree([1, 2], [0, 0], [0, 1]), [0.0, 1.0, 10.0]).size == 2  # no scores: nothing to trim


def test_static_drafts_carry_their_path_log_probabilities():
    truth = list(range(40))
    drafter = PlantedDrafter(truth, VOCAB, 3, true_rank=0)  # candidate r has log q = -r
    tree = drafter.draft(DraftContext(torch.tensor([5]), torch.zeros(4), truth[:6], [(0,), (1,), (0, 2), (1, 0)], 4))
    paths = {(0,): -0.0, (1,): -1.0, (0, 2): -2.0, (1, 0): -1.0}
    assert sorted(tree.scores.tolist()) == sorted([0.0] + list(paths.values()))


def test_auto_budget_on_a_cpu_trims_and_stays_exact():
    """Steep verify costs make most steps drop their unlikely drafts; the output is still the target's."""
    for arch in ARCHS:
        model = float64_model(arch, seed=1)
        input_ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
        want = greedy_reference(model, input_ids, 25, eos_token_id=[])
        for hybrid in (False, True):
            drafter = HeadsDrafter(random_heads(model, "chained", 3, seed=2, context_layers=int(hybrid)), model)
            gen = SpeculativeGenerator(model, tiny_tokenizer(), HybridDrafter(drafter) if hybrid else drafter)
            gen.verify_costs = lambda: [0.0, 1.0] + [1.5 + 0.01 * n for n in range(2, 33)]
            gen._auto_budget = 8
            sizes = []
            trim = gen.calibrator.trim
            gen.calibrator.trim = lambda tree, costs, fixed=0.0: _record(trim(tree, costs, fixed), sizes)
            out = gen.generate(input_ids, max_new_tokens=25, eos_token_id=[])
            assert out.token_ids.tolist() == want.tolist(), (arch, hybrid)
            assert min(sizes) < 9, (arch, hybrid)  # some steps were trimmed below budget + 1


def _record(trimmed, sizes):
    sizes.append(trimmed[0].size)
    return trimmed


def test_the_platform_decides_once_what_a_step_may_read_on_the_host():
    """A generator decides its CPU-versus-GPU behaviour when built (`Platform`) and hands it down: on a GPU-like
    platform the auto budget is not trimmed per step and the lookup's branch is appended, not merged (no host
    read of the tree), and the output is still the target's."""
    from dataclasses import replace

    from inference.engine.budget import Platform

    model = float64_model("llama", seed=4)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    seen = []

    class Watching(HybridDrafter):
        def draft(self, ctx):
            seen.append((ctx.host_reads, ctx.trimmed))
            return super().draft(ctx)

    gen = SpeculativeGenerator(model, tiny_tokenizer(), Watching(HeadsDrafter(random_heads(model, "chained", 3),
                                                                            model), lookup_nodes=2))
    assert gen.platform == Platform.for_device("cpu") and gen.platform.host_trim and gen.platform.host_reads
    want = greedy_reference(model, prompt, 16, eos_token_id=[]).tolist()
    assert gen.generate(prompt, max_new_tokens=16, eos_token_id=[]).token_ids.tolist() == want
    assert set(seen) == {(True, True)}
    seen.clear()
    gen.platform = replace(gen.platform, host_trim=False, host_reads=False)  # as Platform.for_device("cuda")
    assert gen.generate(prompt, max_new_tokens=16, eos_token_id=[]).token_ids.tolist() == want
    assert set(seen) == {(False, False)}
    cuda = Platform.for_device("cuda")
    assert not cuda.host_trim and not cuda.host_reads and max(cuda.lengths) == 96
