"""inference.engine.choice: each CPU step under the auto budget runs the way of drafting that has earned the most
tokens per second (the default, the heads alone, the lookup alone, or none), trying the others now and then. The
generation tests run on a fake clock that charges each target forward and each heads draft a fixed cost, so the
choice is decided by what the steps do, not by the machine's load; the output is the target's throughout."""

from __future__ import annotations

import pytest
import torch
from test_hybrid import PlantedLookup
from test_inference_greedy import PlantedDrafter, float64_model, greedy_reference
from tiny import VOCAB, tiny_tokenizer

from inference import HybridDrafter, NGramDrafter, SpeculativeGenerator
from inference.engine.choice import StepChoice
from medusa_train.target.model import decoder


def test_each_arm_is_tried_then_the_best_runs_and_the_others_are_probed():
    choice = StepChoice(["a", "b", "c"])
    rates = {"a": (2, 1.0), "b": (3, 1.0), "c": (1, 2.0)}  # tokens, seconds: b earns the most
    ran = []
    for _ in range(60):
        arm = choice.choose()
        ran.append(arm)
        choice.record(arm, *rates[arm])
    assert ran[:6] == ["a", "a", "b", "b", "c", "c"]  # FIRST_TRIES each, in order
    later = ran[6:]
    probes = [i for i, a in enumerate(later, start=7) if a != "b"]
    assert all(i % StepChoice.PROBE_EVERY == 0 for i in probes)  # only probe steps leave the best
    assert {later[i - 7] for i in probes} == {"a", "c"}  # and the probes take turns
    assert choice.best() == "b" and choice.rate("b") == pytest.approx(3.0)


def test_an_arm_that_gets_better_takes_over_after_a_probe():
    choice = StepChoice(["x", "y"])
    for _ in range(4):
        arm = choice.choose()
        choice.record(arm, 4 if arm == "x" else 1, 1.0)
    assert choice.best() == "x"
    for _ in range(3 * StepChoice.PROBE_EVERY):  # y now earns 8 tokens a step; the probes see it
        arm = choice.choose()
        choice.record(arm, 4 if arm == "x" else 8, 1.0)
    assert choice.best() == "y"


class FakeClock:
    """Seconds that pass only when the target runs a forward (1.0) or the planted heads draft (`heads_cost`)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _generator(model, drafter, clock: FakeClock, heads: PlantedDrafter, heads_cost: float):
    gen = SpeculativeGenerator(model, tiny_tokenizer(), drafter)
    gen.verify_costs = lambda: [0.0] + [1.0 + 0.01 * (n - 1) for n in range(1, 33)]  # flat: the trim keeps nodes
    gen.draft_costs = lambda: [0.0] * 32
    gen._auto_budget = 6
    gen.choice.clock = clock
    decoder(model).register_forward_pre_hook(lambda *a: setattr(clock, "now", clock.now + 1.0))  # every forward
    real = heads.draft

    def costly(ctx):
        clock.now += heads_cost
        return real(ctx)

    heads.draft = costly
    return gen


@pytest.mark.parametrize("case", ["heads always wrong, lookup always right", "heads right, lookup never matches"])
def test_the_default_runs_the_part_that_pays(case):
    model = float64_model("llama")
    input_ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = greedy_reference(model, input_ids, 120, eos_token_id=[])
    truth = input_ids[0].tolist() + want.tolist()
    heads_right = case.startswith("heads right")
    heads = PlantedDrafter(truth, VOCAB, 4, true_rank=0 if heads_right else None)
    lookup = PlantedLookup(truth, 3) if not heads_right else NGramDrafter(max_depth=3, branches=1, min_ngram=3,
                                                                          max_ngram=3)
    clock = FakeClock()
    gen = _generator(model, HybridDrafter(heads, lookup, lookup_nodes=3), clock, heads, heads_cost=0.5)
    if heads_right:  # a lookup that never matches: random prompt tokens, no 3-gram repeats in what the heads guess
        lookup.matches = lambda tokens, depth: ([], 0)
    out = gen.generate(input_ids, max_new_tokens=120, eos_token_id=[])
    assert out.token_ids.tolist() == want.tolist()  # whatever ran, the target's output
    arms = out.stats.arms
    assert sum(arms.values()) == out.stats.steps
    # heads right and no match: the default and the heads alone draft the same tree; either is the heads
    winners = {"lookup"} if not heads_right else {"both", "primary"}
    ran = sum(n for a, n in arms.items() if a in winners)
    others = out.stats.steps - ran
    first = StepChoice.FIRST_TRIES * len(set(gen.choice.arms) - winners)
    assert others <= first + out.stats.steps // StepChoice.PROBE_EVERY + 1 < ran, arms
    context = 0 if heads_right else 3  # the lookup's match length: the planted one always matches a 3-gram
    assert gen.choice.best(context) in winners, gen.choice.summary()


def test_a_drafter_that_never_pays_falls_back_to_plain_steps():
    """Heads always wrong and no lookup: plain steps (1 token for one forward) beat drafting (1 token for a forward
    and a draft), so after the first tries nearly every step drafts nothing."""
    model = float64_model("llama")
    input_ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    want = greedy_reference(model, input_ids, 60, eos_token_id=[])
    heads = PlantedDrafter(input_ids[0].tolist() + want.tolist(), VOCAB, 4, true_rank=None)
    clock = FakeClock()
    gen = _generator(model, heads, clock, heads, heads_cost=0.5)
    out = gen.generate(input_ids, max_new_tokens=60, eos_token_id=[])
    assert out.token_ids.tolist() == want.tolist()
    assert gen.choice.arms == ["both", "plain"] and gen.choice.best() == "plain"
    assert out.stats.arms["plain"] > 3 * out.stats.arms["both"], out.stats.arms


def test_a_pinned_budget_makes_no_choice():
    model = float64_model("llama")
    input_ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    want = greedy_reference(model, input_ids, 20, eos_token_id=[])
    heads = PlantedDrafter(input_ids[0].tolist() + want.tolist(), VOCAB, 4, true_rank=None)
    gen = SpeculativeGenerator(model, tiny_tokenizer(), HybridDrafter(heads, lookup_nodes=2))
    out = gen.generate(input_ids, max_new_tokens=20, tree_budget=4, eos_token_id=[])
    assert out.token_ids.tolist() == want.tolist() and out.stats.arms == {}


def test_the_choice_is_kept_per_lookup_match():
    """Lookup alone earns most where the context's last 3-gram occurred before and nothing where it did not: kept
    apart, each context runs its own best arm (a mean over both would pick one arm for every step)."""
    choice = StepChoice(["both", "lookup", "plain"])
    earned = {(3, "lookup"): 4, (3, "both"): 3, (3, "plain"): 1, (0, "lookup"): 1, (0, "both"): 3, (0, "plain"): 1}
    for step in range(80):
        context = 3 if step % 2 else 0
        arm = choice.choose(context)
        choice.record(arm, earned[context, arm], 1.0, context)
    assert (choice.best(3), choice.best(0)) == ("lookup", "both")
