"""inference.engine.calibrate: online p(node accepted | parent accepted) and the trimming it drives."""

from __future__ import annotations

import math

import pytest
import torch
from test_hybrid import PlantedLookup
from test_inference_greedy import PlantedDrafter, float64_model, greedy_reference
from tiny import VOCAB, tiny_tokenizer

from inference import HybridDrafter, NGramDrafter, SpeculativeGenerator
from inference.engine.calibrate import BOTH, LOOKUP, SCORED, UNSCORED, AcceptanceCalibrator
from inference.engine.choice import StepChoice
from inference.engine.drafters import DraftContext
from inference.engine.tree import graft_branches, tree_from_parents

D, B = 4, 10


def _key(kind: int, depth: int, cell: int) -> int:
    return (kind * D + depth - 1) * B + cell


def _heads_tree():
    """root 5 -> a=7 (q 0.95), b=8 (q 0.35); a -> c=9 (q 0.5): cumulative log-probabilities as scores."""
    scores = torch.tensor([0.0, math.log(0.95), math.log(0.35), math.log(0.95 * 0.5)])
    return tree_from_parents(torch.tensor([5, 7, 8, 9]), torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 1, 2]), 2,
                             scores)


def test_graft_records_the_lookup_and_keeps_the_drafters_scores():
    tree = _heads_tree()
    grown = graft_branches(tree, [[7, 3, 4]], max_new=2, match_lengths=[2])  # shares a, adds 3 and 4
    assert grown.tokens.tolist() == [5, 7, 8, 9, 3, 4]
    assert grown.lookup.tolist() == [0, 2, 0, 0, 2, 2]
    assert torch.allclose(grown.scores[:4], tree.scores) and grown.scores[4:].isnan().all()
    appended = graft_branches(tree, [[7, 3]], max_new=2, share=False, match_lengths=[3])  # the GPU path
    assert appended.tokens.tolist() == [5, 7, 8, 9, 7, 3] and appended.lookup.tolist() == [0, 0, 0, 0, 3, 3]
    assert appended.scores[4:].isnan().all()
    # the n-gram drafter marks its nodes with the length of the n-gram it matched
    tree = NGramDrafter(max_ngram=3, max_depth=3, branches=1).draft(
        DraftContext(torch.tensor([2]), torch.zeros(4), [1, 2, 6, 7, 8, 1, 2], "static", 5))
    assert tree.tokens.tolist() == [2, 6, 7, 8] and tree.lookup.tolist() == [0, 2, 2, 2]


def test_keys_name_each_kind_of_node():
    cal = AcceptanceCalibrator(max_depth=D, bins=B)
    grown = graft_branches(_heads_tree(), [[7, 3]], max_new=1, match_lengths=[2])  # [5, 7, 8, 9, 3]
    keys = cal.keys(grown).tolist()
    assert keys[1:] == [_key(BOTH, 1, 9), _key(SCORED, 1, 3), _key(SCORED, 2, 5), _key(LOOKUP, 2, 1)]
    plain = tree_from_parents(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]), 2)
    assert cal.keys(plain).tolist()[1:] == [_key(UNSCORED, 1, 0), _key(UNSCORED, 2, 0)]
    deep = tree_from_parents(torch.arange(7), torch.tensor([0, 0, 1, 2, 3, 4, 5]), torch.arange(7), 6)
    assert cal.keys(deep).tolist()[-1] == _key(UNSCORED, D, 0)  # depths past max_depth share its row


def test_update_counts_the_tried_and_the_accepted():
    cal = AcceptanceCalibrator(max_depth=D, bins=B, memory=1e9)
    tree = _heads_tree()
    keys = cal.keys(tree)
    cal.update(tree, keys, torch.tensor([0, 1, 3]), 3)  # root -> a -> c accepted: a, b, c were all tried
    cells = [_key(SCORED, 1, 9), _key(SCORED, 1, 3), _key(SCORED, 2, 5)]
    assert cal.trials[cells].tolist() == pytest.approx([1, 1, 1])
    assert cal.hits[cells].tolist() == pytest.approx([1, 0, 1])
    cal.update(tree, keys, torch.tensor([0, 0, 0]), 1)  # nothing accepted: c (under a) was not tried
    assert cal.trials[cells].tolist() == pytest.approx([2, 2, 1])
    assert float(cal.trials.sum()) == pytest.approx(5) and float(cal.hits.sum()) == pytest.approx(2)


def test_calibration_follows_what_verifies_and_decays_to_the_prior():
    torch.manual_seed(0)
    cal = AcceptanceCalibrator(max_depth=D, bins=B, memory=400)
    # siblings: an over-confident head node (q 0.95, right 30% of the time) and a 3-gram lookup node (the rest)
    tree = graft_branches(tree_from_parents(torch.tensor([5, 7]), torch.tensor([0, 0]), torch.tensor([0, 1]), 1,
                                            torch.tensor([0.0, math.log(0.95)])), [[3]], 1, match_lengths=[3])
    keys = cal.keys(tree)
    for _ in range(600):
        path = torch.tensor([0, 1]) if torch.rand(()) < 0.3 else torch.tensor([0, 2])
        cal.update(tree, keys, path, 2)
    p_head, p_lookup = cal.probabilities(keys[1:]).tolist()
    assert abs(p_head - 0.3) < 0.08 and abs(p_lookup - 0.7) < 0.08
    # costs of 0.4 of a forward per extra row: only the lookup node is worth it now
    costs = [0.0] + [1 + 0.4 * (n - 1) for n in range(1, 8)]
    kept, kept_keys = cal.trim(tree, costs)
    assert kept.tokens.tolist() == [5, 3] and kept_keys.tolist() == [keys[0], keys[2]]
    assert kept.lookup.tolist() == [0, 3]
    before = cal.table()
    assert {(r["kind"], r["depth"]) for r in before} == {("scored", 1), ("lookup", 1)}
    # nothing tried for a long while: back to the prior, so trimmed-away cells are tried again
    root_only = tree_from_parents(torch.tensor([5]), torch.tensor([0]), torch.tensor([0]), 0)
    for _ in range(4000):
        cal.update(root_only, cal.keys(root_only), torch.tensor([0]), 1)
    assert torch.allclose(cal.probabilities(keys[1:]), cal.prior.flatten()[keys[1:]], atol=0.02)
    with pytest.raises(ValueError, match="max_depth"):
        AcceptanceCalibrator(max_depth=0)


def test_generation_learns_to_trust_the_lookup_over_overconfident_heads():
    """Heads that are sure (q = 1) and always wrong, beside a lookup that is always right, under steep verify
    costs: the calibrator learns both, so later steps verify the lookup's nodes and drop the heads'; the
    output is the target's throughout."""
    model = float64_model("llama")
    input_ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = greedy_reference(model, input_ids, 60, eos_token_id=[])
    truth = input_ids[0].tolist() + want.tolist()
    hybrid = HybridDrafter(PlantedDrafter(truth, VOCAB, 4, true_rank=None), PlantedLookup(truth, 3), lookup_nodes=3)
    gen = SpeculativeGenerator(model, tiny_tokenizer(), hybrid)
    gen.verify_costs = lambda: [0.0] + [1 + 0.2 * (n - 1) for n in range(1, 33)]
    gen._auto_budget = 6
    gen.choice = StepChoice(["both"])  # the trim inside the default's own steps (the per-step choice: test_choice)
    verified = []
    trim = gen.calibrator.trim
    gen.calibrator.trim = lambda tree, costs, fixed=0.0: _record(trim(tree, costs, fixed), verified)
    out = gen.generate(input_ids, max_new_tokens=60, eos_token_id=[])
    assert out.token_ids.tolist() == want.tolist()
    assert out.stats.verified_nodes == sum(len(v) for v in verified)  # stats count the rows actually verified
    table = gen.calibrator.table()
    assert all(r["p"] > 0.8 for r in table if r["kind"] == "lookup" and r["depth"] == 1)
    assert all(r["p"] < 0.4 for r in table if r["kind"] == "scored")  # the prior gave the sure ones 0.67
    half = len(verified) // 2  # the last step is cut short by max_new_tokens
    assert verified[half:-1] == [[0, 3, 3, 3]] * (len(verified) - half - 1)  # root + the lookup's 3, no heads node
    assert out.stats.accept_lengths[half:-1] == [4] * (len(verified) - half - 1)


def _record(trimmed, verified):
    verified.append(trimmed[0].lookup.tolist())
    return trimmed


class CountingHybrid(HybridDrafter):
    """Records, per step, whether the primary drafter drafted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drafted: list[bool] = []

    def draft(self, ctx):
        tree = super().draft(ctx)
        self.drafted.append(self.drafted_primary)
        return tree


def test_a_primary_whose_nodes_do_not_pay_is_skipped_and_probed():
    """Heads sure and always wrong beside a lookup always right: once their payoff is learned they are not drafted,
    except on every PROBE_EVERY-th step; heads always right with no lookup match are drafted every step. The
    output is the target's either way."""
    model = float64_model("llama")
    input_ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = greedy_reference(model, input_ids, 90, eos_token_id=[])
    truth = input_ids[0].tolist() + want.tolist()
    for heads_right in (False, True):
        lookup = PlantedLookup(truth, 0 if heads_right else 3)
        hybrid = CountingHybrid(PlantedDrafter(truth, VOCAB, 4, true_rank=0 if heads_right else None), lookup,
                                lookup_nodes=3)
        gen = SpeculativeGenerator(model, tiny_tokenizer(), hybrid)
        gen.verify_costs = lambda: [0.0] + [1e-3 * (1 + 0.05 * (n - 1)) for n in range(1, 33)]
        gen.draft_costs = lambda: [0.0] * 32
        gen._auto_budget = 4
        gen.choice = StepChoice(["both"])  # the skipping inside the default's own steps
        out = gen.generate(input_ids, max_new_tokens=90, eos_token_id=[])
        assert out.token_ids.tolist() == want.tolist()
        later = hybrid.drafted[len(hybrid.drafted) // 2:]
        if heads_right:
            assert all(later)
        else:
            assert 1 <= sum(later) <= len(later) // HybridDrafter.PROBE_EVERY + 1, hybrid.drafted
