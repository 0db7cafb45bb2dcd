"""Prompts the target writes itself (`--prompts self`, issue 38): sampled from the chat template's user-turn prefix,
filtered, excluded against benchmark files, answered, and resumed without duplicates."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny, tiny_model, tiny_tokenizer

from medusa_train import distill as D
from medusa_train import self_prompts as S
from medusa_train.config import ConfigError


def test_the_prefix_is_the_templates_opening_of_a_user_turn():
    tok = tiny_tokenizer()
    assert S.user_turn_prefix(tok) == tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    tok.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template"):
        S.user_turn_prefix(tok)


def test_samples_are_the_models_own_continuations_of_the_prefix():
    """The same as sampling the model directly from the prefix with the batch's seed; asking for the later part
    of the sequence gives the same samples."""
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    got = S.sample_user_turns(model, tok, 6, max_new_tokens=12, batch_size=4, seed=7)
    prefix = S.user_turn_prefix(tok)
    want = []
    for b in range(2):
        torch.manual_seed(7 + b)
        ids = torch.tensor([prefix] * 4)
        seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              top_p=0.95, top_k=None, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                              eos_token_id=[tok.eos_token_id])
        for row in seqs[:, len(prefix):].tolist():
            stop = next((k for k, t in enumerate(row) if t == tok.eos_token_id), None)
            want.append((tok.decode(row if stop is None else row[:stop], skip_special_tokens=True).strip(),
                         stop is not None))
    assert got == want[:6]
    assert S.sample_user_turns(model, tok, 3, max_new_tokens=12, batch_size=4, seed=7, start=3) == want[3:6]


def test_each_filter_drops_what_it_should():
    samples = [
        ("How do I bake sourdough bread at home?", True),  # kept
        ("   ", True),  # empty
        ("Hi there", True),  # short
        ("Write a long story about a dragon who", False),  # unfinished
        ("the cat sat the cat sat the cat sat on it", True),  # repetitive
        ("How do I bake sourdough bread at home quickly?", True),  # near-duplicate of the first
        ("Как испечь хлеб дома без дрожжей быстро?", True),  # language (with latin_only)
        ("Give me three tips for a job interview.", True),  # kept
    ]
    verdict = S.filter_prompts(samples, latin_only=True)  # --exclude: the distill test below
    assert verdict.kept == [0, 7]
    assert verdict.dropped == {"empty": 1, "short": 1, "unfinished": 1, "repetitive": 1, "near_duplicate": 1,
                               "language": 1, "excluded": 0}
    assert S.filter_prompts(samples[6:7]).kept == [0]  # the language filter is an option


def test_distill_answers_the_kept_requests_excludes_benchmarks_and_resumes(tmp_path, monkeypatch):
    """`python -m medusa_train.distill RECIPE --prompts self --limit N`: the kept requests get the target's replies,
    every row says its prompt was self-written, --exclude's prompts are gone, and a rerun adds nothing."""
    save_tiny(tmp_path / "model", "llama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {tmp_path / 'model'}}}\ndata: {{dataset: x.jsonl, format: chat}}\n")
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"turns": ["What is the capital city of France today?"]}) + "\n")
    samples = [("How do I bake sourdough bread at home?", True), ("Hi", True),
               ("What is the capital city of France today?", True), ("Give me three tips for a job interview.", True)]
    drawn = []

    def fake_sample(model, tokenizer, n, start=0, **kw):
        drawn.append((start, n, kw["seed"]))
        return samples[start:start + n]

    monkeypatch.setattr(S, "sample_user_turns", fake_sample)
    out = tmp_path / "self.jsonl"
    args = [str(recipe), "--prompts", "self", "--out", str(out), "--max-new-tokens", "6", "--exclude", str(bench),
            "--seed", "5"]
    assert D.main(args + ["--limit", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == [samples[0][0]]  # "Hi" is short, the benchmark's out
    assert drawn == [(0, 3, 5)]
    assert D.main(args + ["--limit", "4"]) == 0  # a larger job: the kept requests are read back, one more drawn
    assert drawn == [(0, 3, 5), (3, 1, 5)]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == [samples[0][0], samples[3][0]]
    assert [r["id"] for r in rows] == ["self-5-0", "self-5-3"] and all(r["prompt_source"] == "self" for r in rows)
    assert D.main(args + ["--limit", "4"]) == 0  # nothing drawn, nothing answered twice
    assert drawn == [(0, 3, 5), (3, 1, 5)] and len(out.read_text().splitlines()) == 2
    assert D.main(args + ["--limit", "4", "--self-temperature", "0.7"]) == 2  # other settings: refused, not mixed


def test_self_prompts_need_a_limit_and_a_template(tmp_path, capsys):
    save_tiny(tmp_path / "model", "llama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {tmp_path / 'model'}}}\ndata: {{dataset: x.jsonl, format: chat}}\n")
    assert D.main([str(recipe), "--prompts", "self", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "--prompts self needs --limit N" in capsys.readouterr().err
    tok = tiny_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").unlink(missing_ok=True)
    assert D.main([str(recipe), "--prompts", "self", "--limit", "2", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "has no chat template" in capsys.readouterr().err
