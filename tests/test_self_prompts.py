"""Prompts the target writes itself (`--prompts self`, issue 38): sampled from the chat template's user-turn prefix,
filtered, excluded against benchmark files, answered, and resumed without duplicates."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny, tiny_model, tiny_tokenizer

from medusa_train.data import distill as D
from medusa_train.data import self_prompts as S
from medusa_train.config import ConfigError


def test_the_prefix_is_the_templates_opening_of_a_user_turn():
    tok = tiny_tokenizer()
    assert S.user_turn_prefix(tok) == tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    tok.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template"):
        S.user_turn_prefix(tok)


@torch.no_grad()
def _sampled(model, prefix: list[int], seed: int, max_new: int, stops: list[int], temperature=1.0, top_p=0.95):
    """What sampling means, written out: each token drawn by the inverse CDF from the nucleus of the model's
    next-token distribution on everything so far (no cache, no batch, the full sort), one uniform from the request's
    own generator a token."""
    gen, tokens = torch.Generator().manual_seed(seed), []
    for _ in range(max_new):
        probs = torch.softmax(model(torch.tensor([prefix + tokens])).logits[0, -1] / temperature, -1)
        vals, order = probs.sort(descending=True)
        vals = vals.masked_fill(vals.cumsum(-1) - vals >= top_p, 0.0)
        u = float(torch.rand(1, generator=gen)) * float(vals.sum())
        t = int(order[min(int((vals.cumsum(-1) <= u).sum()), len(vals) - 1)])
        if t in stops:
            return tokens, True
        tokens.append(t)
    return tokens, False


def test_samples_are_the_models_own_continuations_of_the_prefix():
    """Request i is the model's own sample after the template's user-turn prefix, from a generator seeded
    sample_seed(seed, i): drawn in any batch, or later, it is the same."""
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    got = S.sample_user_turns(model, tok, range(6), max_new_tokens=12, batch_size=4, seed=7)
    prefix = S.user_turn_prefix(tok)
    want = {}
    for i in range(6):
        tokens, stopped = _sampled(model, prefix, S.sample_seed(7, i), 12, [tok.eos_token_id])
        want[i] = (tok.decode(tokens, skip_special_tokens=True).strip(), stopped)
    assert got == want
    assert S.sample_user_turns(model, tok, [3, 5], max_new_tokens=12, batch_size=1, seed=7) == {3: want[3],
                                                                                               5: want[5]}
    assert S.sample_user_turns(model, tok, [3], max_new_tokens=12, seed=8)[3] != want[3]  # another seed


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
    """`python -m medusa_train.data.distill RECIPE --prompts self --limit N`: the kept requests get the target's
    replies, every row says its prompt was self-written, --exclude's prompts are gone, and a rerun adds nothing."""
    save_tiny(tmp_path / "model", "llama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {tmp_path / 'model'}}}\ndata: {{dataset: x.jsonl, format: chat}}\n")
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"turns": ["What is the capital city of France today?"]}) + "\n")
    samples = [("How do I bake sourdough bread at home?", True), ("Hi", True),
               ("What is the capital city of France today?", True), ("Give me three tips for a job interview.", True)]
    drawn = []

    def fake_sample(model, tokenizer, indices, on_sample=None, **kw):
        drawn.append((list(indices), kw["seed"]))
        for i in indices:
            on_sample(i, *samples[i])
        return {i: samples[i] for i in indices}

    monkeypatch.setattr(S, "sample_user_turns", fake_sample)
    out = tmp_path / "self.jsonl"
    args = [str(recipe), "--prompts", "self", "--out", str(out), "--max-new-tokens", "6", "--exclude", str(bench),
            "--seed", "5"]
    assert D.main(args + ["--limit", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == [samples[0][0]]  # "Hi" is short, the benchmark's out
    assert drawn == [([0, 1, 2], 5)]
    assert D.main(args + ["--limit", "4"]) == 0  # a larger job: the kept requests are read back, one more drawn
    assert drawn == [([0, 1, 2], 5), ([3], 5)]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == [samples[0][0], samples[3][0]]
    assert [r["id"] for r in rows] == ["self-5-0", "self-5-3"] and all(r["prompt_source"] == "self" for r in rows)
    assert D.main(args + ["--limit", "4"]) == 0  # nothing drawn, nothing answered twice
    assert drawn == [([0, 1, 2], 5), ([3], 5)] and len(out.read_text().splitlines()) == 2
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


def test_requests_reach_the_disk_batch_by_batch(tmp_path, monkeypatch):
    """A run stopped while the target writes requests keeps them on disk a batch at a time: the rerun draws only
    the rest."""
    save_tiny(tmp_path / "model", "llama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {tmp_path / 'model'}}}\ndata: {{dataset: x.jsonl, format: chat}}\n")
    samples = [(f"Please tell me about topic number {i} today.", True) for i in range(6)]
    calls = []

    def stopped_after_one_batch(model, tokenizer, indices, on_sample=None, **kw):
        calls.append(list(indices))
        for n, i in enumerate(indices):
            if len(calls) == 1 and n == 3:
                raise KeyboardInterrupt  # Ctrl-C after three requests ended: the first batch (2) is on disk
            on_sample(i, *samples[i])
        return {i: samples[i] for i in indices}

    monkeypatch.setattr(S, "sample_user_turns", stopped_after_one_batch)
    out = tmp_path / "self.jsonl"
    args = [str(recipe), "--prompts", "self", "--limit", "6", "--out", str(out), "--max-new-tokens", "4",
            "--batch-size", "2"]
    assert D.main(args) == 75
    assert [json.loads(line)["id"] for line in D.requests_file(out).read_text().splitlines()] == [0, 1]
    assert D.main(args) == 0
    assert calls == [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5]]
    assert len(out.read_text().splitlines()) == 6


def test_a_follow_up_is_the_models_own_continuation_of_the_conversation(monkeypatch):
    """FollowUps.write samples after the conversation and the template's opening of the next user turn (the same
    as sampling the model directly from that prefix with the seed), and drops what the filters drop."""
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    convs = [[{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how can I help"}],
             [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer it is"}]]
    prefixes = [S.user_turn_prefix(tok, c) for c in convs]
    text = tok.apply_chat_template(convs[0], tokenize=False)
    assert tok.decode(prefixes[0]) == text + "<|im_start|>user\n"
    follow = S.FollowUps(temperature=0.05, max_tokens=10, min_words=1)  # cold: a tiny random model's sample
    # then follows its context (at 1.0 its near-uniform draws hardly depend on what it read)
    seeds = [S.sample_seed(11, k) for k in range(len(convs))]
    got = follow.write(model, tok, convs, seeds, batch_size=2)
    raw = [_sampled(model, p, S.sample_seed(11, k), 10, [tok.eos_token_id], temperature=0.05)
           for k, p in enumerate(prefixes)]
    texts = [tok.decode(t, skip_special_tokens=True).strip() for t, _ in raw]
    assert got == [t if stopped else None for t, (_, stopped) in zip(texts, raw)]  # cut off at max_tokens: dropped
    assert sum(follow.dropped.values()) == got.count(None)
    monkeypatch.setattr(S, "_reject", lambda *a: None)  # every sample kept: compare the texts themselves
    assert all(texts) and S.FollowUps(0.05, max_tokens=10).write(model, tok, convs, seeds) == texts


def test_turns_continue_finished_conversations_with_the_targets_own_follow_ups(tmp_path, monkeypatch):
    """`--turns 2`: a reply that ended gets the follow-up the target wrote and the target's reply to the whole
    conversation; a reply cut at the length limit, or a follow-up a filter dropped, ends the row at one turn."""
    save_tiny(tmp_path / "model", "llama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {tmp_path / 'model'}}}\ndata: {{dataset: x.jsonl, format: chat}}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3)))
    seen = []

    def fake_replies(model, tok, prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, batch_size=None, seeds=None,
                     on_reply=None):
        out = []
        for ids in prompt_ids:
            seen.append(tok.decode(ids))
            first = tok.decode(ids).count("<|im_start|>user") == 1
            q = tok.decode(ids).split("question ")[1][0] if first else "f"
            out.append((f"reply {q}", "length" if q == "1" else "stop", 3))
        return out

    followed = {}

    def fake_follow(self, model, tok, conversations, seeds, batch_size=32):
        followed.update({c[0]["content"]: s for c, s in zip(conversations, seeds)})
        return [None if c[0]["content"] == "question 2" else "and then what happened next?" for c in conversations]

    monkeypatch.setattr(D, "generate_replies", fake_replies)
    monkeypatch.setattr(S.FollowUps, "write", fake_follow)
    out = tmp_path / "o.jsonl"
    assert D.main([str(recipe), "--prompts", str(prompts), "--out", str(out), "--turns", "2"]) == 0
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    by_prompt = {r["messages"][0]["content"]: r["messages"] for r in rows.values()}
    assert [m["content"] for m in by_prompt["question 0"]] == ["question 0", "reply 0",
                                                               "and then what happened next?", "reply f"]
    assert len(by_prompt["question 1"]) == 2 and len(by_prompt["question 2"]) == 2
    assert "question 0" in seen[-1] and "reply 0" in seen[-1] and seen[-1].count("<|im_start|>user") == 2
    assert all(r["generation"]["turns"] == 2 for r in rows.values())
    # each follow-up is seeded by its own conversation (--seed 0, its id, the turn), not by the rows beside it
    assert followed == {r["messages"][0]["content"]: D.hash_id(i) + 1 for i, r in rows.items()
                        if r["messages"][1]["content"] != "reply 1"}
    assert D.main([str(recipe), "--prompts", str(prompts), "--out", str(out)]) == 2  # one turn: not mixed in
    assert D.main([str(recipe), "--prompts", str(prompts), "--out", str(out), "--turns", "0"]) == 2


def test_processes_split_the_requests_and_all_read_them_all(tmp_path, monkeypatch):
    """Under several processes (`accelerate launch -m medusa_train.data.distill ... --prompts self`) each draws its
    share of the requests (every world_size-th), into its own part; the main process merges them, and every process
    goes on with all of them: none drawn twice, none missing, no part left. (Two threads with a barrier stand in for
    two processes.)"""
    import argparse
    import threading

    samples = {i: (f"Request number {i}: how do I plan a trip to city {i}?", True) for i in range(7)}
    drawn: dict[int, list[int]] = {}

    def fake_sample(model, tokenizer, indices, on_sample=None, **kw):
        rank = int(threading.current_thread().name)
        drawn[rank] = list(indices)
        for i in indices:
            on_sample(i, *samples[i])
        return {i: samples[i] for i in indices}

    monkeypatch.setattr(S, "sample_user_turns", fake_sample)
    args = argparse.Namespace(limit=7, seed=3, self_temperature=1.0, self_top_p=0.95, self_max_tokens=96,
                              batch_size=2, latin_only=False, exclude=None)
    barrier = threading.Barrier(2)
    out, results = tmp_path / "self.jsonl", {}

    def run(rank: int) -> None:
        results[rank] = D.self_written(None, None, args, lambda msg: None, out, rank, 2, barrier.wait)

    threads = [threading.Thread(target=run, args=(r,), name=str(r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(drawn[0] + drawn[1]) == list(range(7)) and not set(drawn[0]) & set(drawn[1])
    assert [p.id for p in results[0]] == [p.id for p in results[1]] == [f"self-3-{i}" for i in range(7)]
    assert not list(tmp_path.glob("*.rank*"))
    assert len(D.read_requests(D.requests_file(out), D.request_settings(args))) == 7
