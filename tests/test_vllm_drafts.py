"""What each request drafts in vLLM (`inference.vllm_drafts`), without vLLM: the lookup is the engine's, the step cost
fit recovers a machine's costs, the lengths maximise the batch's expected tokens per second, the planner learns from
what vLLM verified and picks the chain expected to give more; `tests/test_vllm.py` serves it in vLLM."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from inference.engine.calibrate import BOTH, LOOKUP, SCORED
from inference.engine.drafters import NGramDrafter
from inference.vllm_drafts import DraftPlanner, StepCost, bucket, lookup
from inference.vllm_plugin import SETTINGS, _translate, settings_of
from medusa_train.kinds.heads import DraftHeads
from tiny import tiny_model

K = 3


def test_lookup_is_the_engines_first_branch():
    """On contexts with many repeats (a small alphabet), every length and depth: the same continuation and n-gram
    length as the engine's NGramDrafter with one branch."""
    rng = random.Random(0)
    engine = NGramDrafter(max_depth=K, branches=1)
    matched = 0
    for _ in range(400):
        tokens = [rng.randrange(rng.choice([3, 6, 40])) for _ in range(rng.randrange(1, 60))]
        depth = rng.randrange(1, 6)
        engine.reset()
        conts, n = engine.matches(tokens, depth)
        got, got_n = lookup(np.array(tokens), depth)
        assert (got.tolist(), got_n) == ((conts[0] if conts else []), n), tokens
        matched += bool(n)
    assert 100 < matched < 400  # both cases seen


def machine(requests: int, drafts: int) -> float:
    """A CPU-like step: a request's row costs 12 ms, a draft's 5 ms, the step 20 ms besides."""
    return 0.02 + 0.012 * requests + 0.005 * drafts


def test_step_cost_recovers_the_machines_costs():
    cost = StepCost(prior_ratio=16.0)
    assert cost.base("both", 4) == 20.0  # nothing seen: the prior, plus the requests' own rows
    for _ in range(10):
        cost.add("both", 4, 4, machine(4, 0))
    assert cost.fit("both") is None and cost.base("both", 4) == 20.0  # no spread in tokens: nothing to fit on
    rng = random.Random(1)
    for _ in range(200):
        requests = rng.randrange(1, 17)
        drafts = rng.randrange(0, 3 * requests + 1)
        cost.add("both", requests, requests + drafts, machine(requests, drafts))
    fixed, per_request, per_draft = cost.fit("both")
    assert (fixed, per_request, per_draft) == pytest.approx((0.02, 0.012, 0.005), rel=1e-2)
    for requests in (1, 4, 16):
        assert cost.base("both", requests) == pytest.approx(machine(requests, 0) / 0.005, rel=1e-2)
    gpu = StepCost()
    for _ in range(200):  # a GPU: rows cost nothing measurable
        requests = rng.randrange(1, 17)
        gpu.add("lookup", requests, requests + rng.randrange(0, 40), 0.01)
    assert gpu.base("lookup", 8) == StepCost.MAX_RATIO


def test_an_arm_run_on_few_steps_shares_the_rows_cost():
    """The heads' arm costs 10 ms more a step and runs on one step in 12 (the choice's probes): its fixed part is its
    own, a row's cost is learned from every step, so a step with the heads is priced right after a dozen of them."""
    cost = StepCost()
    rng = random.Random(3)
    for i in range(300):
        arm = "both" if i % 12 == 0 else "lookup"
        requests = rng.choice((2, 4))
        drafts = rng.randrange(0, 3 * requests + 1)
        cost.add(arm, requests, requests + drafts, machine(requests, drafts) + (0.01 if arm == "both" else 0.0))
    # (within 3%: the prior that a request's row costs a draft's pulls a little where R spans 2-4 alone)
    assert cost.fit("both") == pytest.approx((0.03, 0.012, 0.005), rel=3e-2)
    assert cost.fit("lookup") == pytest.approx((0.02, 0.012, 0.005), rel=3e-2)
    assert cost.fit("plain") is None and cost.base("plain", 4) == cost.prior_ratio + 4


@pytest.mark.parametrize("sizes", [(4,), (2, 4)])
def test_a_draft_is_charged_its_own_cost_not_a_requests(sizes):
    """Steps of 4 requests (or of 2 and 4, as requests finish and arrive) drafting 0-12 tokens: a step of 4 without
    drafts is worth 13.6 drafts, not the 9.4 that a fit on tokens alone gives when the batch size varies (each draft
    charged part of a request's cost: lookup drafts that pay were trimmed)."""
    cost = StepCost()
    rng = random.Random(2)
    for _ in range(300):
        requests = rng.choice(sizes)
        drafts = rng.randrange(0, 3 * requests + 1)
        cost.add("lookup", requests, requests + drafts, machine(requests, drafts))
    assert cost.base("lookup", 4) == pytest.approx(machine(4, 0) / 0.005, rel=1e-2)


def test_batch_buckets():
    assert [bucket(r) for r in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 0, 1, 2, 2, 3, 3, 4, 4, 5]


def planner_with(p_scored: dict[int, float], ratio: float, lengths: str = "auto") -> DraftPlanner:
    """A planner whose calibration gives a heads' token in probability bin b the acceptance p_scored[b] at every
    depth (many verifies counted), and whose step costs have the given fixed / per-token ratio."""
    planner = DraftPlanner(K, use_lookup=True, lengths=lengths)
    c = planner.calibrator
    tried, hit = [], []
    for b, p in p_scored.items():
        for d in range(K):
            key = (SCORED * c.max_depth + d) * c.bins + b
            tried += [key] * 1000
            hit += [key] * round(1000 * p)
    c.count(np.array(tried), np.array(hit))
    planner.cost.prior_ratio = ratio
    planner.EXPLORE = 10**9  # no exploration: test_every_16th_chain_explores has it
    return planner


def best_lengths(chances: list[np.ndarray], ratio: float) -> list[int]:
    """Every combination of lengths, the one with the most expected tokens per step cost (fewest tokens on ties)."""
    best, best_rate = None, -1.0
    for lengths in itertools.product(*[range(len(c) + 1) for c in chances]):
        tokens = len(chances) + sum(float(c[:n].sum()) for c, n in zip(chances, lengths))
        rate = tokens / (ratio + len(chances) + sum(lengths))
        if rate > best_rate + 1e-12:
            best, best_rate = list(lengths), rate
    return best


@pytest.mark.parametrize("ratio", [0.5, 2.0, 6.0, 30.0, 1e4])
def test_lengths_maximise_the_batchs_tokens_per_second(ratio):
    """Three requests whose heads' tokens have chances from near-sure to unlikely: the lengths drafted are the best of
    every combination, for step costs from CPU-like (each verified row costs) to GPU-like (rows are free)."""
    p_scored = {9: 0.95, 6: 0.6, 3: 0.3, 0: 0.05}
    planner = planner_with(p_scored, ratio)
    planner.arm = "both"
    q = np.array([[0.95, 0.95, 0.65], [0.65, 0.35, 0.05], [0.35, 0.05, 0.05]])
    tokens = np.array([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    drafts = planner.plan(["a", "b", "c"], [0, 1, 2], (tokens, q), None, [K] * 3)
    chances = [np.cumprod([planner.calibrator.estimates().numpy()[c] for c in planner._cells(
        np.full(K, SCORED), row, 0)]) for row in q]
    want = best_lengths(chances, ratio)
    assert [len(d) for d in drafts] == want
    assert drafts == [tokens[j, :n].tolist() for j, n in enumerate(want)]
    if ratio >= 1e4:
        assert want == [3, 3, 3]  # rows nearly free: every token drafted
    if ratio <= 0.5:
        assert want == [2, 0, 0]  # each row costs: only the surest tokens


def test_the_more_requests_the_surer_a_draft_must_be():
    """The same request's chain (chances 0.6, 0.36, 0.11), alone and among 15 others like it: at a CPU-like cost
    (a step's fixed part worth 4 rows) it drafts two tokens alone, none in the batch."""
    planner = planner_with({6: 0.6, 3: 0.3}, ratio=4.0)
    planner.arm = "both"
    q = np.array([[0.65, 0.65, 0.35]])
    tokens = np.array([[5, 6, 7]])
    alone = planner.plan(["a"], [0], (tokens, q), None, [K])
    batch = planner.plan([str(i) for i in range(16)], list(range(16)), (tokens.repeat(16, 0), q.repeat(16, 0)), None,
                         [K] * 16)
    assert alone == [[5, 6]] and batch == [[]] * 16


def test_every_16th_chain_explores():
    """Chains too unlikely to pay still draft their first token once in 16: 64 chains in 4 steps, 4 drafts of one
    token (a cell never verified would never be learned)."""
    planner = planner_with({0: 0.01}, ratio=1.0)
    planner.EXPLORE = DraftPlanner.EXPLORE
    planner.arm = "both"
    q = np.full((16, K), 0.01)
    tokens = np.arange(16 * K).reshape(16, K)
    drafts = [planner.plan([str(i) for i in range(16)], list(range(16)), (tokens, q), None, [K] * 16)
              for _ in range(4)]
    assert sorted(len(d) for step in drafts for d in step) == [0] * 60 + [1] * 4


def test_fixed_lengths_draft_every_token_the_room_allows():
    planner = planner_with({0: 0.01}, ratio=0.1, lengths="fixed")
    q = np.full((2, K), 0.01)
    tokens = np.array([[1, 2, 3], [4, 5, 6]])
    assert planner.plan(["a", "b", "c"], [0, 2], (tokens, q), None, [K, 1]) == [[1, 2, 3], [], [4]]


def test_a_request_drafts_the_chain_expected_to_give_more():
    """The lookup's chain where its n-gram is calibrated likelier than the heads' tokens, the heads' otherwise; where
    the two agree, the shared tokens are counted as both."""
    planner = planner_with({1: 0.1, 9: 0.9}, ratio=1e4, lengths="fixed")
    c = planner.calibrator
    lookup3 = (LOOKUP * c.max_depth + 0) * c.bins + 2
    c.count(np.array([lookup3] * 1000), np.array([lookup3] * 800))
    heads = (np.array([[1, 2, 3], [1, 2, 3]]), np.array([[0.15] * 3, [0.95] * 3]))
    found = [(np.array([7, 8, 9]), 3), (np.array([7, 8, 9]), 3)]
    assert planner.plan(["a", "b"], [0, 1], heads, found, [K, K]) == [[7, 8, 9], [1, 2, 3]]
    assert planner.pending["a"].tolist() == planner._cells(np.full(3, LOOKUP), np.zeros(3), 3).tolist()
    agree = [(np.array([1, 2, 9]), 3)]
    assert planner.plan(["a"], [0], (heads[0][:1], heads[1][:1]), agree, [K]) == [[1, 2, 3]]
    assert planner.pending["a"].tolist() == planner._cells(np.array([BOTH, BOTH, SCORED]), heads[1][0], 3).tolist()


def test_the_planner_counts_what_vllm_verified():
    """After a step drafting 3 tokens for `a` (2 accepted), 3 for `b` of which vLLM verified only 1 (accepted), and
    3 for `c` (none accepted): the tried and accepted counts of each depth's cells are those."""
    clock = iter(range(100)).__next__
    planner = DraftPlanner(K, use_lookup=False, lengths="fixed", clock=clock)
    planner.start(["a", "b", "c"], [[1], [1], [1]], {}, 3, True)
    q = np.array([[0.95, 0.95, 0.95]] * 3)
    planner.plan(["a", "b", "c"], [0, 1, 2], (np.array([[1, 2, 3]] * 3), q), None, [K] * 3)
    cells = planner.pending["a"]
    planner.start(["c", "a", "b"], [[9], [1, 2, 7], [1, 2]], {"a": 3, "b": 1, "c": 3}, 10, True)
    trials, hits = planner.calibrator.trials.numpy(), planner.calibrator.hits.numpy()
    assert trials[cells].round(6).tolist() == [3.0, 1.0, 1.0]  # depth 1: all three; b verified only its first
    assert hits[cells].round(6).tolist() == [2.0, 1.0, 0.0]
    assert planner.pending == {}


def test_the_arm_that_earns_more_tokens_a_second_runs_most():
    """A fake clock: steps that run the heads take 3x the time of lookup steps and earn 2x the tokens: the planner
    settles on lookup, probing the heads only now and then."""
    now = [0.0]
    planner = DraftPlanner(K, use_lookup=True, clock=lambda: now[0])
    arms = []
    for _ in range(120):
        arm = planner.start(["a"], [[1, 2] if arms and arms[-1] == "both" else [1]], {}, 1, True)
        arms.append(arm)
        now[0] += 3.0 if arm == "both" else 1.0
    assert arms[-60:].count("lookup") > 50


def test_the_speculative_config_keys(tmp_path):
    """`lookup` and `lengths` travel in the model string vLLM hands every process; a bad value is refused in one
    line; without them, the defaults."""
    target = tiny_model("llama", seed=3, hidden=64, layers=2)
    DraftHeads.for_target(target, "chained", num_heads=K, context_layers=0).save_pretrained(tmp_path / "heads")
    model_config = type("M", (), {"get_hidden_size": lambda self: 64, "get_vocab_size": lambda self: 260})()
    cfg = _translate({"method": "medusa_train", "model": str(tmp_path / "heads"), "lookup": False}, model_config)
    assert cfg["method"] == "custom_class" and "lookup" not in cfg and cfg["num_speculative_tokens"] == K
    assert settings_of(cfg["model"]) == (str((tmp_path / "heads").resolve()), {"lookup": False, "lengths": "auto"})
    assert settings_of(str(tmp_path)) == (str(tmp_path), SETTINGS)
    for bad, message in [({"lookup": "no"}, '"lookup" is \'no\': set it to true'),
                         ({"lengths": "short"}, '"lengths" is \'short\': set it to "auto"')]:
        with pytest.raises(ValueError, match=message):
            _translate({"method": "medusa_train", "model": str(tmp_path / "heads")} | bad, model_config)
