"""Self-distillation on a tiny model: rows hold the target's greedy reply (checked against `generate`),
reruns skip finished ids, per-rank parts merge, and prompt pools / exclusion read the usual formats."""

from __future__ import annotations

import json

import pytest

import torch

from medusa_train.data import distill as D
from medusa_train.data import prompts as P
from tiny import save_tiny, tiny_model, tiny_tokenizer

PROMPTS = [P.Prompt(f"p{i}", text) for i, text in enumerate(
    ["hi", "What is the capital of France?", "Write a haiku about the sea, please.", "2+2?", "Tell me a joke"])]


def rows(path):
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def greedy_reply(model, tok, text: str, max_new_tokens: int) -> str:
    """The reference: plain `generate` on the single, unpadded prompt, cut at the end-of-turn token."""
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    if tok.eos_token_id in out:
        out = out[:out.index(tok.eos_token_id)]
    return tok.decode(out, skip_special_tokens=True)


def test_rows_hold_the_greedy_reply(tmp_path):
    model, tok = tiny_model("llama", seed=1), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    counts = D.distill(model, tok, PROMPTS, out, max_new_tokens=7, batch_size=3, progress=False)
    assert counts["written"] == len(PROMPTS)
    got = rows(out)
    assert [r["id"] for r in got] == [p.id for p in PROMPTS]
    for r, p in zip(got, PROMPTS):
        assert r["messages"][0] == {"role": "user", "content": p.text}
        assert r["messages"][1]["role"] == "assistant"
        assert r["messages"][1]["content"] == greedy_reply(model, tok, p.text, 7)
        assert r["finish"] in ("stop", "length")


def test_reply_stops_at_end_of_turn(tmp_path):
    model, tok = tiny_model("llama", seed=1), tiny_tokenizer()
    eos = tok.eos_token_id
    bias = torch.zeros(model.config.vocab_size)
    hook = model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    bias[eos] = -1e4  # never ends: cut by max_new_tokens
    replies = D.generate_replies(model, tok, D.render_prompts(tok, PROMPTS[:2]), max_new_tokens=5)
    assert all(finish == "length" and n == 5 for _, finish, n in replies)
    bias[eos] = 1e4
    replies = D.generate_replies(model, tok, D.render_prompts(tok, PROMPTS[:2]), max_new_tokens=5)
    assert replies == [("", "stop", 0), ("", "stop", 0)]  # <|im_end|> first: an empty reply, finished
    hook.remove()


def spy_batches(monkeypatch) -> list[int]:
    """Record the size of every batch distill generates from here on."""
    seen: list[int] = []
    real = D.generate_replies

    def spy(model, tok, prompt_ids, *a, **k):
        seen.append(len(prompt_ids))
        return real(model, tok, prompt_ids, *a, **k)

    monkeypatch.setattr(D, "generate_replies", spy)
    return seen


def test_rerun_skips_finished_ids_and_redoes_a_torn_line(tmp_path, monkeypatch):
    model, tok = tiny_model("llama", seed=2), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    D.distill(model, tok, PROMPTS[:3], out, max_new_tokens=4, batch_size=2, progress=False)
    first = out.read_text()
    with out.open("a") as f:  # a crash in the middle of writing p3's row
        f.write('{"id": "p3", "messages": [{"role": "us')
    seen = spy_batches(monkeypatch)
    counts = D.distill(model, tok, PROMPTS, out, max_new_tokens=4, batch_size=8, progress=False)
    assert seen == [2] and counts["written"] == 2 and counts["done_before"] == 3
    assert out.read_text().startswith(first)  # finished rows untouched, torn line dropped
    assert [r["id"] for r in rows(out)] == ["p0", "p1", "p2", "p3", "p4"]
    seen.clear()
    assert D.distill(model, tok, PROMPTS, out, max_new_tokens=4, progress=False)["written"] == 0
    assert seen == []


def test_rerun_under_other_ids_skips_prompts_already_answered(tmp_path, monkeypatch):
    # the same prompts reached through another pool file (other ids) must not be distilled twice
    model, tok = tiny_model("llama", seed=2), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    D.distill(model, tok, PROMPTS[:3], out, max_new_tokens=4, batch_size=2, progress=False)
    renamed = [P.Prompt(id="other-" + p.id, text=p.text) for p in PROMPTS]
    seen = spy_batches(monkeypatch)
    counts = D.distill(model, tok, renamed, out, max_new_tokens=4, batch_size=8, progress=False)
    assert seen == [len(PROMPTS) - 3] and counts["done_before"] == 3 and counts["written"] == len(PROMPTS) - 3
    got = rows(out)
    assert [r["id"] for r in got] == ["p0", "p1", "p2"] + [p.id for p in renamed[3:]]
    assert len({r["messages"][0]["content"] for r in got}) == len(PROMPTS)


def test_ranks_write_parts_that_merge_into_one_file(tmp_path):
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    for rank in (0, 1):  # two processes, one after the other
        D.distill(model, tok, PROMPTS, out, max_new_tokens=3, batch_size=2, rank=rank, world_size=2,
                  progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl.rank0", "d.jsonl.rank1"]
    assert D.read_done(out)[0] == {p.id for p in PROMPTS}
    assert D.merge_parts(out) == len(PROMPTS)
    assert sorted(r["id"] for r in rows(out)) == sorted(p.id for p in PROMPTS)
    assert not list(tmp_path.glob("*.rank*"))


def test_order_limit_and_too_long(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    counts = D.distill(model, tok, PROMPTS, out, max_new_tokens=2, order="shortest", limit=2,
                       max_prompt_tokens=50, progress=False)
    # byte-level: the chat frame is 19 tokens + one per character; "hi"/"2+2?" are the two shortest,
    # the 36-character haiku prompt (55 tokens) exceeds 50
    assert [r["id"] for r in rows(out)] == ["p0", "p3"]
    assert counts["too_long"] == 1


def test_load_prompts_formats_and_exclude(tmp_path):
    sharegpt = [{"id": "a", "conversations": [{"from": "human", "value": "Explain  gravity"}]},
                {"id": "b", "conversations": [{"from": "human", "value": "   "}]},  # blank: skipped
                {"id": "c", "conversations": [{"from": "human", "value": "Explain  gravity"}]},  # duplicate
                {"id": "d", "conversations": [{"from": "human", "value": "Compose a travel blog post"},
                                              {"from": "gpt", "value": "..."}]}]
    (tmp_path / "sg.json").write_text(json.dumps(sharegpt))
    got = P.load_prompts(str(tmp_path / "sg.json"))
    assert [(p.id, p.text) for p in got] == [("a", "Explain  gravity"), ("d", "Compose a travel blog post")]

    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps({"question": q}) for q in ["one?", "two?"]))
    assert [(p.id, p.text) for p in P.load_prompts(str(tmp_path / "q.jsonl"))] == [("q-0", "one?"), ("q-1", "two?")]

    bench = [{"question_id": 81, "turns": ["compose a TRAVEL blog post", "Now shorter."]},
             {"question_id": 82, "turns": ["Something else entirely, and at least forty characters long."]}]
    (tmp_path / "mt.jsonl").write_text("\n".join(json.dumps(b) for b in bench))
    pool = got + [P.Prompt("e", "Now shorter."), P.Prompt("f", "Please: Something else entirely, and at least "
                                                               "forty characters long. Thanks")]
    kept = P.exclude_prompts(pool, [str(tmp_path / "mt.jsonl")])
    assert [p.id for p in kept] == ["a"]


def test_default_pool_is_offline_and_disjoint_from_heldout():
    from medusa_train.data.prompts import default_prompts

    train, held = default_prompts("train"), default_prompts("heldout")
    assert len(train) >= 1000 and len(held) >= 40
    assert len({i for i, _ in train}) == len(train)
    assert not {t for _, t in train} & {t for _, t in held}
    assert [p.text for p in P.load_prompts("default")] == [t for _, t in train]


def cli_files(tmp_path, prompts: list[tuple[str, str]], data: str = ""):
    """A tiny saved target, a prompt file of (id, prompt) rows and a recipe (with `data:` keys when given) for the
    CLI: (recipe, prompt file)."""
    save_tiny(tmp_path / "m")
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"id": i, "prompt": t}) for i, t in prompts))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  model: {tmp_path / 'm'}\n" + (f"data:\n  {data}\n" if data else ""))
    return recipe, tmp_path / "p.jsonl"


def test_cli(tmp_path, capsys):
    recipe, _ = cli_files(tmp_path, [("x", "hello"), ("y", "bye")], f"dataset: {tmp_path / 'not-yet.jsonl'}")
    out = tmp_path / "o.jsonl"
    assert D.main([str(recipe), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out),
                   "--max-new-tokens", "3"]) == 0
    assert [r["id"] for r in rows(out)] == ["x", "y"]
    assert "holds 2 rows" in capsys.readouterr().out
    assert D.main([str(recipe), "--prompts", "default", "--out", str(out), "--exclude", "nope.jsonl"]) == 2
    assert "--exclude: file not found" in capsys.readouterr().err
    assert D.main([str(recipe), "--prompts", "default", "--out", str(out), "--max-new-tokens", "0"]) == 2


def test_rows_with_unicode_line_separators_stay_whole(tmp_path):
    """JSON keeps U+2028/U+2029/U+0085 raw inside strings (we write with ensure_ascii=False), and
    str.splitlines() splits on them: a reader that used it re-distilled such a row on every resume (its id
    looked unfinished), dropped it when merging rank parts, and the benchmark's bigram reader crashed on it."""
    from inference import bench

    from medusa_train.data.rows import _load_json_by_hand

    reply = "first line\u2028second\u2029third\x85fourth"
    out = tmp_path / "d.jsonl"
    row = {"id": "p0", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]}
    row1 = {**row, "id": "p1"}
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in (row, row1)), encoding="utf-8")
    assert D.read_done(out)[0] == {"p0", "p1"}
    part = tmp_path / "e.jsonl"
    (tmp_path / "e.jsonl.rank1").write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    assert D.merge_parts(part) == 1 and [r["messages"][1]["content"] for r in rows(part)] == [reply]
    assert bench.bigram_texts(str(out)) == [reply, reply]
    loaded = _load_json_by_hand([str(out)], "d", ValueError("not a datasets file"))
    assert [r["messages"][1]["content"] for r in loaded] == [reply, reply]


def test_a_rerun_with_other_settings_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """Rows record how their reply was made; a rerun into the same --out with another --max-new-tokens (or
    temperature) would mix replies of both lengths in one file: one line, exit 2, before the model loads."""
    recipe, _ = cli_files(tmp_path, [("x", "hello")])
    out = tmp_path / "o.jsonl"
    base = [str(recipe), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]
    assert D.main(base + ["--max-new-tokens", "3"]) == 0
    assert rows(out)[0]["generation"] == {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0}
    import medusa_train.target.model as target

    monkeypatch.setattr(target, "load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    assert D.main(base + ["--max-new-tokens", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --out {out} holds rows made with --max-new-tokens 3 (this run: 5): rerun with the same "
                   "settings to continue it, or write to another --out")


def test_ctrl_c_stops_with_what_was_written_and_no_traceback(tmp_path, capsys, monkeypatch):
    """A real SIGINT in the middle of the job: the finished batches stay, one line says so, exit 75; the rerun
    continues where it stopped and ends with every prompt answered once."""
    import os
    import signal

    recipe, _ = cli_files(tmp_path, [(f"q{i}", f"prompt {i}") for i in range(6)])
    out = tmp_path / "o.jsonl"
    argv = [str(recipe), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out), "--max-new-tokens", "2",
            "--batch-size", "1"]  # chunks of D.CHUNK (4) prompts: 4, then 2
    real = D.generate_replies
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(D, "generate_replies", interrupted)
    # Python's Ctrl-C handler, whatever the suite was started under (a shell that starts it in the background
    # ignores SIGINT, and the interpreter then keeps it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert D.main(argv) == 75
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert "[distill] stopped:" in err and "rerun the same command to continue" in err and "Traceback" not in err
    assert len(rows(out)) == D.CHUNK  # the first chunk; the second was cut
    monkeypatch.setattr(D, "generate_replies", real)
    assert D.main(argv) == 0
    assert sorted(r["id"] for r in rows(out)) == [f"q{i}" for i in range(6)]


CONVERSATIONS = [  # ShareGPT rows: three user turns, one, and two (with an assistant turn the target replaces)
    {"id": "c3", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Red."},
                                   {"from": "human", "value": "And another one?"}, {"from": "gpt", "value": "Blue."},
                                   {"from": "human", "value": "Which do you like more?"}]},
    {"id": "c1", "conversations": [{"from": "human", "value": "hello there"}]},
    {"id": "c2", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                                   {"from": "human", "value": "Times three?"}, {"from": "gpt", "value": "12"}]},
]


def test_turns_all_answers_every_user_turn_after_the_targets_own_replies(tmp_path):
    """`--turns all`: each later user turn of the source is answered after the conversation so far, whose earlier
    replies are the target's own (never the source's), greedy as if asked one at a time; one row a conversation,
    and training supervises every reply and nothing else."""
    from medusa_train.data.chat import IGNORE_INDEX, render_prompt, tokenize_chat

    model, tok = tiny_model("llama", seed=1), tiny_tokenizer()
    bias = torch.zeros(model.config.vocab_size)
    hook = model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    bias[tok.eos_token_id] = 4.0  # replies that end, so conversations go on
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(CONVERSATIONS))
    pool = P.load_prompts(str(src))
    assert [(p.id, p.later) for p in pool] == [("c3", ("And another one?", "Which do you like more?")),
                                               ("c1", ()), ("c2", ("Times three?",))]
    out = tmp_path / "d.jsonl"
    counts = D.distill(model, tok, pool, out, max_new_tokens=12, batch_size=2, progress=False, turns="all")
    got = {r["id"]: r for r in rows(out)}
    assert all(r["finish"] == "stop" for r in got.values()), "the test wants replies that end"
    assert counts["turns_written"] == {1: 1, 2: 1, 3: 1} and counts["replies"] == 6
    for p in pool:
        msgs = got[p.id]["messages"]
        assert [m["content"] for m in msgs[0::2]] == [p.text, *p.later]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (1 + len(p.later))
        for k in range(1, len(msgs), 2):  # each reply: the greedy reply to the conversation before it
            ((text, finish, _),) = D.generate_replies(model, tok, [render_prompt(tok, msgs[:k])], 12)
            assert msgs[k]["content"] == text and finish == "stop"
        assert got[p.id]["generation"]["turns"] == "all"
        row = tokenize_chat(msgs, tok, max_length=4096)
        spans = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]
        replies = [tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                   for m in msgs[1::2]]
        assert spans == [t for r in replies for t in r]  # every reply and its end, and nothing else
    hook.remove()


def test_a_conversation_goes_on_only_after_a_reply_that_ended(tmp_path):
    model, tok = tiny_model("llama", seed=1), tiny_tokenizer()
    bias = torch.zeros(model.config.vocab_size)
    hook = model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    bias[tok.eos_token_id] = -1e4  # every reply is cut at its limit
    pool = [P.Prompt("a", "Name a colour.", ("And another one?",))]
    counts = D.distill(model, tok, pool, tmp_path / "d.jsonl", max_new_tokens=4, progress=False, turns="all")
    (row,) = rows(tmp_path / "d.jsonl")
    assert len(row["messages"]) == 2 and row["finish"] == "length" and counts["cut"] == counts["replies"] == 1
    bias[tok.eos_token_id] = 1e4  # every reply ends at once: the conversation goes on while it fits
    first = len(D.render_prompts(tok, pool)[0])
    for limit, turns in ((first + 60, 2), (first + 20, 1)):  # the second turn's context: ~37 tokens more
        out = tmp_path / f"fits-{limit}.jsonl"
        D.distill(model, tok, pool, out, max_new_tokens=4, progress=False, turns="all", max_prompt_tokens=limit)
        assert len(rows(out)[0]["messages"]) == 2 * turns
    hook.remove()


def test_replies_fill_what_the_recipes_max_length_leaves(tmp_path, monkeypatch):
    """Without --max-new-tokens a reply may run to data.max_length minus its prompt, where training would cut the
    row anyway, and no further; prompts leaving under MIN_REPLY are skipped as too long."""
    model, tok = tiny_model("llama", seed=1), tiny_tokenizer()
    made, real = [], D.decode  # (prompt tokens, reply tokens) of every reply decoded

    def recording(model, prompts, **kw):
        for i, tokens, stopped in real(model, prompts, **kw):
            made.append((len(prompts[i]), len(tokens)))
            yield i, tokens, stopped

    monkeypatch.setattr(D, "decode", recording)
    bias = torch.zeros(model.config.vocab_size)
    hook = model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    bias[tok.eos_token_id] = -1e4
    pool = [P.Prompt("a", "hi", ("and again",)), P.Prompt("b", "Write a haiku about the sea, please."),
            P.Prompt("long", "word " * 60)]
    n = {p.id: len(D.render_prompts(tok, [p])[0]) for p in pool}
    max_length = n["b"] + 40
    assert max_length - n["long"] < D.MIN_REPLY
    out = tmp_path / "d.jsonl"
    counts = D.distill(model, tok, pool, out, max_new_tokens=None, max_length=max_length, progress=False)
    assert counts["too_long"] == 1 and counts["cut"] == counts["replies"] == 2
    assert sorted(made) == sorted((n[k], max_length - n[k]) for k in ("a", "b"))
    for r in rows(out):
        assert r["generation"] == {"max_new_tokens": None, "max_length": max_length, "temperature": 0.0,
                                   "top_p": 1.0}
    hook.remove()


def test_cli_says_the_share_of_replies_cut_and_refuses_bad_turns(tmp_path, capsys):
    recipe, _ = cli_files(tmp_path, [("x", "hello"), ("y", "bye")], "max_length: 40")
    out = tmp_path / "o.jsonl"
    base = [str(recipe), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]
    assert D.main(base) == 0
    said = capsys.readouterr().out
    cut = sum(r["finish"] == "length" for r in rows(out))
    assert f"replies cut at their limit (what data.max_length 40 leaves): {cut} of 2 ({cut / 2:.0%}, this " \
           "process)" in said
    assert D.main(base + ["--max-new-tokens", "5"]) == 2
    assert "holds rows made with --max-new-tokens unset (this run: 5), data.max_length (replies fill it) 40 " \
           "(this run: unset)" in capsys.readouterr().err
    assert D.main([str(recipe), "--prompts", "self", "--limit", "3", "--out", str(tmp_path / "s.jsonl"),
                   "--turns", "all"]) == 2
    assert "--turns all answers a multi-turn source's later user turns" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        D.main(base + ["--turns", "some"])
    assert "--turns takes a number or `all`, got 'some'" in capsys.readouterr().err
    assert D.main(base + ["--engine", "vllm"]) == 2
    assert "--engine vllm needs --vllm-python" in capsys.readouterr().err


FAKE_VLLM = '''
class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class LLM:
    """Replies 100, 101, ... up to max_tokens, stopping after a stop id; records what it was given."""
    def __init__(self, **kw):
        import json, os
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"llm": {k: v for k, v in kw.items() if isinstance(v, (int, str, bool))}}) + "\\n")

    def generate(self, prompts, params, use_tqdm=False):
        import json, os
        from types import SimpleNamespace as NS
        outs = []
        for p, sp in zip(prompts, params):
            ids = []
            for t in range(100, 100 + sp.max_tokens):
                ids.append(t)
                if t in sp.stop_token_ids:
                    break
            outs.append(NS(outputs=[NS(token_ids=ids)]))
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"lengths": [len(p["prompt_token_ids"]) for p in prompts],
                                "max_tokens": [sp.max_tokens for sp in params], "seeds": [sp.seed for sp in params],
                                "ignore_eos": [sp.ignore_eos for sp in params]}) + "\\n")
        return outs

__version__ = "fake"
'''


def test_the_vllm_worker_protocol_with_a_stand_in_vllm(tmp_path, monkeypatch):
    """`VllmTarget` and its worker, run with a stand-in `vllm` module (the real one runs in the vLLM step): replies
    come back in prompt order cut before the first stop id, each limited to what max_model_len leaves after its
    prompt (a prompt with no room is not sent), seeds only when sampling, vLLM's own EOS ignored; a worker that
    dies says so in one line."""
    import sys

    from medusa_train.data.vllm_generate import VllmTarget

    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    save_tiny(tmp_path / "m")
    worker = VllmTarget(str(tmp_path / "m"), sys.executable, dtype="float32", max_model_len=20, max_num_seqs=7)
    try:
        got = list(worker.generate_tokens([[1] * 5, [1] * 18, [1] * 20, [1] * 3], [4, 9, 9, 0], [102, 7], 0.0, 1.0,
                                          None))
        assert got == [(0, [100, 101], True), (1, [100, 101], False), (2, [], False), (3, [], False)]
        got = list(worker.generate_tokens([[1] * 5, [1] * 17], [2, 9], [7], 0.9, 0.5, [11, 12]))
        assert got == [(0, [100, 101], False), (1, [100, 101, 102], False)]
    finally:
        worker.close()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["llm"] == {"model": str(tmp_path / "m"), "dtype": "float32", "tensor_parallel_size": 1, "seed": 0,
                               "max_model_len": 20, "max_num_seqs": 7, "generation_config": "vllm",
                               "enforce_eager": True, "trust_remote_code": False, "enable_chunked_prefill": False,
                               "max_num_batched_tokens": 8192}
    assert calls[1] == {"lengths": [5, 18], "max_tokens": [4, 2], "seeds": [None, None], "ignore_eos": [True, True]}
    assert calls[2] == {"lengths": [5, 17], "max_tokens": [2, 3], "seeds": [11, 12], "ignore_eos": [True, True]}
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text("raise ImportError('no vLLM here')\n")
    with pytest.raises(RuntimeError, match=r"^vLLM's generation worker stopped \(exit code 1\); its output is above$"):
        VllmTarget(str(tmp_path / "m"), sys.executable, max_model_len=20)


def test_each_process_runs_its_own_vllm_on_its_own_gpus(tmp_path, monkeypatch):
    """Under several processes each starts its own vLLM, on the GPUs of its local rank (`--tensor-parallel-size` of
    them); one process leaves CUDA_VISIBLE_DEVICES alone. vLLM is sized to the longest context the run asks for."""
    from types import SimpleNamespace as NS

    from medusa_train.config import load_config
    from medusa_train.data import vllm_generate

    save_tiny(tmp_path / "m")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  model: {tmp_path / 'm'}\ndata:\n  max_length: 300\n")
    cfg = load_config(str(recipe), ["data.dataset=x"])
    made = []
    monkeypatch.setattr(vllm_generate, "VllmTarget", lambda model, python, **kw: made.append(kw) or NS())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = D.build_parser().parse_args([str(recipe), "--prompts", "default", "--out", "o", "--engine", "vllm",
                                        "--vllm-python", "py", "--tensor-parallel-size", "2"])
    D.load_engine(cfg, args, NS(num_processes=4, local_process_index=1))
    D.load_engine(cfg, args, NS(num_processes=1, local_process_index=0))
    args.max_new_tokens = 64
    D.load_engine(cfg, args, NS(num_processes=1, local_process_index=0))
    assert [(m["devices"], m["tensor_parallel_size"], m["max_model_len"], m["dtype"]) for m in made] == [
        ("2,3", 2, 300, "bfloat16"), (None, 2, 300, "bfloat16"), (None, 2, 512, "bfloat16")]  # 1024 + 64 > 512


def test_the_bar_moves_with_every_reply_and_says_tokens_a_second(tmp_path, monkeypatch):
    """The progress bar advances a prompt as each reply ends, inside a chunk (not when the chunk is written: 128
    prompts by default, a quarter of an hour on 2 cores), and its postfix says the new tokens a second."""
    model, tok = tiny_model("llama", seed=1), tiny_tokenizer()
    events = []
    real_append = D._append_rows
    monkeypatch.setattr(D, "_append_rows", lambda path, rows: (events.append(("write", len(rows))),
                                                                real_append(path, rows)))
    bars = []
    real_init = D._Progress.__init__

    def init(self, total, enabled):
        real_init(self, total, enabled)
        bars.append(self)
        real_update = self.bar.update
        self.bar.update = lambda n=1: (events.append(("bar", self.bar.n + n)), real_update(n))

    monkeypatch.setattr(D._Progress, "__init__", init)
    D.distill(model, tok, PROMPTS, tmp_path / "d.jsonl", max_new_tokens=6, batch_size=2, progress=True)
    first_write = events.index(("write", len(PROMPTS)))  # one chunk: batch 2 x CHUNK 4 holds all five
    assert [e for e in events[:first_write] if e[0] == "bar" and e[1] > 0] == [("bar", n) for n in range(1, 6)]
    assert bars[0].bar.n == len(PROMPTS) and "tokens/s" in bars[0].bar.postfix
