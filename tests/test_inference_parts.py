"""Trees, drafters, loading from a heads directory, the auto budget and the CLI."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from test_inference_greedy import float64_model, greedy_reference, random_heads
from tiny import save_tiny, tiny_model, tiny_tokenizer

import inference.engine.budget as budget_timing
from inference import BigramDrafter, HeadsDrafter, NGramDrafter, SpeculativeGenerator
from inference.engine.drafters import DraftContext, load_topk_accuracy
from inference.engine.budget import LENGTHS_CPU as AUTO_BUDGET_LENGTHS_CPU
from inference.generate import main
from inference.engine.tree import (ancestor_matrix, complete_paths, expected_tau, expected_tau_curve,
                                   select_dynamic_tree, static_tree_search, topology_from_paths, tree_attention_mask,
                                   tree_position_ids)



# -- trees --------------------------------------------------------------------------------------------


def test_topology_mask_and_positions():
    topo = topology_from_paths([(1, 0), (0,), (0, 0, 2)])  # missing prefixes are added
    assert topo.paths == [(), (0,), (1,), (0, 0), (1, 0), (0, 0, 2)]
    assert topo.parents.tolist() == [0, 0, 0, 1, 2, 3]
    assert topo.depth.tolist() == [0, 1, 1, 2, 2, 3]
    mask = tree_attention_mask(topo.ancestors, prefix_len=3, dtype=torch.float32)[0, 0]
    assert mask.shape == (6, 9)
    allowed = mask == 0
    assert allowed[:, :3].all()  # everyone sees the prefix
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}}
    for i, seen in want.items():
        assert set(torch.nonzero(allowed[i, 3:]).flatten().tolist()) == seen
    assert (mask[~allowed] == torch.finfo(torch.float32).min).all()
    assert tree_position_ids(topo.depth, 3).tolist() == [[3, 4, 4, 5, 5, 6]]
    level2 = topo.levels[1]
    assert level2.parents.tolist() == [1, 2] and level2.nodes.tolist() == [3, 4] and level2.rank.tolist() == [0, 0]


def test_ancestor_matrix_of_a_chain():
    anc = ancestor_matrix(torch.tensor([0, 0, 1, 2]), 3)
    assert torch.equal(anc, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def _brute_force_best(acc, budget):
    nodes = [p for d in (1, 2) for p in itertools.product(range(len(acc[0])), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(nodes, budget):
        if all(p[:-1] in subset or len(p) == 1 for p in subset):
            best = max(best, expected_tau(subset, acc))
    return best


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_static_tree_search_is_optimal_and_closed(budget):
    acc = [[0.55, 0.2, 0.1], [0.4, 0.25, 0.05]]
    paths = static_tree_search(acc, budget)
    assert len(paths) == budget and len(set(paths)) == budget
    assert set(complete_paths(paths)[1:]) == set(paths)  # prefix-closed
    assert expected_tau(paths, acc) == pytest.approx(_brute_force_best(acc, budget))
    curve = expected_tau_curve(acc, 12)
    assert curve[budget] == pytest.approx(expected_tau(paths, acc))
    assert all(a <= b for a, b in zip(curve, curve[1:]))  # more nodes never hurt the expectation


def test_select_dynamic_tree_keeps_best_nodes_as_a_tree():
    # pool: root, 3 children, each child with 2 children (depth 2); scores cumulative
    tokens = torch.arange(10)
    parents = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 3])
    depth = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2, 2, 2])
    scores = torch.tensor([0.0, -0.1, -1.0, -3.0, -0.2, -2.5, -1.1, -4.0, -3.1, -3.2])
    tree = select_dynamic_tree(tokens, parents, depth, scores, budget=4, max_depth=2)
    assert tree.tokens.tolist() == [0, 1, 2, 4, 6]  # best four: -0.1, -0.2, -1.0, -1.1
    assert tree.parents.tolist() == [0, 0, 0, 1, 2]
    # a child whose score ties its parent's still comes after it
    tree = select_dynamic_tree(tokens[:3], torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]),
                               torch.tensor([0.0, -0.5, -0.5]), budget=1, max_depth=2)
    assert tree.tokens.tolist() == [0, 1]


def test_heads_drafter_dynamic_tree_shape():
    model = tiny_model("llama")
    drafter = HeadsDrafter(random_heads(model, "chained", 4), model)
    ctx = DraftContext(torch.tensor([5]), torch.randn(32), [1, 2, 5], "dynamic", budget=10)
    tree = drafter.draft(ctx)
    assert tree.size == 11 and tree.tokens[0] == 5
    assert (tree.parents[1:] < torch.arange(1, 11)).all()
    assert torch.equal(tree.depth[1:], tree.depth[tree.parents[1:]] + 1)
    static = drafter.draft(DraftContext(torch.tensor([5]), torch.randn(32), [1, 2, 5], "static", budget=6))
    assert static.size == 7


# -- n-gram and bigram --------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_last_match():
    drafter = NGramDrafter(max_ngram=2, max_depth=3, branches=2)
    tokens = [7, 8, 1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2]
    assert drafter.continuations(tokens, 3) == [[4, 5, 6], [3, 9, 1]]  # most recent first
    tree = drafter.draft(DraftContext(torch.tensor([2]), torch.zeros(4), tokens, "static", budget=4))
    # the most recent match's whole chain first, then the next branch while the budget lasts; nodes
    # ordered by depth so parents come first
    assert tree.tokens.tolist() == [2, 4, 3, 5, 6]
    assert tree.parents.tolist() == [0, 0, 0, 1, 3]
    none = drafter.draft(DraftContext(torch.tensor([42]), torch.zeros(4), [1, 2, 42], "static", budget=4))
    assert none.size == 1


def test_bigram_table_save_load_and_texts(tmp_path):
    seqs = [[1, 2, 1, 2, 1, 3], [2, 1, 2, 0]]
    drafter = BigramDrafter.from_token_ids(seqs, vocab_size=5, top_k=2)
    # successors: 1 -> 2 (x3), 3 (x1); 2 -> 1 (x3), 0 (x1); 0 and 4 never precede: unigram fallback (1 and 2)
    assert drafter.table[1].tolist() == [2, 3] and drafter.table[2].tolist() == [1, 0]
    assert drafter.table[4].tolist() == [1, 2]
    assert drafter.logq[1].exp().tolist() == pytest.approx([0.75, 0.25])
    drafter.save(tmp_path / "bigram.safetensors")
    loaded = BigramDrafter.load(tmp_path / "bigram.safetensors")
    assert torch.equal(loaded.table, drafter.table) and torch.equal(loaded.logq, drafter.logq)
    assert loaded.max_depth == drafter.max_depth
    tok = tiny_tokenizer()
    from_text = BigramDrafter.from_texts(["abab", "abc"], tok, top_k=2)
    a, b = tok("a")["input_ids"][0], tok("b")["input_ids"][0]
    assert from_text.table.shape == (len(tok), 2) and from_text.table[a, 0] == b
    with pytest.raises(ValueError, match="vocab_size"):
        BigramDrafter.from_token_ids([[1, 9]], vocab_size=5)


# -- loading, auto budget, CLI ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    model = save_tiny(root / "target", "llama", seed=3)
    heads = random_heads(model, "chained", 3, seed=1)
    heads.spec.target_name = str(root / "target")
    heads.save_pretrained(root / "heads")
    acc = {"topk_accuracy": [[0.9, 0.05] + [0.0] * 8, [0.8, 0.1] + [0.0] * 8, [0.7] + [0.0] * 9], "expected_tau": 3}
    (root / "heads" / "acceptance.json").write_text(json.dumps(acc))
    return root


def test_from_pretrained_loads_the_named_target_and_acceptance(heads_dir):
    gen = SpeculativeGenerator.from_pretrained(heads_dir / "heads", device="cpu")
    assert load_topk_accuracy(heads_dir / "heads")[0][0] == 0.9
    assert gen.drafter.topk_accuracy()[2][0] == 0.7
    # static tree search follows the measured rates: the chain (0.9, 0.72, 0.504), then (0, 1): 0.09 > 0.05
    assert static_tree_search(gen.drafter.topk_accuracy(), 4) == [(0,), (0, 0), (0, 0, 0), (0, 1)]
    ids = gen.encode("hello world")
    out = gen.generate("hello world", max_new_tokens=15, tree="static", tree_budget=4, eos_token_id=[])
    assert out.token_ids.tolist() == greedy_reference(gen.target, ids.cpu(), 15, eos_token_id=[]).tolist()


def test_bad_acceptance_file_is_named(tmp_path):
    (tmp_path / "acceptance.json").write_text(json.dumps({"topk_accuracy": 3}))
    with pytest.raises(ValueError, match="acceptance.json"):
        load_topk_accuracy(tmp_path)


def test_auto_budget_is_measured_once_and_in_range():
    model = float64_model("gpt2")
    gen = SpeculativeGenerator(model, None, HeadsDrafter(random_heads(model, "parallel", 3), model))
    calls = []
    measure = gen.verify_seconds

    def counting():
        calls.append(1)
        return measure()

    gen.verify_seconds = counting
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    out = gen.generate(ids, max_new_tokens=6, eos_token_id=[])
    gen.generate(ids, max_new_tokens=6, eos_token_id=[])
    assert len(calls) == 1
    times = measure()
    assert sorted(times) == list(AUTO_BUDGET_LENGTHS_CPU) and all(t > 0 for t in times.values())
    assert list(AUTO_BUDGET_LENGTHS_CPU[:16]) == list(range(1, 17))  # every size up to 16 is timed on a CPU
    assert all(times[a] <= times[b] for a, b in zip(AUTO_BUDGET_LENGTHS_CPU, AUTO_BUDGET_LENGTHS_CPU[1:]))
    # the budget maximises expected tokens per second of a step: tau(b) / (t(b + 1 rows) + draft(b)), t
    # interpolated linearly between the timed lengths, draft timed at budgets 0..15, 23, 31
    lengths = list(AUTO_BUDGET_LENGTHS_CPU)
    tau = gen.drafter.expected_tau(lengths[-1] - 1)
    draft = gen.draft_costs()
    assert len(draft) == lengths[-1] and all(t > 0 for t in draft[1:])
    rate = [tau[b] / (float(np.interp(b + 1, lengths, [times[n] for n in lengths])) + draft[b])
            for b in range(lengths[-1])]
    assert out.stats.tree_budget == gen.auto_tree_budget() == max(range(len(rate)), key=rate.__getitem__)
    assert out.token_ids.tolist() == greedy_reference(model, ids, 6, eos_token_id=[]).tolist()


def test_auto_budget_counts_what_drafting_costs():
    """Drafting that costs as much as a verify row per node moves the auto budget down; free drafting leaves it
    where the verify timings alone put it."""
    model = float64_model("llama")
    gen = SpeculativeGenerator(model, None, HeadsDrafter(random_heads(model, "chained", 4), model))
    costs = [0.0] + [1.0 + 0.02 * n for n in range(1, 33)]  # rows nearly free: a big tree pays
    gen.verify_costs = lambda: costs
    gen.draft_costs = lambda: [0.0] * 32
    free = gen.auto_tree_budget()
    assert free == budget_timing.best_budget(gen.drafter.expected_tau(31), costs)
    gen._auto_budget = None
    gen.draft_costs = lambda: [0.25 * b for b in range(32)]
    assert gen.auto_tree_budget() < free


def test_generators_on_one_target_share_the_verify_timings():
    """The bench builds one generator per method on a shared target: they must choose their budgets from
    one measurement, not from separate ones that differ by machine noise."""
    model, other = float64_model("llama"), float64_model("llama", seed=1)
    a = SpeculativeGenerator(model, None, NGramDrafter())
    b = SpeculativeGenerator(model, None, HeadsDrafter(random_heads(model, "chained", 2), model))
    times = a.verify_seconds()
    assert b.verify_seconds() is times
    assert SpeculativeGenerator(other, None, NGramDrafter()).verify_seconds() is not times
    b.auto_tree_budget()
    b.remeasure_verify_seconds()
    again = b.verify_seconds()
    assert again is not times and sorted(again) == sorted(times)
    assert SpeculativeGenerator(model, None, NGramDrafter()).verify_seconds() is again


def test_cli_prints_text_and_one_stats_line(heads_dir, capsys):
    code = main(["--heads", str(heads_dir / "heads"), "--prompt", "abc", "--max-new-tokens", "8",
                 "--tree-budget", "3", "--device", "cpu"])
    assert code == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert lines[-1].startswith("new_tokens=") and "steps=" in lines[-1] and "tau=" in lines[-1]
    gen = SpeculativeGenerator.from_pretrained(heads_dir / "heads", device="cpu")
    want = gen.generate("abc", max_new_tokens=8, tree_budget=3)
    assert "\n".join(lines[:-1]) == want.text



@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 0, got -3"),
    (["--tree-budget", "abc"], "--tree-budget must be 'auto' or a number of draft nodes >= 0, got 'abc'"),
    (["--tree-budget", "-1"], "--tree-budget must be 'auto'"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--lookup-nodes", "-1"], "--lookup-nodes must be >= 0"),
    (["--heads", "no-such-dir"], "no-such-dir is not a heads directory"),
    (["--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value: 'abc' (see --help)"),  # argparse's
    (["--tree", "bushy"], "argument --tree: invalid choice: 'bushy'"),
])
def test_cli_checks_every_argument_before_loading_a_model(heads_dir, capsys, monkeypatch, argv, message):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", no_loading)
    args = ["--heads", str(heads_dir / "heads"), "--prompt", "abc", *argv]
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own errors exit from inside parse_args
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_verify_timings_are_kept_between_processes_and_remeasured_when_the_key_changes(tmp_path, monkeypatch,
                                                                                       capsys):
    """Timed once per model shape, dtype and machine, said when it happens, kept in the timings file: a second
    process (here: the in-memory timings forgotten) reads them instead of timing again; another dtype, or a
    remeasure, times again."""
    import inference.engine.budget as budget_timing

    monkeypatch.setenv("MEDUSA_TRAIN_TIMINGS", str(tmp_path / "timings.json"))
    model = float64_model("llama", seed=4)
    times = SpeculativeGenerator(model, None, NGramDrafter()).verify_seconds()
    assert "timing the target's verify forward once" in capsys.readouterr().err
    budget_timing._VERIFY_SECONDS.clear()  # as a new process starts
    budget_timing._TIMING_KEYS.clear()
    same_shape = float64_model("llama", seed=5)
    again = SpeculativeGenerator(same_shape, None, NGramDrafter()).verify_seconds()
    assert again == times and capsys.readouterr().err == ""
    other = SpeculativeGenerator(float64_model("llama", seed=5).float(), None, NGramDrafter())
    other.verify_seconds()
    assert "timing the target's verify forward once" in capsys.readouterr().err
    gen = SpeculativeGenerator(same_shape, None, NGramDrafter())
    gen.remeasure_verify_seconds()
    budget_timing._VERIFY_SECONDS.clear()
    gen.verify_seconds()
    assert "timing the target's verify forward once" in capsys.readouterr().err
    # drafting timings too: kept per drafter shape, read back by a generator with heads of the same shape
    heads_gen = SpeculativeGenerator(same_shape, None, HeadsDrafter(random_heads(same_shape, "chained", 2), same_shape))
    drafting = heads_gen.draft_costs()
    budget_timing._VERIFY_SECONDS.clear()
    budget_timing._TIMING_KEYS.clear()
    monkeypatch.setattr(budget_timing, "draft_seconds", lambda *a, **k: pytest.fail("drafting was timed again"))
    other_heads = HeadsDrafter(random_heads(same_shape, "chained", 2, seed=2), same_shape)  # other weights
    assert SpeculativeGenerator(same_shape, None, other_heads).draft_costs() == drafting
    (tmp_path / "timings.json").write_text("{damaged")
    budget_timing._VERIFY_SECONDS.clear()
    assert SpeculativeGenerator(same_shape, None, NGramDrafter()).verify_seconds()  # measured again, not a crash


def fake_timed_verify(monkeypatch, delay_calls: set[int]) -> dict[int, float]:
    """verify_seconds on a fake clock: a verify of n rows takes 1 + 0.1 n ms, plus 50 ms on the calls numbered in
    `delay_calls` (another process taking the cores while the target is timed). Returns the timings."""
    import inference.engine.budget as budget_timing

    clock = [0.0]
    calls = [0]

    def verify(model, cache, tree, layers=()):
        calls[0] += 1
        clock[0] += 1e-3 + 1e-4 * tree.tokens.shape[0] + (0.05 if calls[0] in delay_calls else 0.0)

    monkeypatch.setattr(budget_timing, "verify_tree", verify)
    monkeypatch.setattr(budget_timing.time, "perf_counter", lambda: clock[0])
    model = float64_model("llama", seed=8)
    gen = SpeculativeGenerator(model, None, NGramDrafter(), self_check=False)
    budget_timing.forget_verify_seconds(model)
    monkeypatch.setenv("MEDUSA_TRAIN_TIMINGS", "off")
    return gen.verify_seconds()


def test_a_burst_of_load_while_timing_does_not_move_the_budget(monkeypatch):
    """The timing runs 6 round-robin rounds over every length and keeps each length's least disturbed of the last 5:
    another process that takes the cores for up to 4 whole rounds (here: rounds 2 to 5, every length 50 ms slower)
    leaves the timings, hence the tree budget, exactly as undisturbed; a slowdown in every round is real load
    and moves them."""
    from inference.engine.budget import LENGTHS_CPU, best_budget, verify_costs

    clean = fake_timed_verify(monkeypatch, set())
    per_round = len(LENGTHS_CPU)
    burst = set(range(per_round + 1, 5 * per_round + 1))  # calls of rounds 2..5 (round 1 warms up)
    assert fake_timed_verify(monkeypatch, burst) == pytest.approx(clean, abs=1e-9)  # (the fake clock's rounding)
    tau = [1 + 0.9 * (1 - 0.7 ** b) / 0.3 for b in range(64)]  # a drafter whose extra nodes pay less and less
    assert best_budget(tau, verify_costs(clean)) == best_budget(tau, verify_costs(fake_timed_verify(monkeypatch,
                                                                                                     burst)))
    everywhere = set(range(1, 6 * per_round + 1))
    assert fake_timed_verify(monkeypatch, everywhere) != pytest.approx(clean, abs=1e-3)


def test_steps_that_drift_from_the_timing_trigger_a_new_timing(capsys):
    """The budget was chosen from timings 100x too fast for this machine now (taken while it was idle, or kept from
    another state of it): after a window of CPU steps whose verify ran far slower than predicted the generator says
    so and times again at the next call, once per target; steps in line with the timing do not."""
    from inference.engine.budget import Drift

    def planted(gen, drafting: bool):
        """Timings of 10 us a verify whatever its rows (far too fast, and flat: they do not depend on what the machine
        measured, busy or not); with `drafting`, free drafting too, so the budget drafts (tree steps), else it is 0
        (plain steps): both kinds of step are watched."""
        gen.verify_costs()
        gen._verify_costs = [1e-5] * len(gen._verify_costs)
        gen._draft_costs = [0.0] * (len(gen._verify_costs) - 1) if drafting else None
        return gen

    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    for drafting in (True, False):
        model = float64_model("llama", seed=9 + drafting)
        gen = planted(SpeculativeGenerator(model, None, HeadsDrafter(random_heads(model, "chained", 2), model)),
                      drafting)
        out = gen.generate(ids, max_new_tokens=60, eos_token_id=[])
        assert (out.stats.tree_budget > 0) == drafting
        assert "their timed cost: timing again at the next call" in capsys.readouterr().err
        assert gen._verify_costs is None and gen._auto_budget is None
        for g in (gen, SpeculativeGenerator(model, None, NGramDrafter())):  # the same drift again: once per target
            planted(g, drafting).generate(ids, max_new_tokens=60, eos_token_id=[])
            assert "timing again" not in capsys.readouterr().err and g._verify_costs is not None
        # steps after a prompt far longer than the timing's prefix do not count: their attention costs more, which a
        # new timing would not cure
        fresh = float64_model("llama", seed=11 + drafting)
        long_gen = planted(SpeculativeGenerator(fresh, None, HeadsDrafter(random_heads(fresh, "chained", 2), fresh)),
                           drafting)
        long_gen.generate(torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(2)),
                          max_new_tokens=60, eos_token_id=[])
        assert "timing again" not in capsys.readouterr().err and long_gen.drift.ratios == []
    drift = Drift(window=8)
    for r in [1.0, 1.1, 0.9, 30.0, 40.0, 1.05, 0.95, 1.0]:  # a burst of two slow steps: the median holds
        drift.observe(r * 1e-3, 1e-3)
    assert drift.drifted() is None
    for _ in range(8):
        drift.observe(3e-3, 1e-3)
    assert drift.drifted() == pytest.approx(3.0)
