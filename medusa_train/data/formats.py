"""Row layouts: the conversation (or the prompt) in a dataset row of any layout the trainer reads.

`messages` [{role, content}]; ShareGPT `conversations` [{from, value}]; Alpaca `instruction` (+ `input`) +
`output`; a `prompt`/`question` + `answer`/`response`/`completion`/`output` pair (GSM8K); prompts only
(`prompt`, `question`, MT-Bench `turns`), which need replies first (`python -m medusa_train.data.distill`).
"""

from __future__ import annotations

from typing import Any, Iterable, Literal

from ..config import DataConfig
from ..base.errors import DataError

_ROLES = {"system": "system", "human": "user", "user": "user", "prompter": "user",
          "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "gpt4": "assistant", "model": "assistant"}
_PROMPT_KEYS = ("prompt", "question", "query", "instruction", "input")
ANSWER_KEYS = ("answer", "response", "completion", "output")  # also what inference.bench counts bigrams on


def _chat_kind(columns: Iterable[str]) -> str | None:
    """Which chat layout a set of columns holds: a pair-style one ranks over prompts-only."""
    cols = set(columns)
    if "messages" in cols:
        return "messages"
    if "conversations" in cols:
        return "conversations"
    if "instruction" in cols and "output" in cols:
        return "alpaca"
    if any(k in cols for k in _PROMPT_KEYS) and any(k in cols for k in ANSWER_KEYS):
        return "pair"
    if "turns" in cols or any(k in cols for k in _PROMPT_KEYS):
        return "prompts"
    return None


def _content(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI-style content parts
        return "".join(p.get("text") or "" if isinstance(p, dict) else str(p) for p in value)
    return str(value)


def _first(d: dict, *keys: str) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def _norm_turns(turns: Any) -> list[dict[str, str]] | None:
    if not isinstance(turns, list):
        return None
    out = []
    for m in turns:
        if not isinstance(m, dict):
            raise DataError(f"chat turns must be objects with role/content or from/value, got {m!r:.80}")
        role = _first(m, "role", "from")
        mapped = _ROLES.get(str(role).strip().lower()) if role is not None else None
        if mapped is None:
            raise DataError(f"unknown chat role {role!r}; known roles: {', '.join(sorted(_ROLES))}")
        out.append({"role": mapped, "content": _content(_first(m, "content", "value", "text"))})
    return out


def rows_to_messages(example: dict) -> list[dict[str, str]] | None:
    """The conversation in a row of any supported layout, or None if the row holds none.

    `messages` [{role, content}]; ShareGPT `conversations` [{from, value}] (+ an optional `system` column);
    Alpaca `instruction` (+ `input`, optional `system` and LLaMA-Factory `history` [[q, a], ...]) + `output`;
    `prompt`/`question` + `answer`/`response`/`completion`/`output`; prompts only (`prompt`, `question`,
    MT-Bench `turns`: the first turn) give a single user message.
    """
    kind = _chat_kind(k for k, v in example.items() if v is not None)
    if kind in ("messages", "conversations"):
        msgs = _norm_turns(example[kind])
        system = _content(example.get("system"))  # some ShareGPT sets keep the system prompt beside the turns
        if msgs is not None and system.strip() and not (msgs and msgs[0]["role"] == "system"):
            msgs = [{"role": "system", "content": system}] + msgs
        return msgs
    if kind == "alpaca":
        user = _content(example.get("instruction"))
        extra = _content(example.get("input"))
        if extra.strip():
            user = f"{user}\n\n{extra}" if user.strip() else extra
        msgs = []
        if _content(example.get("system")).strip():
            msgs.append({"role": "system", "content": _content(example["system"])})
        for pair in example.get("history") or []:
            if isinstance(pair, (list, tuple)) and len(pair) == 2:
                msgs += [{"role": "user", "content": _content(pair[0])},
                         {"role": "assistant", "content": _content(pair[1])}]
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": _content(example["output"])}]
    if kind == "pair":
        user = _content(_first(example, *_PROMPT_KEYS))
        return [{"role": "user", "content": user},
                {"role": "assistant", "content": _content(_first(example, *ANSWER_KEYS))}]
    if kind == "prompts":
        turns = example.get("turns")
        if isinstance(turns, list) and turns:
            return [{"role": "user", "content": _content(turns[0])}]
        return [{"role": "user", "content": _content(_first(example, *_PROMPT_KEYS))}]
    return None


def chat_messages(example: dict) -> list[dict[str, str]]:
    """The row's conversation normalised to [{role: system|user|assistant, content}]; DataError if none."""
    msgs = rows_to_messages(example)
    if msgs is None:
        raise DataError(f"row has no conversation: columns {sorted(example)}; expected messages [{{role, content}}] "
                        "or conversations [{from, value}]")
    return msgs


def prompt_of(example: dict) -> str | None:
    """The first user prompt of a row in any supported layout (None if it has none or it is blank)."""
    try:
        msgs = rows_to_messages(example)
    except DataError:
        return None
    for m in msgs or []:
        if m["role"] == "user":
            return m["content"] if m["content"].strip() else None
    return None


def detect_format(ds, data: DataConfig) -> Literal["text", "chat"]:
    """`data.format`, or for `auto` chat when a conversation column exists, else text. Checks columns."""
    cols = list(ds.column_names)
    kind = _chat_kind(cols)
    if data.format == "chat":
        if kind is None:
            raise DataError(f"data.format=chat but {data.dataset} has columns {cols}; it needs messages "
                            "[{role, content}] or conversations [{from, value}] (or instruction/output, "
                            "question/answer)")
        return "chat"
    if data.format == "text":
        if data.text_column not in cols:
            raise DataError(f"data.text_column={data.text_column!r} is not a column of {data.dataset}; its "
                            f"columns are {cols}: set data.text_column")
        return "text"
    if kind is not None and kind != "prompts":
        return "chat"
    if data.text_column in cols:
        return "text"
    if kind == "prompts":
        return "chat"  # prompts only: fails later with the self-distillation hint
    raise DataError(f"{data.dataset} has no {data.text_column!r} column and no messages/conversations column; "
                    f"its columns are {cols}: set data.text_column to the text column (or data.format)")
