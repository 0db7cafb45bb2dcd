"""The distillation's output file: append-only JSONL, fsynced a chunk at a time, resumable (rows read by id and by
prompt text; a line a crash cut short is skipped and repaired), and per-rank parts merged into it."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}.rank{rank}")


def _rows(path: Path):
    """The complete rows of a JSONL file, in order; a line cut short by a crash (or any unreadable line) is
    skipped, so its prompt is simply redone. Splits on newlines only: JSON keeps U+2028 and friends raw in
    strings, and `str.splitlines` would cut a row there."""
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "id" in row:
            yield row


def _prompt_text(row: dict) -> str | None:
    """The user turn a distilled row answers (None for a row of another shape)."""
    messages = row.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        content = messages[0].get("content")
        return content if isinstance(content, str) else None
    return None


def _parts(out: Path) -> list[Path]:
    """The per-rank part files of `out` a multi-process run left, in rank order."""
    return sorted(out.parent.glob(f"{out.name}.rank*"))


def read_done(out: Path) -> tuple[set[str], set[str]]:
    """Ids and prompt texts already answered in `out` or any of its per-rank parts."""
    ids: set[str] = set()
    texts: set[str] = set()
    for f in [out, *_parts(out)]:
        for row in _rows(f):
            ids.add(str(row["id"]))
            text = _prompt_text(row)
            if text is not None:
                texts.add(text)
    return ids, texts


def merge_parts(out: Path) -> int:
    """Append every complete row of `out`'s per-rank parts to `out` (skipping ids it has), delete the parts.
    Returns the number of rows appended."""
    have = _ids_in(out)
    parts = _parts(out)
    new = []
    for part in parts:
        for row in _rows(part):
            if str(row["id"]) not in have:
                have.add(str(row["id"]))
                new.append(row)
    _append_rows(out, new)
    for part in parts:
        part.unlink()
    return len(new)


def _append_rows(path: Path, rows: list[dict]) -> None:
    """Append rows as JSON lines, flushed and fsynced: once this returns, a crash loses none of them."""
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _ids_in(path: Path) -> set[str]:
    return {str(row["id"]) for row in _rows(path)}


def _repair_tail(path: Path) -> None:
    """Cut a last line that a crash left without its newline, so appended rows start on a fresh line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])
