"""inference.profile_step times a copy of `speculative_step`, phase by phase: the copy must stay in step with
the real method (same tokens, same rows verified, same calibrator learning) or its numbers describe another
engine."""

from __future__ import annotations

import torch
from test_inference_greedy import greedy_reference, random_heads
from tiny import tiny_model, tiny_tokenizer

from inference import HeadsDrafter, HybridDrafter, SpeculativeGenerator
from inference.generate import GenerationStats, Sampling
from inference.profile_step import PHASES, _timed_step, profile_generator


def _generator(model):
    heads = random_heads(model, "chained", 3, seed=4, context_layers=1)  # a context encoder: observe runs too
    return SpeculativeGenerator(model, tiny_tokenizer(), HybridDrafter(HeadsDrafter(heads, model), lookup_nodes=2))


def test_timed_copy_of_the_step_matches_the_step():
    model = tiny_model("llama", seed=2).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3)) % 8 + 60  # repeats: lookup hits
    costs = [0.0] + [1.0 + 0.1 * n for n in range(1, 40)]  # the calibrated trim runs, with steep enough costs to cut
    runs = []
    for timed in (False, True):
        gen = _generator(model)
        totals = dict.fromkeys(PHASES + ("rows",), 0.0)
        stats = GenerationStats()
        with torch.inference_mode():
            state = gen.prefill(ids, Sampling())
            while len(state.tokens) < ids.shape[1] + 30:
                if timed:
                    _timed_step(gen, state, "static", 6, Sampling(), costs, totals, lambda: None)
                else:
                    gen.speculative_step(state, "static", 6, Sampling(), costs, stats)
        runs.append((state.tokens, totals["rows"] if timed else stats.verified_nodes, gen.calibrator.table()))
    assert runs[0][0] == runs[1][0]
    assert runs[0][0][ids.shape[1]:ids.shape[1] + 30] == greedy_reference(model, ids, 30, eos_token_id=[]).tolist()
    assert runs[0][1] == runs[1][1] > 0
    assert runs[0][2] == runs[1][2]
    assert all(totals[p] > 0 for p in PHASES)


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
