"""inference.profile_step times `speculative_step` phase by phase from inside the step (a `PhaseClock`), so its
numbers describe the engine that generates: timed or not, a step does the same work."""

from __future__ import annotations

import torch
from test_inference_greedy import greedy_reference, random_heads
from tiny import tiny_model, tiny_tokenizer

from inference import HeadsDrafter, HybridDrafter, SpeculativeGenerator
from inference.engine.generator import PHASES, GenerationStats, PhaseClock, Sampling
from inference.profile_step import profile_generator


def _generator(model):
    heads = random_heads(model, "chained", 3, seed=4, context_layers=1)  # a context encoder: observe runs too
    return SpeculativeGenerator(model, tiny_tokenizer(), HybridDrafter(HeadsDrafter(heads, model), lookup_nodes=2))


def test_a_clocked_step_is_the_step():
    """The phases are timed inside `speculative_step` itself: with a clock it commits the same tokens, verifies
    the same rows and teaches the calibrator the same as without, and every phase it timed ran."""
    model = tiny_model("llama", seed=2).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3)) % 8 + 60  # repeats: lookup hits
    costs = [0.0] + [1.0 + 0.1 * n for n in range(1, 40)]  # the calibrated trim runs, with steep enough costs to cut
    runs = []
    for clock in (None, PhaseClock()):
        gen = _generator(model)
        stats = GenerationStats()
        steps = 0
        with torch.inference_mode():
            state = gen.prefill(ids, Sampling())
            while len(state.tokens) < ids.shape[1] + 30:
                gen.speculative_step(state, "static", 6, Sampling(), costs, stats, clock=clock)
                steps += 1
        runs.append((state.tokens, stats.verified_nodes, gen.calibrator.table(), steps))
    assert runs[0] == runs[1]
    assert runs[0][0][ids.shape[1]:ids.shape[1] + 30] == greedy_reference(model, ids, 30, eos_token_id=[]).tolist()
    assert clock.rows == runs[1][1] > runs[1][3]  # drafted nodes were verified beside each root
    assert set(clock.seconds) == set(PHASES) and all(clock.seconds[p] > 0 for p in PHASES)


def test_profile_generator_reports_every_phase_and_tau():
    model = tiny_model("llama", seed=2).eval()
    gen = _generator(model)
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]
    r = profile_generator(gen, prompts, budget=5, max_new_tokens=20)
    assert set(PHASES) <= set(r) and all(r[p] > 0 for p in PHASES)  # every phase ran (context heads: observe too)
    assert r["rows"] == 6.0 and r["budget"] == 5  # a fixed budget is never trimmed: 5 draft nodes + the root
    engine = sum(r[p] for p in PHASES if p != "verify")
    assert r["engine_share_of_verify"] == engine / r["verify"]
    assert 1.0 <= r["tau"] <= gen.drafter.max_depth + 1  # each forward: the bonus token, at most a full path more


def test_the_random_mode_profiles_the_small_targets_shape():
    """`python -m inference.profile_step --shape small` (the random mode, default dtype: it once crashed on a
    torch.device): a Qwen2 model of the small target's shape, heads on a draft vocabulary, a fixed budget."""
    from inference.profile_step import profile

    r = profile(torch.device("cpu"), budget=4, steps=6, draft_vocab=64, shape="small")  # as main() passes it
    assert r["rows"] == 5.0 and r["budget"] == 4 and r["draft"] > 0 and r["verify"] > 0
