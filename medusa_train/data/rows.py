"""Training data: load a dataset, render it with the target's tokenizer, pack or mask it, batch it.

Two formats (`data.format`, `auto` picks):

- chat: one conversation per row (any layout of `formats.py`), rendered with the target's chat template
  (`chat.py`) and truncated to `data.max_length`. `labels[t] = input_ids[t]` on the tokens the model
  generates in assistant replies (the reply text and the end-of-turn token, e.g. `<|im_end|>`), -100
  elsewhere (system and user turns, the assistant header, the newline a template puts after the
  end-of-turn token).
- text: `data.text_column` tokenized, documents joined with EOS after each one (BOS before each one when
  the tokenizer adds BOS) and cut into blocks of exactly `data.max_length`; only the very last block may
  be shorter, so no token is lost. `labels = input_ids`. A `.txt` file is one document.

Label convention: `labels[t] != -100` means token t is one the model is supposed to generate.

Every problem a user can fix raises `DataError` (a `ConfigError`), one line naming `data.dataset` or the
key to change; the CLI exits 2 on it.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from .chat import IGNORE_INDEX, ChatTemplateError, end_of_turn_ids, tokenize_chat
from ..config import Config, DataConfig
from ..base.errors import ConfigError, DataError
from ..base.files import local_data_files
from .formats import chat_messages, detect_format


# ---------------------------------------------------------------------------------------------------
# Loading

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv",
             ".arrow": "arrow"}


def load_raw(data: DataConfig):
    """The rows of `data.dataset` as a `datasets.Dataset` (hub name, local file, directory or glob)."""
    import datasets

    try:
        files = local_data_files(data.dataset)
    except ConfigError as e:
        raise e if isinstance(e, DataError) else DataError(str(e)) from None
    if files is None:
        return _load_hub(data)
    builders = {}
    for f in files:
        builder = _BUILDERS.get(Path(f).suffix.lower())
        if builder is None:
            raise DataError(f"data.dataset: {f} is not a json/jsonl/parquet/txt/csv/arrow file")
        builders.setdefault(builder, []).append(f)
    if len(builders) > 1:
        kinds = ", ".join(f"{b} ({len(fs)} files)" for b, fs in builders.items())
        raise DataError(f"data.dataset {data.dataset} mixes file types: {kinds}; point it at one kind")
    (builder, files), = builders.items()
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"data.dataset {data.dataset} is empty (no rows)")
    kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
    except Exception as e:  # noqa: BLE001 - arrow/json errors come in many types
        if builder != "json":
            raise DataError(f"data.dataset: could not read {data.dataset}: {_one_line(e)}") from None
        return _load_json_by_hand(files, data.dataset, e)
    # a .json file holding {"data": [{...}, ...]} reads as one row with one column: unwrap it
    if (builder == "json" and len(ds) == len(files) and all(f.lower().endswith(".json") for f in files)
            and len(ds.column_names) == 1 and ds.column_names[0] not in ("messages", "conversations", "turns")):
        first = ds[0][ds.column_names[0]]
        if isinstance(first, list) and first and isinstance(first[0], dict):
            return _load_json_by_hand(files, data.dataset, ValueError("wrapped rows"))
    return ds


def _load_hub(data: DataConfig):
    import datasets

    try:
        return datasets.load_dataset(data.dataset, split=data.split)
    except ValueError as e:
        if "split" in str(e).lower():
            raise DataError(f"data.split={data.split!r} not found in {data.dataset}: {_one_line(e)}") from None
        reason = e
    except Exception as e:  # noqa: BLE001 - offline, not found, gated, network: all the same advice
        reason = e
    raise DataError(f"data.dataset: could not load {data.dataset!r} from the Hugging Face hub "
                    f"({type(reason).__name__}: {_one_line(reason)}); if you are offline or it is a local "
                    f"file, pass a local path (a json/jsonl/parquet/txt/csv file, a directory or a glob)")


def _load_json_by_hand(files: list[str], name: str, first_error: Exception):
    """Fallback for JSON that the arrow reader rejects (a top-level object of rows, mixed types, files of different
    layouts)."""
    import datasets

    rows: list[dict] = []
    for f in files:
        raw = Path(f).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_utf8(f, raw, e) from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = []
            for n, line in enumerate(text.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    obj.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"data.dataset: {f} line {n} is not valid JSON ({e.msg} at column {e.colno}): "
                                    "fix or remove that line") from None
        if isinstance(obj, dict):  # {"data": [...]} or a single row
            lists = [v for k, v in obj.items() if k not in ("messages", "conversations")
                     and isinstance(v, list) and v and isinstance(v[0], dict)]
            obj = lists[0] if len(lists) == 1 else [obj]
        if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
            raise DataError(f"data.dataset: {f} must hold a list of objects (rows), got {type(obj).__name__}")
        rows += obj
    if not rows:
        raise DataError(f"data.dataset {name} is empty (no rows)")
    # every column of every row: from_list takes its columns from the first row alone, so a directory of
    # chat rows and Alpaca rows would otherwise lose every Alpaca row's content
    columns = list(dict.fromkeys(k for r in rows for k in r))
    try:
        return datasets.Dataset.from_list([{k: r.get(k) for k in columns} for r in rows])
    except Exception:  # noqa: BLE001
        raise DataError(f"data.dataset: could not read {name}: {_one_line(first_error)}") from None


def _not_utf8(path: str, raw: bytes, e: UnicodeDecodeError) -> DataError:
    line = raw[:e.start].count(b"\n") + 1
    return DataError(f"data.dataset: {path} line {line} holds a byte that is not UTF-8 ({raw[e.start]:#04x} at byte "
                     f"{e.start}): save the file as UTF-8")


def _find_not_utf8(dataset: str) -> DataError | None:
    """The first local data file with a byte that is not UTF-8 (read only after the arrow reader tripped on one)."""
    for f in local_data_files(dataset) or []:
        raw = Path(f).read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return _not_utf8(f, raw, e)
    return None


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


# ---------------------------------------------------------------------------------------------------
# Building the datasets


def _eval_count(eval_size: float, n: int) -> int:
    """Held-out examples: a fraction (at least 1, never all: a 1-row set gets none) or an exact count."""
    if eval_size <= 0:
        return 0
    if eval_size < 1:
        return min(max(1, round(eval_size * n)), n - 1)
    if int(eval_size) >= n:
        raise DataError(f"data.eval_size={eval_size:g} leaves no training examples out of {n}; lower it")
    return int(eval_size)


def _bos_id(tokenizer) -> int | None:
    """The BOS id if the tokenizer puts one in front of plain text (Llama-style), else None."""
    bos = tokenizer.bos_token_id
    if bos is None or bos == tokenizer.eos_token_id:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def _tokenize_text_batch(batch, tokenizer, column: str, bos: int | None, eos: int):
    bad = next((t for t in batch[column] if t is not None and not isinstance(t, str)), None)
    if bad is not None:  # a list or a number would be trained on as its Python repr
        raise DataError(f"data.text_column={column!r} holds a {type(bad).__name__} ({bad!r:.60}), not text: point "
                        "data.text_column at a column of strings (or use data.format=chat for conversations)")
    texts = ["" if t is None else t for t in batch[column]]
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out = []
    for ids in enc:
        if not ids:
            out.append([])
            continue
        out.append(([bos] if bos is not None else []) + list(ids) + [eos])
    return {"input_ids": out}


def _pack(tok_ds, max_length: int):
    """Concatenate all documents and cut into blocks of max_length (the last may be shorter)."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    if tok_ds._indices is not None:
        tok_ds = tok_ds.flatten_indices()
    col = tok_ds.data.column("input_ids")
    values = pa.chunked_array([c.flatten() for c in col.chunks], type=col.type.value_type).combine_chunks() \
        if col.num_chunks else pa.array([], type=pa.int64())
    values = values.cast(pa.int32())
    n = len(values)
    offsets = np.append(np.arange(0, n, max_length, dtype=np.int64), np.int64(n)) if n else np.zeros(1, np.int64)
    if n < 2**31:
        blocks = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    else:  # 32-bit list offsets overflow past 2**31 tokens
        blocks = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    table = pa.table({"input_ids": blocks, "labels": blocks})
    return datasets.Dataset(InMemoryTable(table))


_NO_REPLY = "no assistant reply"
_TRUNCATED = "first assistant reply starts beyond data.max_length"


def _unended(ids: list[int], labels: list[int], end_ids: frozenset[int]) -> tuple[list[int], list[int]]:
    """A last reply that stopped at the token budget (distillation's `finish: length`) keeps its text but not the
    end-of-turn token the template renders after it: the target never wrote it there, and heads taught it would
    learn that a reply ends wherever a budget ran out."""
    last = max((t for t, x in enumerate(labels) if x != IGNORE_INDEX), default=None)
    if last is not None and ids[last] in end_ids:
        return ids[:last], labels[:last]
    return ids, labels


def _chat_batch(batch, tokenizer, max_length: int):
    keys = list(batch)
    out: dict[str, list] = {"input_ids": [], "labels": [], "n_sup": [], "drop_reason": []}
    end_ids = end_of_turn_ids(tokenizer)
    for i in range(len(batch[keys[0]])):
        row = {k: batch[k][i] for k in keys}
        ids: list[int] = []
        labels: list[int] = []
        reason = ""
        try:
            msgs = chat_messages(row)
            if not msgs:
                reason = "empty conversation"
            else:
                enc = tokenize_chat(msgs, tokenizer, max_length, end_ids)
                ids, labels = enc["input_ids"], enc["labels"]
                if row.get("finish") == "length" and msgs[-1]["role"] == "assistant":
                    ids, labels = _unended(ids, labels, end_ids)
        except ChatTemplateError:
            raise
        except DataError as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - jinja raise_exception(), e.g. roles must alternate
            reason = f"chat template error: {_one_line(e)}"
        n_sup = sum(1 for x in labels if x != IGNORE_INDEX)
        if not reason and n_sup == 0:
            reason = _TRUNCATED if any(m["role"] == "assistant" for m in msgs) else _NO_REPLY
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["n_sup"].append(n_sup)
        out["drop_reason"].append(reason)
    return out


def _lengths(ds, column: str) -> np.ndarray:
    import pyarrow.compute as pc

    if len(ds) == 0:
        return np.zeros(0, dtype=np.int64)
    if ds._indices is not None:
        ds = ds.flatten_indices()
    return np.asarray(pc.list_value_length(ds.data.column(column).combine_chunks()).to_numpy(zero_copy_only=False),
                      dtype=np.int64)


def _tokenize(ds, fmt: str, cfg: Config, tokenizer, desc: str):
    """Tokenize one split. Returns (rows, dropped, drop_reasons, supervised_tokens)."""
    d = cfg.data
    num_proc = min(d.num_proc, max(1, len(ds))) if d.num_proc > 1 else None
    if fmt == "text":
        eos = tokenizer.eos_token_id
        if eos is None:
            raise DataError("the target's tokenizer has no eos_token, needed to separate packed documents")
        tok = ds.map(_tokenize_text_batch, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
                     fn_kwargs=dict(tokenizer=tokenizer, column=d.text_column, bos=_bos_id(tokenizer), eos=int(eos)),
                     desc=f"Tokenizing {desc}")
        lens = _lengths(tok, "input_ids")
        dropped = int((lens == 0).sum())
        packed = _pack(tok, d.max_length)
        n_tok = int(lens.sum())
        return packed, dropped, Counter({"empty document": dropped} if dropped else {}), n_tok
    tok = ds.map(_chat_batch, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
                 fn_kwargs=dict(tokenizer=tokenizer, max_length=d.max_length), desc=f"Tokenizing {desc}")
    reasons = Counter(r for r in tok["drop_reason"] if r)
    n_sup = np.asarray(tok["n_sup"], dtype=np.int64)
    keep = np.nonzero(n_sup > 0)[0]
    dropped = len(tok) - len(keep)
    if dropped:
        tok = tok.select(keep)
    tok = tok.remove_columns(["n_sup", "drop_reason"])
    return tok, dropped, reasons, int(n_sup[keep].sum()) if len(keep) else 0


def build_datasets(cfg: Config, tokenizer):
    """-> (train, eval or None, info). Rows hold `input_ids` and `labels` (lists of int, len <= max_length).

    info: {"format", "rows", "tokens", "supervised_tokens", "dropped"} for the training split, plus
    "eval_rows", "eval_tokens" and "drop_reasons" ({reason: count} over both splits).
    """
    d = cfg.data
    raw = load_raw(d)
    if len(raw) == 0:
        raise DataError(f"data.dataset {d.dataset} is empty (no rows)")
    fmt = detect_format(raw, d)
    raw = raw.shuffle(seed=cfg.train.seed)
    if d.max_examples and d.max_examples < len(raw):
        raw = raw.select(range(d.max_examples))
    n_eval = _eval_count(d.eval_size, len(raw))
    eval_raw = raw.select(range(n_eval)) if n_eval else None
    train_raw = raw.select(range(n_eval, len(raw))) if n_eval else raw

    try:  # the arrow reader keeps bytes that are not UTF-8; they fail when read as text, here
        train, dropped, reasons, sup = _tokenize(train_raw, fmt, cfg, tokenizer, "train")
        eval_ds, eval_dropped = None, 0
        if eval_raw is not None:
            eval_ds, eval_dropped, eval_reasons, _ = _tokenize(eval_raw, fmt, cfg, tokenizer, "eval")
            reasons += eval_reasons
    except UnicodeDecodeError as e:
        raise _find_not_utf8(d.dataset) or DataError(f"data.dataset {d.dataset}: not UTF-8 text ({e})") from None
    tokens = int(_lengths(train, "input_ids").sum())
    if fmt == "text":
        sup = tokens
    top = f" (most common: {reasons.most_common(1)[0][0]})" if reasons else ""
    if len(train) == 0 or tokens == 0:
        if fmt == "chat":
            if reasons and set(reasons) == {_NO_REPLY}:
                hint = "a prompts-only file needs responses first (self-distillation)"
            elif _TRUNCATED in reasons:
                hint = f"raise data.max_length (now {d.max_length})"
            else:
                hint = "check the roles and the chat template"
            raise DataError(f"no conversation in {d.dataset} has an assistant token to train on: all "
                            f"{dropped} training rows dropped{top}; {hint}")
        raise DataError(f"data.dataset {d.dataset}: column {d.text_column!r} holds no text (all documents empty)")
    total = len(train_raw) + (len(eval_raw) if eval_raw is not None else 0)
    lost = dropped + eval_dropped
    if fmt == "chat" and total and lost / total > d.max_dropped and len(train):
        raise DataError(f"{lost} of {total} rows of {d.dataset} cannot be trained on ({lost / total:.0%}, more than "
                        f"data.max_dropped={d.max_dropped:g}){top}: fix the data, or raise data.max_dropped")
    if fmt == "chat" and sup == tokens:
        raise DataError(f"every token of {d.dataset} is supervised: the chat template marks no prompt or header "
                        "tokens, so the mask is wrong; check the roles (are all turns 'assistant'?) or use "
                        "data.format=text")
    if eval_ds is not None and len(eval_ds) == 0:
        eval_ds = None
    info = {"format": fmt, "rows": len(train), "tokens": tokens, "supervised_tokens": int(sup), "dropped": dropped,
            "eval_rows": len(eval_ds) if eval_ds is not None else 0,
            "eval_tokens": int(_lengths(eval_ds, "input_ids").sum()) if eval_ds is not None else 0,
            "eval_dropped": eval_dropped, "drop_reasons": dict(reasons)}
    return train, eval_ds, info


# ---------------------------------------------------------------------------------------------------
# Batching and reports


def collate(rows: list[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, labels: LongTensors [B, T], right-padded to the longest row (labels -100).

    A tokenizer without a pad token can pass None: padding then uses id 0, which the mask hides.
    """
    pad_token_id = 0 if pad_token_id is None else pad_token_id
    if not rows:
        raise ValueError("collate needs at least one row")
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), int(pad_token_id), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        if len(r["labels"]) != n:
            raise ValueError(f"row {i}: {n} input_ids but {len(r['labels'])} labels")
        ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(r["labels"], dtype=torch.long)
        mask[i, :n] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return batch


def row_lengths(ds) -> list[int]:
    """Each row's token count, read from the arrow column where `ds` is a `datasets.Dataset` (no row decoded; through
    its indices mapping when it has one)."""
    table = getattr(ds, "data", None)
    if table is not None and hasattr(table, "column"):
        import pyarrow.compute as pc

        lengths = pc.list_value_length(table.column("input_ids"))
        indices = getattr(ds, "_indices", None)
        if indices is not None:
            lengths = lengths.take(indices.column(0))
        return lengths.to_pylist()
    return [len(r["input_ids"]) for r in ds]


class LengthGroupedSampler(torch.utils.data.Sampler):
    """Row indices in batches of similar length (`data.group_by_length`): epoch e's order is a permutation drawn from
    (seed, e), cut into spans of `span` batches of `batch_size` rows, each span sorted longest first and cut into
    batches, whose order is then drawn again. The same (seed, epoch) gives the same order on every process and after a
    resume (Accelerate's `set_epoch` reaches it through the batch samplers it wraps)."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, span: int = 64):
        self.lengths = torch.as_tensor(lengths, dtype=torch.long)
        self.batch_size, self.seed, self.span, self.epoch = batch_size, seed, span, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g)
        step = self.span * self.batch_size
        batches = []
        for a in range(0, len(order), step):
            part = order[a:a + step]
            part = part[torch.argsort(self.lengths[part], descending=True, stable=True)]
            batches += list(part.split(self.batch_size))
        short = [b for b in batches if len(b) < self.batch_size]  # at most one: the last span's last batch
        full = [b for b in batches if len(b) == self.batch_size]
        # the loader cuts this stream every batch_size rows: a short batch anywhere but last would shift every cut
        for i in torch.randperm(len(full), generator=g).tolist():
            yield from full[i].tolist()
        for b in short:
            yield from b.tolist()


def padded_share(lengths: list[int], batches: Iterable[list[int]]) -> float:
    """The share of a batch's positions that are padding, over `batches` (lists of row indices)."""
    real = padded = 0
    for b in batches:
        n = [lengths[i] for i in b]
        real, padded = real + sum(n), padded + max(n) * len(n)
    return 1 - real / max(padded, 1)


def _marked(tokenizer, ids: list[int], labels: list[int], colour: bool) -> str:
    """Decode a row with supervised spans wrapped in [[ ]] (green when colour)."""
    open_, close = ("\x1b[32m[[", "]]\x1b[0m") if colour else ("[[", "]]")
    parts, t = [], 0
    while t < len(ids):
        sup = labels[t] != IGNORE_INDEX
        u = t
        while u < len(ids) and (labels[u] != IGNORE_INDEX) == sup:
            u += 1
        text = tokenizer.decode(ids[t:u], skip_special_tokens=False)
        parts.append(f"{open_}{text}{close}" if sup else text)
        t = u
    return "".join(parts)


def dry_run_report(cfg: Config, tokenizer, n_examples: int = 2) -> str:
    """What training would see: a few examples with supervised spans marked [[ ]], and dataset totals."""
    train, eval_ds, info = build_datasets(cfg, tokenizer)
    colour = sys.stdout.isatty()
    lines = [f"data: {cfg.data.dataset} (format {info['format']}, max_length {cfg.data.max_length})"]
    for i in range(min(n_examples, len(train))):
        row = train[i]
        n = len(row["input_ids"])
        s = sum(1 for x in row["labels"] if x != IGNORE_INDEX)
        lines.append(f"--- example {i}: {n} tokens, {s} supervised ({s / max(n, 1):.0%}); supervised text in [[ ]]")
        lines.append(_marked(tokenizer, row["input_ids"], row["labels"], colour))
    lines.append("---")
    frac = info["supervised_tokens"] / max(info["tokens"], 1)
    lines.append(f"train: {info['rows']} rows, {info['tokens']} tokens, {info['supervised_tokens']} supervised "
                 f"({frac:.0%}), {info['dropped']} rows dropped")
    if info["drop_reasons"]:
        lines.append("dropped: " + "; ".join(f"{c} x {r}" for r, c in Counter(info["drop_reasons"]).most_common(3)))
    lines.append(f"eval: {info['eval_rows']} rows, {info['eval_tokens']} tokens" if eval_ds is not None
                 else f"eval: none (data.eval_size={cfg.data.eval_size:g})")
    return "\n".join(lines)


def token_counts(ds, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64 counts of the supervised tokens (labels != -100) of a tokenized dataset."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in ds.with_format("arrow").iter(batch_size=4096):
        col = batch.column("labels")
        vals = np.concatenate([c.flatten().to_numpy(zero_copy_only=False) for c in col.chunks]) \
            if hasattr(col, "chunks") else col.flatten().to_numpy(zero_copy_only=False)
        vals = vals[vals != IGNORE_INDEX].astype(np.int64)
        bad = vals[(vals < 0) | (vals >= vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} outside a vocabulary of {vocab_size}")
        counts += np.bincount(vals, minlength=vocab_size)
    return torch.from_numpy(counts)


def select_draft_vocab(counts: torch.Tensor, n: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `n` most frequent ids (ties: lower id first), `always` forced in, sorted ascending (LongTensor)."""
    counts = torch.as_tensor(counts)
    V = counts.numel()
    always = sorted({int(a) for a in always if a is not None})
    if n <= 0:
        raise ValueError(f"draft vocab size must be > 0, got {n}")
    if any(a < 0 or a >= V for a in always):
        raise ValueError(f"always-included ids {always} outside a vocabulary of {V}")
    if len(always) > n:
        raise ValueError(f"{len(always)} always-included ids do not fit a draft vocab of {n}")
    if n >= V:
        return torch.arange(V, dtype=torch.long)
    key = counts.to(torch.float64).clone()
    if always:
        key[torch.tensor(always)] = float("inf")
    order = torch.sort(-key, stable=True).indices[:n]
    return torch.sort(order).values.to(torch.long)
