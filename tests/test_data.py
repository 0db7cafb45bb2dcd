"""medusa_train.data.rows on the tiny ChatML tokenizer and small files written to tmp_path (no network)."""

from __future__ import annotations

import json

import pytest
import torch

from medusa_train.data.chat import IGNORE_INDEX, tokenize_chat
from medusa_train.config import Config, ConfigError, DataConfig, TrainConfig
from medusa_train.data.rows import build_datasets, collate, dry_run_report, load_raw, select_draft_vocab, token_counts
from medusa_train.base.errors import DataError
from medusa_train.data.formats import chat_messages, detect_format, prompt_of, rows_to_messages
from tiny import tiny_tokenizer

EOT = "<|im_end|>"

CONVS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "Green, or maybe teal."}],
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Say hi twice."},
     {"role": "assistant", "content": "hi"},
     {"role": "user", "content": "again"},
     {"role": "assistant", "content": "hi hi"},
     {"role": "user", "content": "and once more"},
     {"role": "assistant", "content": "hi!"}],
]
SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def write_json(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sharegpt(convs):
    return [{"id": f"c{i}", "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in c]}
            for i, c in enumerate(convs)]


def cfg_for(path, **data):
    seed = data.pop("seed", 0)
    data.setdefault("eval_size", 0)
    return Config(data=DataConfig(dataset=str(path), **data), train=TrainConfig(seed=seed))


def spans(ids, labels):
    """The supervised token runs of one row."""
    out, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            assert lab == i
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


# ---------------------------------------------------------------------------------------------------
# chat masking


@pytest.mark.parametrize("conv", CONVS)
def test_exactly_assistant_tokens_supervised(tok, conv):
    enc = tokenize_chat(conv, tok, max_length=4096)
    assert len(enc["input_ids"]) == len(enc["labels"])
    text = tok.apply_chat_template(conv, tokenize=False)
    assert enc["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    got = [tok.decode(s) for s in spans(enc["input_ids"], enc["labels"])]
    assert got == [m["content"] + EOT for m in conv if m["role"] == "assistant"]


def test_truncation_keeps_alignment(tok):
    full = tokenize_chat(CONVS[0], tok, max_length=4096)
    cut = tokenize_chat(CONVS[0], tok, max_length=40)
    assert cut["input_ids"] == full["input_ids"][:40] and cut["labels"] == full["labels"][:40]


# Qwen3's rule, cut down: the reply after the last user turn gets an (empty) think block, earlier ones not
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 > ns.last %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def test_template_that_rerenders_earlier_replies(tok):
    t = tiny_tokenizer()
    t.chat_template = QWEN3_LIKE
    conv = CONVS[2]
    enc = tokenize_chat(conv, t, 4096)
    assert enc["input_ids"] == t(t.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    got = [t.decode(s) for s in spans(enc["input_ids"], enc["labels"])]
    assert got == ["hi" + EOT, "hi hi" + EOT, "<think>\n\n</think>\n\nhi!" + EOT]


def test_template_with_unstable_prefix_is_a_clear_error(tok):
    t = tiny_tokenizer()
    t.chat_template = "{{ messages | length }}" + tok.chat_template  # per-conversation text up front
    with pytest.raises(DataError, match="renders the turns before message 1 differently"):
        tokenize_chat(CONVS[1], t, 4096)


def merging_tokenizer():
    """The tiny byte-level tokenizer plus one BPE merge, two newlines into one token (as SmolLM2's and Qwen's have)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny import CHATML_TEMPLATE, SPECIAL_TOKENS

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(chars)}
    vocab["ĊĊ"] = len(vocab)
    for t in SPECIAL_TOKENS:
        vocab[t] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    t = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                additional_special_tokens=["<|im_start|>"])
    t.chat_template = CHATML_TEMPLATE
    return t


def test_a_reply_that_merges_with_the_template_at_its_start_keeps_its_span():
    """A reply opening with "\n" after the template's "assistant\n": the two newlines are one token in the
    conversation, so the generation prompt's tokens are not a prefix of it although its text is. The span starts at
    the merged token (what the target emits there); such rows are not a template error, and a later turn too."""
    t = merging_tokenizer()
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\nHello"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "\n\nok"}]
    enc = tokenize_chat(conv, t, 4096)
    assert t.convert_tokens_to_ids("ĊĊ") in enc["input_ids"]
    assert [t.decode(s) for s in spans(enc["input_ids"], enc["labels"])] == ["\n\nHello" + EOT, "\n\n\nok" + EOT]


def test_conversation_opening_with_assistant(tok):
    conv = [{"role": "assistant", "content": "Hello! Ask me anything."}, {"role": "user", "content": "ok"},
            {"role": "assistant", "content": "Sure."}]
    enc = tokenize_chat(conv, tok, 4096)
    got = [tok.decode(s) for s in spans(enc["input_ids"], enc["labels"])]
    assert got == ["Hello! Ask me anything." + EOT, "Sure." + EOT]


def test_sharegpt_and_messages_give_identical_rows(tok, tmp_path):
    a = write_jsonl(tmp_path / "messages.jsonl", [{"messages": c} for c in CONVS])
    b = write_json(tmp_path / "sharegpt.json", sharegpt(CONVS))
    ra, _, ia = build_datasets(cfg_for(a), tok)
    rb, _, ib = build_datasets(cfg_for(b), tok)
    assert ia["format"] == ib["format"] == "chat"
    assert ra["input_ids"] == rb["input_ids"] and ra["labels"] == rb["labels"]
    assert ia == ib


def test_row_formats():
    assert chat_messages({"conversations": [{"from": "human", "value": "q"}, {"from": "chatgpt", "value": "a"}]}) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    alpaca = {"instruction": "Translate.", "input": "bonjour", "output": "hello"}
    assert rows_to_messages(alpaca) == [{"role": "user", "content": "Translate.\n\nbonjour"},
                                        {"role": "assistant", "content": "hello"}]
    assert rows_to_messages({"instruction": "Hi", "input": "", "output": "yo"})[0]["content"] == "Hi"
    assert rows_to_messages({"question": "1+1?", "answer": "2"}) == [
        {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    assert rows_to_messages({"system": "Be brief.", "conversations": [{"from": "human", "value": "q"}]}) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]
    assert rows_to_messages({"text": "plain"}) is None
    with pytest.raises(DataError, match="unknown chat role 'robot'"):
        chat_messages({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(DataError, match="no conversation"):
        chat_messages({"text": "plain"})


def test_prompt_of_every_layout():
    assert prompt_of({"id": "x", "conversations": [{"from": "human", "value": "P1"}]}) == "P1"
    assert prompt_of({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "P2"},
                                   {"role": "assistant", "content": "a"}]}) == "P2"
    assert prompt_of({"instruction": "P3", "input": "ctx", "output": "o"}) == "P3\n\nctx"
    assert prompt_of({"question": "P4", "answer": "a"}) == "P4"
    assert prompt_of({"uid": "u", "category": "c", "prompt": "P5"}) == "P5"
    assert prompt_of({"question_id": 81, "turns": ["P6", "follow-up"]}) == "P6"
    assert prompt_of({"conversations": [{"from": "human", "value": "  "}]}) is None
    assert prompt_of({"text": "no prompt"}) is None


def test_alpaca_and_gsm8k_files_train_as_chat(tok, tmp_path):
    alp = write_json(tmp_path / "alpaca.json", [{"instruction": f"Do {i}.", "input": "", "output": f"Done {i}."}
                                               for i in range(5)])
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(5)])
    for path, answers in ((alp, {f"Done {i}." for i in range(5)}), (gsm, {f"#### {i + 1}" for i in range(5)})):
        train, _, info = build_datasets(cfg_for(path), tok)
        assert info["format"] == "chat" and info["rows"] == 5
        got = {tok.decode(s[0])[: -len(EOT)] for s in (spans(r["input_ids"], r["labels"]) for r in train)}
        assert got == answers


def test_a_directory_of_different_layouts_loses_no_row(tok, tmp_path):
    # the json reader takes its columns from one file; chat rows beside Alpaca rows must all still train
    d = tmp_path / "mixed"
    d.mkdir()
    write_jsonl(d / "a-chat.jsonl", [{"messages": c} for c in CONVS[1:2]])
    write_jsonl(d / "b-alpaca.jsonl", [{"instruction": f"Do {i}.", "input": "", "output": f"Done {i}."}
                                       for i in range(3)])
    train, _, info = build_datasets(cfg_for(str(d)), tok)
    assert info["format"] == "chat" and info["rows"] == 4
    got = {tok.decode(s[0])[: -len(EOT)] for s in (spans(r["input_ids"], r["labels"]) for r in train)}
    assert got == {"4", "Done 0.", "Done 1.", "Done 2."}


# ---------------------------------------------------------------------------------------------------
# text packing


def test_text_packing_exact_blocks_no_token_lost(tok, tmp_path):
    docs = [f"document number {i} " + "xyz" * (i % 7) for i in range(40)]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"body": d} for d in docs])
    cfg = cfg_for(path, text_column="body", max_length=16)
    train, ev, info = build_datasets(cfg, tok)
    assert ev is None and info["format"] == "text"
    rows = train["input_ids"]
    assert all(len(r) == 16 for r in rows[:-1]) and 1 <= len(rows[-1]) <= 16
    assert train["labels"] == rows
    flat = [t for r in rows for t in r]
    eos = tok.eos_token_id
    assert flat[-1] == eos and flat.count(eos) == len(docs)
    # documents come back whole, each followed by EOS, in the shuffled order
    pieces, cur = [], []
    for t in flat:
        if t == eos:
            pieces.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    assert sorted(pieces) == sorted(docs)
    assert info["tokens"] == info["supervised_tokens"] == len(flat) == sum(len(tok(d)["input_ids"]) + 1 for d in docs)


def test_txt_file_is_one_document(tok, tmp_path):
    (tmp_path / "a.txt").write_text("line one\nline two\n")
    (tmp_path / "b.txt").write_text("other file")
    train, _, info = build_datasets(cfg_for(tmp_path, max_length=8), tok)
    flat = [t for r in train["input_ids"] for t in r]
    assert flat.count(tok.eos_token_id) == 2 and info["rows"] == len(train)


# ---------------------------------------------------------------------------------------------------
# order, caps and splits


def test_deterministic_order_per_seed(tok, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(50)])
    a = build_datasets(cfg_for(path, seed=1), tok)[0]["input_ids"]
    b = build_datasets(cfg_for(path, seed=1), tok)[0]["input_ids"]
    c = build_datasets(cfg_for(path, seed=2), tok)[0]["input_ids"]
    assert a == b and a != c and sorted(map(tuple, a)) == sorted(map(tuple, c))


@pytest.mark.parametrize("eval_size,n_eval", [(0, 0), (0.1, 4), (0.01, 1), (0.999, 39), (7, 7), (7.0, 7)])
def test_eval_split_sizes(tok, tmp_path, eval_size, n_eval):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(40)])
    train, ev, info = build_datasets(cfg_for(path, eval_size=eval_size), tok)
    assert (ev is None) == (n_eval == 0)
    assert info["rows"] == len(train) == 40 - n_eval and info["eval_rows"] == n_eval
    if ev is not None:  # held out, not shared with train
        assert not set(map(tuple, ev["input_ids"])) & set(map(tuple, train["input_ids"]))


def test_num_proc_gives_the_same_rows(tok, tmp_path):
    chat = write_jsonl(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(30)])
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i} " * (i % 5 + 1)} for i in range(30)])
    for path in (chat, text):
        one = build_datasets(cfg_for(path, max_length=40, eval_size=3), tok)
        two = build_datasets(cfg_for(path, max_length=40, eval_size=3, num_proc=2), tok)
        assert one[0]["input_ids"] == two[0]["input_ids"] and one[0]["labels"] == two[0]["labels"]
        assert one[1]["input_ids"] == two[1]["input_ids"] and one[2] == two[2]
    t = tiny_tokenizer()
    t.chat_template = "{{ messages | length }}" + tok.chat_template
    with pytest.raises(DataError, match="renders the turns before"):  # a fatal template error crosses processes
        build_datasets(cfg_for(chat, num_proc=2), t)


def test_one_row_dataset_with_fractional_eval(tok, tmp_path):
    path = write_jsonl(tmp_path / "one.jsonl", [{"question": "q", "answer": "a"}])
    train, ev, info = build_datasets(cfg_for(path, eval_size=0.02), tok)
    assert len(train) == 1 and ev is None and info["eval_rows"] == 0


def test_max_examples_and_eval_too_big(tok, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(40)])
    train, ev, info = build_datasets(cfg_for(path, max_examples=10, eval_size=2), tok)
    assert len(train) == 8 and len(ev) == 2
    with pytest.raises(DataError, match="data.eval_size=10 leaves no training examples"):
        build_datasets(cfg_for(path, max_examples=10, eval_size=10), tok)


# ---------------------------------------------------------------------------------------------------
# errors


def test_empty_file(tok, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        build_datasets(cfg_for(tmp_path / "empty.jsonl"), tok)
    path = write_json(tmp_path / "empty.json", [])
    with pytest.raises(DataError, match="empty"):
        build_datasets(cfg_for(path), tok)


def test_missing_column_names_columns_and_key(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "x", "meta": 1}])
    with pytest.raises(DataError, match=r"no 'text' column.*\['body', 'meta'\].*data.text_column"):
        build_datasets(cfg_for(path), tok)
    with pytest.raises(DataError, match=r"data.text_column='content'.*\['body', 'meta'\]"):
        build_datasets(cfg_for(path, format="text", text_column="content"), tok)
    with pytest.raises(DataError, match=r"data.format=chat.*\['body', 'meta'\]"):
        build_datasets(cfg_for(path, format="chat"), tok)


def test_chat_with_nothing_supervised(tok, tmp_path):
    path = write_json(tmp_path / "prompts.json", [{"id": str(i), "conversations": [{"from": "human", "value": "q"}]}
                                                  for i in range(3)])
    with pytest.raises(DataError, match="no conversation .* has an assistant token.*self-distillation"):
        build_datasets(cfg_for(path), tok)
    # replies that start beyond max_length are dropped too
    long = write_jsonl(tmp_path / "long.jsonl", [{"question": "q" * 100, "answer": "a"}] * 2)
    with pytest.raises(DataError, match="no conversation .* has an assistant token.*raise data.max_length"):
        build_datasets(cfg_for(long, max_length=16), tok)


def test_chat_with_everything_supervised(tmp_path):
    t = tiny_tokenizer()
    t.chat_template = "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "assistant", "content": "only me"}]}] * 3)
    with pytest.raises(DataError, match="every token .* is supervised"):
        build_datasets(cfg_for(path), t)


def test_rows_without_reply_dropped_and_counted(tok, tmp_path):
    rows = [{"messages": c} for c in CONVS] + [{"messages": [{"role": "user", "content": "no answer"}]}]
    train, _, info = build_datasets(cfg_for(write_jsonl(tmp_path / "m.jsonl", rows)), tok)
    assert info["rows"] == 3 and info["dropped"] == 1
    assert info["supervised_tokens"] == sum(x != IGNORE_INDEX for r in train["labels"] for x in r)


def test_json_layouts(tmp_path):
    rows = [{"text": "a"}, {"text": "b"}]
    for name, obj in (("list.json", rows), ("wrapped.json", {"data": rows})):
        assert load_raw(DataConfig(dataset=write_json(tmp_path / name, obj)))["text"] == ["a", "b"]
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 3 is not valid JSON \(Expecting property name .* column 2\)"):
        load_raw(DataConfig(dataset=str(tmp_path / "bad.jsonl")))
    # a byte that is not UTF-8: the file and line named
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl line 2 holds a byte that is not UTF-8 \(0xe9"):
        build_datasets(cfg_for(tmp_path / "latin1.jsonl"), tiny_tokenizer())
    (tmp_path / "lists.jsonl").write_text('{"text": ["a", "b"]}\n')  # was trained on as "['a', 'b']"
    with pytest.raises(DataError, match=r"data.text_column='text' holds a list .*, not text"):
        build_datasets(cfg_for(tmp_path / "lists.jsonl", format="text"), tiny_tokenizer())


def test_data_error_is_config_error_and_bad_paths(tok, tmp_path):
    assert issubclass(DataError, ConfigError)
    with pytest.raises(DataError, match="file not found"):
        load_raw(DataConfig(dataset=str(tmp_path / "missing.jsonl")))


def test_hub_failure_says_pass_a_local_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(DataError, match=r"no-such-org/no-such-set.*local path"):
        load_raw(DataConfig(dataset="no-such-org/no-such-set"))


def test_detect_format(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"text": "a", "messages": [{"role": "user", "content": "x"}]}])
    assert detect_format(ds, DataConfig(dataset="x")) == "chat"
    assert detect_format(ds, DataConfig(dataset="x", format="text")) == "text"
    assert detect_format(datasets.Dataset.from_list([{"text": "a"}]), DataConfig(dataset="x")) == "text"


# ---------------------------------------------------------------------------------------------------
# batching, report, draft vocab


def test_collate_padding():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    assert collate(rows, pad_token_id=None)["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    b = collate(rows, pad_token_id=259)
    assert all(v.dtype == torch.long and v.shape == (2, 3) for v in b.values())
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 259, 259]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_dry_run_report_marks_spans(tok, tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONVS[1]}])
    report = dry_run_report(cfg_for(path), tok, n_examples=1)
    assert "[[4<|im_end|>]]" in report and "user\n2+2?" in report
    assert "1 rows" in report and "supervised" in report


def test_token_counts_and_select_draft_vocab(tok, tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONVS[1]}] * 3)
    train, _, info = build_datasets(cfg_for(path), tok)
    counts = token_counts(train, 260)
    assert counts.shape == (260,) and counts.sum().item() == info["supervised_tokens"] == 6
    assert counts[ord("4") - 33 + 0].item() >= 0  # byte ids are not ASCII: just check totals and the EOS
    assert counts[tok.eos_token_id].item() == 3

    c = torch.tensor([5, 0, 9, 9, 1, 0, 3])
    assert select_draft_vocab(c, 3).tolist() == [0, 2, 3]
    assert select_draft_vocab(c, 3, always=[5]).tolist() == [2, 3, 5]
    assert select_draft_vocab(c, 4, always=[1, 5]).tolist() == [1, 2, 3, 5]
    assert select_draft_vocab(c, 10).tolist() == list(range(7))
    out = select_draft_vocab(c, 2)
    assert out.dtype == torch.long and out.tolist() == [2, 3]
    with pytest.raises(ValueError):
        select_draft_vocab(c, 1, always=[0, 1])


def test_a_reply_cut_by_the_token_budget_gets_no_end_of_turn(tok, tmp_path):
    """Distillation marks a reply that ran out of new tokens `finish: length`: its text is trained on, but not the
    end-of-turn token the chat template would put after it (the target never wrote one there); a reply that
    stopped on its own keeps it."""
    conv = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two three"}]
    write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "messages": conv, "finish": "stop"},
                                       {"id": "b", "messages": conv, "finish": "length"}])
    train_ds, _, _ = build_datasets(cfg_for(tmp_path / "d.jsonl", seed=0), tok)
    rows = {len(r["input_ids"]): r for r in train_ds}
    stopped, cut = rows[max(rows)], rows[min(rows)]
    end = tok.convert_tokens_to_ids(EOT)
    assert [s[-1] for s in spans(stopped["input_ids"], stopped["labels"])] == [end]
    k = len(cut["input_ids"])
    assert cut["input_ids"] == stopped["input_ids"][:k] and stopped["input_ids"][k] == end  # cut before the end
    assert spans(cut["input_ids"], cut["labels"])[0] == spans(stopped["input_ids"], stopped["labels"])[0][:-1]


def test_more_dropped_rows_than_data_max_dropped_is_an_error(tok, tmp_path):
    """Dropped rows are counted with their reasons; past data.max_dropped (a fraction) the data is refused, naming
    the count and the most common reason, instead of training on what is left without a word."""
    rows = [{"messages": CONVS[0]}] + [{"messages": [{"role": "user", "content": f"no answer {i}"}]} for i in range(2)]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    with pytest.raises(DataError, match=r"2 of 3 rows of .* cannot be trained on \(67%, more than data.max_dropped="
                                        r"0.5\) \(most common: no assistant reply\).*data.max_dropped"):
        build_datasets(cfg_for(path), tok)
    _, _, info = build_datasets(cfg_for(path, max_dropped=0.9), tok)
    assert info["dropped"] == 2 and info["drop_reasons"] == {"no assistant reply": 2}


def test_length_grouped_batches_pad_little_and_keep_the_order_a_seed_and_epoch_give():
    """data.group_by_length: every row once an epoch; (seed, epoch) fixes the order, another epoch changes it; the
    loader's batches (cut every batch_size rows) are the sampler's sorted groups, so they pad little where random
    batches pad a lot; only the epoch's last batch may be short."""
    from torch.utils.data import BatchSampler, RandomSampler

    from medusa_train.data.rows import LengthGroupedSampler, padded_share

    g = torch.Generator().manual_seed(0)
    lengths = (torch.exp(torch.randn(1003, generator=g) * 0.8 + 5.0).long() + 4).tolist()  # chat-like, uneven
    sampler = LengthGroupedSampler(lengths, 8, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(1003)) and list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    batches = list(BatchSampler(sampler, 8, drop_last=False))
    assert all(len(b) == 8 for b in batches[:-1]) and len(batches[-1]) == 1003 % 8
    random = list(BatchSampler(RandomSampler(range(1003), generator=g), 8, drop_last=False))
    assert padded_share(lengths, batches) < 0.15 < 0.5 < padded_share(lengths, random)  # 0.12 against 0.64


def test_a_resumed_epoch_continues_the_grouped_order_where_it_stopped(tmp_path):
    """Through Accelerate as the trainer prepares it: set_epoch reaches the sampler, and skipping the first batches
    (a resume mid-epoch) gives the rest of the same epoch's batches."""
    from accelerate import Accelerator

    from medusa_train.config import load_config
    from medusa_train.train.run import setup_dataloaders

    rows = [{"input_ids": list(range(n)), "labels": list(range(n))} for n in [3, 40, 7, 22, 5, 31, 9, 17, 2, 28] * 5]
    data = tmp_path / "d.jsonl"
    data.write_text("x\n")
    cfg = load_config(None, [f"target.model={tmp_path}", f"data.dataset={data}", "data.group_by_length=true",
                             "train.batch_size=4", f"output_dir={tmp_path / 'o'}"])
    accelerator = Accelerator(cpu=True)
    train_dl, _ = setup_dataloaders(cfg, accelerator, rows, None, 0)
    train_dl = accelerator.prepare(train_dl)
    train_dl.set_epoch(2)
    whole = [b["attention_mask"].sum(1).tolist() for b in train_dl]
    train_dl.set_epoch(2)
    rest = [b["attention_mask"].sum(1).tolist() for b in accelerator.skip_first_batches(train_dl, 5)]
    assert rest == whole[5:] and len(whole) == 13
    assert all(max(b) - min(b) <= 20 for b in whole[:-1])  # similar lengths a batch (random ones span 2..40)


def test_row_lengths_read_the_arrow_column_through_a_shuffle():
    import datasets

    from medusa_train.data.rows import row_lengths

    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (5, 2, 9, 4, 7)], "labels": [[0]] * 5})
    shuffled = ds.shuffle(seed=1).select([4, 0, 2])
    assert row_lengths(ds) == [5, 2, 9, 4, 7]
    assert row_lengths(shuffled) == [len(r["input_ids"]) for r in shuffled]
