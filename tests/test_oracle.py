"""The oracle benchmark: a drafter that proposes the target's own greedy continuation is accepted in full, so
tau is exactly what the chain allows, and the efficiency is the measured speedup over the ceiling computed
from the same run's verify timings."""

from __future__ import annotations

import math

import pytest
import torch
from test_inference_greedy import float64_model

from inference.oracle import chain, main, run_oracle


def test_the_oracle_is_accepted_in_full_and_the_ratios_follow_from_the_timings():
    model = float64_model("llama", seed=1)
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    max_new = 21
    result = run_oracle(model, prompts, [1, 3], max_new, pad_token_id=259)
    costs_ms = result["t_verify_ms"]
    for b, m in result["budgets"].items():
        assert m["exact_match"]
        # the prefill gives the first token, then every step B + 1 (the last step may be cut short)
        forwards = 1 + math.ceil((max_new - 1) / (b + 1))
        assert m["tau"] == pytest.approx(max_new / forwards, abs=1e-3)
        # every reported ratio is rounded to 3 decimals (off by up to 5e-4); ceiling and verify share are computed
        # from the reported tau and tokens/s, efficiency from the unrounded speedup and ceiling, whose rounding
        # the bound carries through the quotient
        half = 5e-4 + 1e-9  # (and a hair for floating point)
        assert m["ceiling"] == pytest.approx(m["tau"] * costs_ms[1] / costs_ms[b + 1], abs=half)
        efficiency = m["speedup"] / m["ceiling"]
        assert m["efficiency"] == pytest.approx(efficiency, abs=half + efficiency * (half / m["speedup"] +
                                                                                     half / m["ceiling"]))
        assert m["verify_share"] == pytest.approx(costs_ms[b + 1] / 1e3 * m["tokens_per_s"] / m["tau"], abs=half)
    assert chain(3) == [(0,), (0, 0), (0, 0, 0)]


@pytest.mark.parametrize("argv, message", [
    ([], "exactly one of --target"),
    (["--shape", "small", "--target", "x"], "exactly one of --target"),
    (["--shape", "small", "--budgets", "0,2"], "--budgets must be a comma list of integers >= 1"),
    (["--shape", "small", "--limit", "0"], "--limit must be >= 1"),
])
def test_bad_arguments_exit_2_before_a_model_loads(argv, message, capsys, monkeypatch):
    import inference.oracle as oracle

    monkeypatch.setattr(oracle, "random_target", lambda *a, **k: pytest.fail("a model was built"))
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_compiled_oracle_is_measured_against_compiled_plain_decoding():
    """compile: the engine's compiled path, full acceptance and exact; plain decoding compiled too (transformers'
    static cache + torch.compile), exact, and the efficiency divides the speedup over it; the verify timings are
    the compiled verify's at the row counts it runs (a chain of 3 rows runs at 4)."""
    model = float64_model("llama", seed=2)
    prompts = [torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(9))]
    result = run_oracle(model, prompts, [2], 13, pad_token_id=259, compile="aot_eager")
    assert result["ar_compiled_exact_match"]
    m = result["budgets"][2]
    assert m["exact_match"] and m["tau"] == pytest.approx(13 / 5, abs=1e-3)
    assert m["speedup"] == pytest.approx(m["tokens_per_s"] / result["ar_compiled_tokens_per_s"], rel=2e-3)
    assert m["speedup_eager"] == pytest.approx(m["tokens_per_s"] / result["ar_tokens_per_s"], rel=2e-3)
    assert m["efficiency"] == pytest.approx(m["speedup"] / m["ceiling"], rel=2e-3)
    assert result["t_verify_ms"][3] == result["t_verify_ms"][4]  # padded: 3 rows cost what 4 do
