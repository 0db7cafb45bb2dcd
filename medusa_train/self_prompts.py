"""Prompts the target writes itself (the Magpie method): an aligned chat model, given only its chat template's
opening of a user turn, samples a plausible user request. Its replies are then self-distilled as for any prompt
pool, so heads learn from traffic in the model's own chat domain without a dataset.

    python -m medusa_train.distill RECIPE --prompts self --limit 2000 --out runs/self.jsonl

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
from dataclasses import dataclass, field

import torch

from .config import ConfigError
from .target import eos_ids

SENTINEL = "\u2063SELF-PROMPT\u2063"  # an invisible separator no template writes


def user_turn_prefix(tokenizer) -> list[int]:
    """The token ids the chat template writes before a user's words (its default system turn included): what the
    model reads before it writes a request. ConfigError for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--prompts self: the target's tokenizer has no chat template, so it has no user turn to "
                          "open; set target.chat_template or give a prompt file")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if SENTINEL not in text:
        raise ConfigError("--prompts self: the chat template does not write the user's words verbatim")
    prefix = text[:text.index(SENTINEL)]
    return tokenizer(prefix, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def sample_user_turns(model, tokenizer, n: int, *, temperature: float = 1.0, top_p: float = 0.95,
                      max_new_tokens: int = 96, batch_size: int = 16, seed: int = 0, start: int = 0
                      ) -> list[tuple[str, bool]]:
    """Samples `start`..`start + n - 1` of the model's user requests: (text, finished) each, where finished means
    the model closed its turn within `max_new_tokens`. Sample i is drawn with the seed `seed + i // batch_size`
    batch by batch, so a rerun asking for more continues the same sequence."""
    prefix = user_turn_prefix(tokenizer)
    stops = set(eos_ids(model, tokenizer))
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[tuple[str, bool]] = []
    first = start - start % batch_size  # whole batches, so sample i is the same whatever `start` was
    for b in range(first, start + n, batch_size):
        torch.manual_seed(seed + b // batch_size)
        ids = torch.tensor([prefix] * batch_size, device=model.device)  # one prefix: no padding
        seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              temperature=temperature, top_p=top_p, top_k=None, max_new_tokens=max_new_tokens,
                              pad_token_id=pad, eos_token_id=sorted(stops))
        for j, row in enumerate(seqs[:, len(prefix):].tolist()):
            if not start <= b + j < start + n:
                continue
            stop = next((k for k, t in enumerate(row) if t in stops), None)
            text = tokenizer.decode(row if stop is None else row[:stop], skip_special_tokens=True).strip()
            out.append((text, stop is not None))
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _shingles(words: list[str], n: int = 3) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


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
        words = _words(text)
        grams = [tuple(words[j:j + 3]) for j in range(len(words) - 2)]
        letters = [c for c in text if c.isalpha()]
        reason = None
        if not text.strip():
            reason = "empty"
        elif len(words) < min_words:
            reason = "short"
        elif not finished:
            reason = "unfinished"
        elif grams and max(grams.count(g) for g in set(grams)) >= 3:
            reason = "repetitive"
        elif latin_only and letters and sum(c.isascii() for c in letters) < 0.8 * len(letters):
            reason = "language"
        else:
            mine = _shingles(words)
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
