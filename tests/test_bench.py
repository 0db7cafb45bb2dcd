"""The benchmark on a tiny model: every method runs, the JSON has the documented schema, and
`exact_match` is reported honestly (a deliberately broken drafter makes it false)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from inference import NGramDrafter, SpeculativeGenerator
from inference import bench
from medusa_train.kinds.heads import DraftHeads
from tiny import save_tiny, tiny_model, tiny_tokenizer

PROMPTS = [{"prompt": "Tell me about the sea."}, {"question_id": 1, "turns": ["Say hello hello hello.", "again"]},
           {"prompt": "abc abc abc abc"}]


def random_heads(model, kind: str, seed: int) -> DraftHeads:
    heads = DraftHeads.for_target(model, kind=kind, num_heads=3)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return heads


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model = save_tiny(root / "target", seed=4)
    random_heads(model, "chained", 1).save_pretrained(root / "chained")
    random_heads(model, "parallel", 2).save_pretrained(root / "parallel")
    random_heads(model, "eagle3", 2).save_pretrained(root / "eagle3")
    random_heads(model, "dflash", 3).save_pretrained(root / "dflash")
    random_heads(model, "dspark", 4).save_pretrained(root / "dspark")
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS))
    replies = [{"id": i, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": t}]}
               for i, t in enumerate(["hello hello world", "the sea is blue and the sky is blue"])]
    (root / "distilled.jsonl").write_text("\n".join(json.dumps(r) for r in replies))
    return root


def test_cli_runs_every_method_and_writes_the_schema(setup, capsys):
    out, png = setup / "results.json", setup / "bench.png"
    rc = bench.main(["--target", str(setup / "target"), "--heads", str(setup / "chained"), str(setup / "parallel"),
                     "--heads", str(setup / "eagle3"), "--heads", str(setup / "dflash"), str(setup / "dspark"),
                     "--bigram-data", str(setup / "distilled.jsonl"),
                     "--prompts", str(setup / "prompts.jsonl"), "--max-new-tokens", "12", "--tree-budget", "4",
                     "--repeats", "1", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res) == {"machine", "target", "prompts", "prompt_set", "max_new_tokens", "methods"}
    assert res["prompts"] == 3 and res["max_new_tokens"] == 12 and res["target"] == str(setup / "target")
    assert res["prompt_set"] == "3 prompts of prompts.jsonl"  # named in the table and the plot's title too
    assert list(res["methods"]) == [m for m in bench.ALL_METHODS if m != "ar-compiled"]  # that one on request
    # tau is new tokens per target forward: at least 1, at most what one forward can accept (the deepest
    # proposal + the bonus): pld 10 lookup tokens, ngram 5 levels, bigram 4, the heads 3, the hybrid's lookup 4
    deepest = {"ar": 0, "pld": 10, "ngram": 5, "bigram": 4, "parallel": 3, "parallel+ngram": 4, "chained": 3,
               "chained+ngram": 4,
               "eagle3": 2, "eagle3+ngram": 4, "dflash": 3, "dflash+ngram": 4, "dspark": 3, "dspark+ngram": 4}
    ar_rate = res["methods"]["ar"]["tokens_per_s"]
    for name, m in res["methods"].items():
        assert set(m) == {"tokens_per_s", "tau", "speedup", "exact_match"}
        assert m["exact_match"] is True, name  # the engine is exact; pld is transformers' own
        assert 1.0 <= m["tau"] <= deepest[name] + 1, name
        assert m["speedup"] == pytest.approx(m["tokens_per_s"] / ar_rate, abs=2e-3), name
    assert res["methods"]["ar"]["tau"] == 1.0 and res["methods"]["ar"]["speedup"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "chained" in table and "exact_match" in table and "3 prompts of prompts.jsonl" in table


def test_a_broken_drafter_is_reported_as_not_exact():
    model, tok = tiny_model("llama", seed=5), tiny_tokenizer()

    class RootSwapDrafter(NGramDrafter):
        """Feeds a wrong root token to verification: the target then continues from a corrupted context."""

        def draft(self, ctx):
            tree = super().draft(ctx)
            tokens = tree.tokens.clone()
            tokens[0] = (tokens[0] + 1) % model.config.vocab_size
            return dataclasses.replace(tree, tokens=tokens)

    runners = {"ar": bench.hf_runner(model, tok.pad_token_id),
               "ngram": bench.engine_runner(SpeculativeGenerator(model, tok, NGramDrafter()), tree_budget=3),
               "broken": bench.engine_runner(SpeculativeGenerator(model, tok, RootSwapDrafter()), tree_budget=3)}
    prompts = [bench.render(tok, p) for p in ("hello there", "one two one two one two")]
    lines = []
    summary = bench.run_benchmark(runners, prompts, max_new_tokens=16, warmup=0, log=lines.append)
    assert summary["ar"]["exact_match"] and summary["ngram"]["exact_match"]
    assert summary["broken"]["exact_match"] is False
    # the log names where the output first left ar's: the root swap corrupts the second new token
    said = [line for line in lines if "differs" in line]
    assert said and all("broken differs from ar at new token 1 " in line for line in said)


def test_interleaving_rotates_and_repeats():
    calls = []

    def fake(name):
        def run(ids, n):
            calls.append(name)
            return bench.RunResult([1] * n, n if name == "ar" else 2, 1.0)
        return run

    runners = {m: fake(m) for m in ("ar", "x", "y")}
    prompts = [torch.tensor([[1]])] * 3
    summary = bench.run_benchmark(runners, prompts, max_new_tokens=4, repeats=2, warmup=1)
    assert calls[:3] == ["ar", "x", "y"]  # warm-up
    assert calls[3:] == ["ar", "x", "y"] * 2 + ["x", "y", "ar"] * 2 + ["y", "ar", "x"] * 2
    assert summary["x"]["tau"] == 2.0 and summary["ar"]["tau"] == 1.0 and summary["x"]["speedup"] == 1.0


def test_prompt_formats(tmp_path):
    # a blank prompt is skipped and a repeated one kept once (the benchmark reads prompts as distill does)
    rows = PROMPTS[:2] + [{"prompt": "  "}, {"prompt": "Tell me about the sea."}] + PROMPTS[2:]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(p) for p in rows))
    assert bench.load_bench_prompts(str(tmp_path / "p.jsonl")) == [
        "Tell me about the sea.", "Say hello hello hello.", "abc abc abc abc"]
    assert bench.load_bench_prompts(str(tmp_path / "p.jsonl"), limit=1) == ["Tell me about the sea."]
    held = bench.load_bench_prompts("default", limit=5)
    assert len(held) == 5 and all(isinstance(t, str) and t for t in held)
    # stride keeps every n-th prompt (a per-category sample of MT-Bench), then limit cuts
    strided = bench.load_bench_prompts(str(tmp_path / "p.jsonl"), stride=2)
    assert strided == ["Tell me about the sea.", "abc abc abc abc"]
    assert bench.load_bench_prompts(str(tmp_path / "p.jsonl"), limit=1, stride=2) == ["Tell me about the sea."]


def test_later_turns_are_benchmarked_after_the_replies_before_them(tmp_path):
    """`--turn 2`: each conversation up to its second user turn, with the reply before it (distill --turns all
    wrote it); rows without that many turns are left out; a source without the replies says how to write them."""
    u, a = "user", "assistant"
    rows = [{"id": "x", "messages": [{"role": u, "content": "q1"}, {"role": a, "content": "r1"},
                                     {"role": u, "content": "q2"}, {"role": a, "content": "r2"}]},
            {"id": "y", "messages": [{"role": u, "content": "only"}, {"role": a, "content": "one"}]},
            {"id": "z", "messages": [{"role": u, "content": "p1"}, {"role": a, "content": "s1"},
                                     {"role": u, "content": "p2"}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert bench.load_bench_prompts(str(tmp_path / "d.jsonl"), turn=2) == [rows[0]["messages"][:3],
                                                                           rows[2]["messages"]]
    assert bench.load_bench_prompts(str(tmp_path / "d.jsonl"), turn=2, limit=1) == [rows[0]["messages"][:3]]
    (tmp_path / "mt.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["first", "second"]}))
    with pytest.raises(bench.BenchError, match="--turn 2: no row of .* holds 2 user turns with the replies between "
                                               "them; write the target's own replies first: .* --turns all"):
        bench.load_bench_prompts(str(tmp_path / "mt.jsonl"), turn=2)
    tok = tiny_tokenizer()
    ids = bench.render(tok, rows[0]["messages"][:3])[0].tolist()
    assert ids == tok.apply_chat_template(rows[0]["messages"][:3], add_generation_prompt=True, tokenize=True,
                                          return_dict=False)


def test_bigram_texts_read_a_directory_of_jsonl(tmp_path):
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "reply one"}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(chat) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"output": "reply two"}) + "\n")
    assert bench.bigram_texts(str(tmp_path)) == ["reply one", "reply two"]
    assert bench.bigram_texts(str(tmp_path / "b.jsonl")) == ["reply two"]
    # plain text and every answer column the trainer knows count too
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "plain", "completion": "done", "id": "7"}) + "\n")
    assert bench.bigram_texts(str(tmp_path / "c.jsonl")) == ["plain", "done"]
    (tmp_path / "notes.txt").write_text("not data")  # the trainer would refuse this directory; so do we
    with pytest.raises(ValueError, match="mixes file types"):
        bench.bigram_texts(str(tmp_path))


def test_replies_of_one_target_are_counted_against_another_targets(setup, tmp_path, capsys):
    """--replies writes ar's greedy replies; --replies-against counts the identical ones (a target against itself:
    all; against another model: those that agree, and where the rest part)."""
    from test_inference_greedy import greedy_reference

    common = ["--prompts", str(setup / "prompts.jsonl"), "--max-new-tokens", "10", "--methods", "ar", "--warmup", "0"]
    mine = tmp_path / "mine.jsonl"
    assert bench.main(["--target", str(setup / "target"), *common, "--replies", str(mine)]) == 0
    written = [json.loads(line) for line in mine.read_text().splitlines()]
    model = tiny_model(seed=4)  # the saved target
    tok = tiny_tokenizer()
    want = [greedy_reference(model, bench.render(tok, t), 10).tolist() for t in bench.load_bench_prompts(
        str(setup / "prompts.jsonl"))]
    assert [r["tokens"] for r in written] == want and [r["prompt"] for r in written] == [0, 1, 2]
    out = tmp_path / "same.json"
    assert bench.main(["--target", str(setup / "target"), *common, "--replies-against", str(mine),
                       "--out", str(out)]) == 0
    assert json.loads(out.read_text())["replies_against"] == {"against": str(mine), "prompts": 3, "identical": 3,
                                                             "median_first_difference": None}
    assert "greedy replies identical to" in capsys.readouterr().out
    # one reply changed at new token 2, one at token 0: 1 of 3 identical, parting at token 2 in the median
    other = [dict(r) for r in written]
    other[0]["tokens"] = other[0]["tokens"][:2] + [(other[0]["tokens"][2] + 1) % 200] + other[0]["tokens"][3:]
    other[2]["tokens"] = [(other[2]["tokens"][0] + 1) % 200] + other[2]["tokens"][1:]
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps(r) + "\n" for r in other))
    assert bench.main(["--target", str(setup / "target"), *common, "--replies-against", str(edited),
                       "--out", str(out)]) == 0
    got = json.loads(out.read_text())["replies_against"]
    assert (got["identical"], got["median_first_difference"]) == (1, 2)
    assert bench.main(["--target", str(setup / "target"), *common, "--limit", "2", "--replies-against",
                       str(mine)]) == 2
    assert "holds 3 replies, this run has 2 prompts" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ar,chained"], "method chained needs --heads"),
    (["--methods", "ar,warp"], "unknown warp"),
    (["--prompts", "missing.jsonl"], "--prompts: file not found"),
    (["--stride", "0"], "--stride must be >= 1"),
    (["--heads", "nope"], "--heads: not found"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--tree-budget", "abc"], "--tree-budget must be 'auto' or a number of draft nodes >= 0"),
])
def test_bad_input_exits_2(setup, capsys, argv, message):
    assert bench.main(["--target", str(setup / "target"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_compile_on_a_cpu_through_the_cli(setup, capsys):
    """`bench --compile` on a CPU with inductor, as the README runs it: the engine's compiled verify and
    transformers' compiled plain decoding, both exact (it crashed: the packed oneDNN linears cannot be lowered)."""
    out = setup / "compiled.json"
    rc = bench.main(["--target", str(setup / "target"), "--heads", str(setup / "chained"),
                     "--methods", "ar,ar-compiled,chained", "--prompts", str(setup / "prompts.jsonl"), "--limit", "1",
                     "--max-new-tokens", "6",
                     "--tree-budget", "2", "--repeats", "1", "--compile", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    methods = json.loads(out.read_text())["methods"]
    assert list(methods) == ["ar", "ar-compiled", "chained"]
    assert all(m["exact_match"] for m in methods.values())


def test_prompts_longer_than_the_target_context_are_skipped_with_a_note(setup, tmp_path, capsys):
    """A prompt set with a few long prompts (ShareGPT) on a short-context target: those are skipped and said so,
    the others are measured; with none that fits, one line and exit 2 (the tiny target's context: 512)."""
    mixed, long_only, out = tmp_path / "mixed.jsonl", tmp_path / "long.jsonl", tmp_path / "r.json"
    mixed.write_text("\n".join(json.dumps({"prompt": p}) for p in ["a short one", "x" * 600, "another short one"]))
    long_only.write_text(json.dumps({"prompt": "y" * 600}))
    common = ["--target", str(setup / "target"), "--heads", str(setup / "chained"), "--methods", "ar,chained",
              "--max-new-tokens", "8", "--tree-budget", "2"]
    assert bench.main([*common, "--prompts", str(mixed), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["prompts"] == 2
    assert "skipped 1 of 3 prompts: with 8 new tokens they do not fit the target's context of 512" in \
        capsys.readouterr().err
    assert bench.main([*common, "--prompts", str(long_only)]) == 2
    assert "error: no prompt of" in capsys.readouterr().err


def test_timings_a_generator_takes_are_not_counted_in_its_generation(monkeypatch):
    """A generator times its target at its first call, and again when the machine's load has drifted; the benchmark
    has it do so before starting the clock, so ten seconds of timing never land in one prompt's tokens/s."""
    from types import SimpleNamespace

    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])

    def step_budget(tree, budget):
        now[0] += 100.0  # timing the verify forwards

    def generate(*a, **k):
        now[0] += 1.0
        return SimpleNamespace(token_ids=torch.tensor([1, 2]), stats=SimpleNamespace(target_forwards=2, steps=1,
                                                                                     verified_nodes=3))

    gen = SimpleNamespace(device="cpu", step_budget=step_budget, generate=generate)
    result = bench.engine_runner(gen, "static", "auto")(torch.tensor([[1, 2, 3]]), 2)
    assert result.seconds == 1.0


def test_heads_of_any_kind_are_named_by_their_config(setup, capsys, monkeypatch):
    """--heads takes directories of any kind, each read from its config.json: two of one kind, or a directory that
    holds no heads, are refused in one line before a model loads; so is --plot without matplotlib (it would have
    failed after the whole benchmark)."""
    base = ["--target", str(setup / "target"), "--prompts", str(setup / "prompts.jsonl")]
    assert bench.main([*base, "--heads", str(setup / "chained"), str(setup / "chained")]) == 2
    assert "both hold chained heads" in capsys.readouterr().err
    assert bench.main([*base, "--heads", str(setup / "target")]) == 2
    assert "--heads: " in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it raises ImportError
    assert bench.main([*base, "--plot", str(setup / "x.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_the_vllm_table_takes_each_rounds_speedup_over_its_own_plain_and_reports_the_median(monkeypatch):
    """vLLM's benchmark on a machine whose speed drifts: each round runs plain and the drafter, and a speedup is the
    median round's ratio (not the median drafter over the median plain), with the rounds' spread in the table."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import vllm_default
    import vllm_serve_bench

    rounds = [{"plain": {"tokens_per_s": plain},
               "d": {"tokens_per_s": plain * ratio, "speedup": ratio, "identical": n, "mean_acceptance_length": 2.0}}
              for plain, ratio, n in [(10.0, 1.1, 16), (12.0, 0.9, 16), (8.0, 1.3, 15)]]
    run = vllm_serve_bench.summarize(4, rounds, ["d"])
    assert run["speedup"]["d"] == 1.1  # the ratio of the medians would be 10.8 / 10 = 1.08
    assert run["d"]["tokens_per_s"] == 11.0 and run["plain"]["tokens_per_s"] == 10.0
    assert run["speedup_per_round"]["d"] == [1.1, 0.9, 1.3]
    assert run["identical"]["d"] == 15  # a round whose output differs is not hidden by the others
    assert vllm_default.drafters_of(run) == ["d"]
    table = vllm_default.table({"set": {"runs": [run]}})
    assert "| set | d | 11.0 (1.10x, 0.90-1.30) |" in table


def test_the_vllm_benchmark_warms_up_on_no_measured_prompt_and_caps_suffix_at_the_draft_length(monkeypatch):
    """Suffix decoding caches every response vLLM served: a warm-up on the measured prompts would hand it their
    answers. The warm-up's prompts are none of the measured ones; suffix, like n-gram, drafts at most k tokens."""
    import types
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import vllm_serve_bench

    served, configs = [], []

    class FakeLLM:
        def __init__(self, model, **kwargs):
            configs.append(kwargs.get("speculative_config"))
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: None))

        def generate(self, requests, params, use_tqdm):
            served.append([r["prompt_token_ids"] for r in requests])
            out = types.SimpleNamespace(token_ids=[7] * params.max_tokens)
            return [types.SimpleNamespace(outputs=[out]) for _ in requests]

        def get_metrics(self):
            return []

    fake = types.SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    result = vllm_serve_bench.serve("t", "suffix", prompts, 2, 5, 3)
    warm_up, measured = served
    assert measured == prompts and not any(p in prompts for p in warm_up)
    assert configs == [{"method": "suffix", "num_speculative_tokens": 3}]
    assert result["tokens"] == 15 and result["mean_acceptance_length"] == 1.0
    vllm_serve_bench.serve("t", "ngram", prompts, 2, 5, 3, warmup=[[42, 43]])
    assert served[-2] == [[42, 43]]  # prompts like the measured ones, when given
    assert vllm_serve_bench.speculative_config("ngram", 3)["num_speculative_tokens"] == 3
    assert vllm_serve_bench.speculative_config("/x/export", 2) == {"method": "eagle3", "model": "/x/export",
                                                                   "num_speculative_tokens": 2}
