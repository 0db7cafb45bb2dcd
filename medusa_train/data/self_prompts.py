"""Prompts the target writes itself (the Magpie method): an aligned chat model, given only its chat template's
opening of a user turn, samples a plausible user request. Its replies are then self-distilled as for any prompt
pool, so heads learn from traffic in the model's own chat domain without a dataset.

    python -m medusa_train.data.distill RECIPE --prompts self --limit 2000 --out runs/self.jsonl

The samples are filtered before anything answers them; `filter_prompts` says how many each filter dropped:
- `empty`: nothing but whitespace; `short`: fewer than `min_words` words; `unfinished`: the sample hit its token
  limit before the model closed the turn (a request cut off mid-sentence);
- `repetitive`: a word 3-gram occurring three or more times (a degenerate sample);
- `near_duplicate`: most of its word 3-grams (Jaccard >= 0.7) already in a kept prompt;
- `language`: (an option) under 80% of its letters in the Latin alphabet;
- `excluded`: it appears in an `--exclude` file (benchmark prompts never reach training).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .batch_decode import decode
from ..config import ConfigError
from ..target.model import pad_id, stop_ids

SENTINEL = "\u2063SELF-PROMPT\u2063"  # an invisible separator no template writes


def user_turn_prefix(tokenizer, history: list[dict[str, str]] | None = None) -> list[int]:
    """The token ids the chat template writes before a user's words (its default system turn included, and the
    conversation so far when `history` is given): what the model reads before it writes a request. ConfigError
    for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--prompts self / --turns: the target's tokenizer has no chat template, so it has no user "
                          "turn to open; set target.chat_template, or give a prompt file and one turn")
    text = tokenizer.apply_chat_template(list(history or []) + [{"role": "user", "content": SENTINEL}],
                                         tokenize=False, add_generation_prompt=False)
    if SENTINEL not in text:
        raise ConfigError("--prompts self / --turns: the chat template does not write the user's words verbatim")
    prefix = text[:text.index(SENTINEL)]
    return tokenizer(prefix, add_special_tokens=False)["input_ids"]


def sample_seed(seed: int, i: int) -> int:
    """The seed of request i of a run seeded `seed`: every request has its own generator, so it is the same
    whichever requests were drawn beside it, or before it. Distinct for every (seed, i < 1,000,003) and under 2**32
    for seeds under 4,000 (a CPU generator keeps the low 32 bits of its seed)."""
    return (seed * 1_000_003 + i) % 2**32


def sample_user_turns(model, tokenizer, indices: Sequence[int], *, temperature: float = 1.0, top_p: float = 0.95,
                      max_new_tokens: int = 96, batch_size: int = 32, seed: int = 0,
                      on_sample: Callable[[int, str, bool], None] | None = None) -> dict[int, tuple[str, bool]]:
    """Samples the model's user requests number `indices`: {i: (text, finished)}, where finished means the model
    closed its turn within `max_new_tokens`; request i from a generator seeded `sample_seed(seed, i)`, so a rerun
    asking for more draws the same ones again. `batch_size` requests are in flight at once (continuous batching:
    a short request frees its slot for the next). `on_sample(i, text, finished)` sees each as it ends (the CLI
    keeps them on disk and moves its progress bar)."""
    prefix = user_turn_prefix(tokenizer)
    indices = list(indices)
    out: dict[int, tuple[str, bool]] = {}
    for k, tokens, finished in decode(model, [prefix] * len(indices), max_new_tokens=max_new_tokens,
                                      stops=stop_ids(model, tokenizer), pad_id=pad_id(tokenizer),
                                      batch_size=batch_size, temperature=temperature, top_p=top_p,
                                      seeds=[sample_seed(seed, i) for i in indices]):
        text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        out[indices[k]] = (text, finished)
        if on_sample is not None:
            on_sample(indices[k], text, finished)
    return out


@dataclass
class FollowUps:
    """The target writes the user's next turn of a conversation (`distill --turns N`): sampled after the
    conversation so far and the template's opening of a user turn, then filtered as first requests are (all but
    near_duplicate, which compares requests with each other). `dropped` counts the follow-ups each filter took."""
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 96
    min_words: int = 4
    latin_only: bool = False
    dropped: dict[str, int] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                "latin_only": self.latin_only}

    def write(self, model, tokenizer, conversations: list[list[dict[str, str]]], seeds: Sequence[int],
              batch_size: int = 32) -> list[str | None]:
        """The next user turn for each conversation (conversation k sampled from a generator seeded `seeds[k]`, so
        its follow-up does not depend on the conversations beside it), None where a filter dropped it."""
        prefixes = [user_turn_prefix(tokenizer, c) for c in conversations]
        drawn: dict[int, tuple[str, bool]] = {}
        for k, tokens, finished in decode(model, prefixes, max_new_tokens=self.max_tokens,
                                          stops=stop_ids(model, tokenizer), pad_id=pad_id(tokenizer),
                                          batch_size=batch_size, temperature=self.temperature, top_p=self.top_p,
                                          seeds=list(seeds)):
            drawn[k] = (tokenizer.decode(tokens, skip_special_tokens=True).strip(), finished)
        out: list[str | None] = []
        for k in range(len(conversations)):
            text, finished = drawn[k]
            reason = _reject(text, finished, self.min_words, self.latin_only)
            if reason is not None:
                self.dropped[reason] = self.dropped.get(reason, 0) + 1
            out.append(text if reason is None else None)
        return out


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _shingles(words: list[str], n: int = 3) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def _reject(text: str, finished: bool, min_words: int, latin_only: bool) -> str | None:
    """The first filter (module docstring) that drops one sample on its own, or None."""
    words = _words(text)
    grams = [tuple(words[j:j + 3]) for j in range(len(words) - 2)]
    letters = [c for c in text if c.isalpha()]
    if not text.strip():
        return "empty"
    if len(words) < min_words:
        return "short"
    if not finished:
        return "unfinished"
    if grams and max(grams.count(g) for g in set(grams)) >= 3:
        return "repetitive"
    if latin_only and letters and sum(c.isascii() for c in letters) < 0.8 * len(letters):
        return "language"
    return None


@dataclass
class Filtered:
    kept: list[int] = field(default_factory=list)  # indices of the samples kept, in order
    dropped: dict[str, int] = field(default_factory=dict)  # filter -> samples it dropped


def filter_prompts(samples: list[tuple[str, bool]], *, min_words: int = 4, near_duplicate: float = 0.7,
                   latin_only: bool = False) -> Filtered:
    """Which samples to answer (module docstring), each filter counted; the first filter that applies names a drop.
    `--exclude` files are applied after, by `prompts.exclude_prompts` (as for every pool), and counted as `excluded`."""
    result = Filtered(dropped={k: 0 for k in ("empty", "short", "unfinished", "repetitive", "near_duplicate",
                                              "language", "excluded")})
    seen: list[set[tuple[str, ...]]] = []
    holders: dict[tuple[str, ...], list[int]] = {}  # shingle -> kept prompts holding it: compare with those only
    for i, (text, finished) in enumerate(samples):
        reason = _reject(text, finished, min_words, latin_only)
        if reason is None:
            mine = _shingles(_words(text))
            others = {j for g in mine for j in holders.get(g, ())}  # Jaccard > 0 needs a shared shingle
            if any(len(mine & seen[j]) / len(mine | seen[j]) >= near_duplicate for j in others):
                reason = "near_duplicate"
            else:
                for g in mine:
                    holders.setdefault(g, []).append(len(seen))
                seen.append(mine)
        if reason is None:
            result.kept.append(i)
        else:
            result.dropped[reason] += 1
    return result
