"""Chat templates: rendering a conversation with the target's template and finding the reply spans to
supervise, and rendering a single user prompt the way generation sees it.

Reply spans are found by rendering prefixes of the conversation, never with `{% generation %}`, so any
template works that renders earlier turns the same way once later turns are added.
"""

from __future__ import annotations

from ..base.errors import DataError

IGNORE_INDEX = -100

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                "<|end_of_text|>", "</s>", "<|END_OF_TURN_TOKEN|>", "<|return|>")


class ChatTemplateError(DataError):
    """The chat template does not render a conversation as a prefix-stable sequence (fatal, not per row)."""


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """Ids that end a reply: EOS and the end-of-turn markers the tokenizer knows as added tokens."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    added = tokenizer.get_added_vocab()
    return frozenset(ids | {int(added[t]) for t in _END_OF_TURN if t in added})


def tokenize_chat(messages: list[dict[str, str]], tokenizer, max_length: int,
                  end_ids: frozenset[int] | None = None) -> dict[str, list[int]]:
    """Render a conversation with the tokenizer's chat template; supervise only assistant replies.

    For assistant turn i, `messages[:i]` rendered with the generation prompt must be a token prefix of
    the whole conversation: the reply starts there. It ends after the first end-of-turn token (EOS or a
    known marker such as <|im_end|>) in what `messages[:i+1]` adds, or where that rendering ends if it has
    none. Templates that render a reply differently once later turns follow (Qwen3 drops the empty
    think block of earlier replies) still have a stable start; the span then ends at the first end-of-turn
    token of the full rendering. A template whose earlier turns change (e.g. it moves the system prompt
    into the last user turn) raises ChatTemplateError.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template; use data.format=text or a chat model")
    if end_ids is None:
        end_ids = end_of_turn_ids(tokenizer)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    texts = [tokenizer.apply_chat_template(messages, tokenize=False)]
    for i in turns:
        texts.append(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                     if i else _generation_prompt(tokenizer))
        texts.append(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]  # one batched call
    full = list(enc[0])
    labels = [IGNORE_INDEX] * len(full)
    for j, i in enumerate(turns):
        before, upto = enc[1 + 2 * j], enc[2 + 2 * j]
        start = len(before)
        if full[:start] != before:
            if not texts[0].startswith(texts[1 + 2 * j]):
                raise ChatTemplateError(
                    f"the chat template renders the turns before message {i} differently once later turns are "
                    "added (e.g. it moves the system prompt or adds per-conversation text), so reply spans cannot "
                    "be found; use single-turn rows or another chat template")
            # the text is a prefix, the tokens are not: the reply's first characters merged with the template's
            # last (a reply opening with "\n" after "assistant\n" makes one "\n\n" token). The reply's span starts
            # at the first token that differs, which holds the merge: what the target would emit there.
            start = next((t for t, (a, b) in enumerate(zip(full, before)) if a != b), min(len(full), start))
        if full[: len(upto)] == upto:  # the usual case: this reply renders the same as in the full sequence
            region, stop = upto, len(upto)
        else:
            region, stop = full, None
        for t in range(start, len(region)):
            if region[t] in end_ids:
                stop = t + 1
                break
        if stop is None:
            raise ChatTemplateError(f"message {i}: the chat template renders this reply differently once later "
                                    "turns follow and ends it with no end-of-turn token; use single-turn rows")
        labels[start:stop] = full[start:stop]
    return {"input_ids": full[:max_length], "labels": labels[:max_length]}


def _generation_prompt(tokenizer) -> str:
    """What comes before an assistant reply that opens a conversation: its rendering cut where the reply starts."""
    probe = "\x00MEDUSA_PROBE\x00"
    text = tokenizer.apply_chat_template([{"role": "assistant", "content": probe}], tokenize=False)
    cut = text.find(probe)
    if cut < 0:
        raise ChatTemplateError("the chat template drops assistant-first conversations; start rows with a user turn")
    return text[:cut]


def render_prompt(tokenizer, text: str | list[dict[str, str]]) -> list[int]:
    """One user turn (or a conversation ending with one) through the chat template with the assistant header
    appended: the token ids a chat model sees before its reply (what distillation, the benchmark and
    `generate(chat=True)` feed it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: pass the prompt as plain text (chat=False)")
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)
