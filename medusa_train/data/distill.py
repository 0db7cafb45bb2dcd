"""Self-distillation: the target's own replies to a pool of prompts, as chat JSONL for training heads.

Heads learn best from text the target itself would write (the draft is accepted exactly when it guesses
the target's next token), so the training set is the target's greedy (or sampled) reply to prompts like
the ones users send. Each output row is

    {"id": "...", "messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": REPLY}, ...],
     "finish": "stop" | "length", "generation": {how the replies were made}}

which `data.dataset` reads as chat (supervised on the replies only).

    python -m medusa_train.data.distill recipes/smollm2-135m.yaml \\
        target.model=$(python -m medusa_train.target.prepare) --prompts default --out runs/distill/default.jsonl
    python -m medusa_train.data.distill RECIPE --prompts sharegpt.json --turns all --out runs/sg.jsonl \\
        --exclude mt_bench_question.jsonl --engine vllm --vllm-python $VLLM_VENV/bin/python

- Prompts: `self` (the target writes them: `medusa_train.data.self_prompts`; `--limit N` requests, filtered), `default`
  (the project's own offline pool, `medusa_train.data.prompts`), or any json/jsonl/parquet
  file, directory, glob or hub dataset whose rows hold a prompt/question/instruction, ShareGPT
  conversations, messages or MT-Bench turns.
- Turns: the first user turn is the prompt; `--turns all` answers every later user turn of a multi-turn source in
  turn, after the conversation so far with the target's own earlier replies (the source's are never kept), one row a
  conversation supervised on every reply; `--turns N` has the target write the user's follow-ups itself.
- Reply length: by default what the recipe's `data.max_length` leaves after the prompt (or the conversation so
  far), the length training keeps: a fixed `--max-new-tokens` shorter than a chat model's replies cuts them, and heads
  then never see how replies end. The share of replies cut at their limit is printed.
- `--exclude FILE` drops every prompt that appears in FILE (all its user turns), so benchmark prompts
  never leak into training.
- Engines: `--engine transformers` (default) decodes here, batched with left padding and continuous batching, prompts
  taken in `--order`; `--engine vllm` hands the same calls to vLLM in its own venv (`medusa_train.data.vllm_generate`),
  the fast way on a GPU.
- Resumable: rows are appended and flushed after every chunk; a rerun skips ids already written, and refuses to
  mix rows made with other settings.
- Distributed through Accelerate: each process takes every world_size-th prompt and appends to its own
  `FILE.rankN` part; the main process merges the parts into FILE at the end (and on any later rerun). With
  `--engine vllm` each process runs its own vLLM on its own GPUs (data parallel: an 8B target fits one GPU, and
  engines that share nothing scale with their number); `--tensor-parallel-size N` spreads one vLLM over N GPUs, for a
  target no one GPU holds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, Literal

from .batch_decode import decode
from .distilled import _append_rows, _ids_in, _part_path, _parts, _repair_tail, _rows, merge_parts, read_done
from .chat import render_prompt
from ..config import ConfigError, load_config
from ..target.model import pad_id, stop_ids
from ..base.errors import ArgumentParser
from .prompts import Prompt, exclude_prompts, load_prompts
from . import self_prompts
from .self_prompts import FollowUps

Order = Literal["file", "shortest", "longest"]
Turns = int | Literal["all"]
CHUNK = 4  # batches of prompts decoded together and written at once: slots refill within a chunk
MIN_REPLY = 16  # with replies as long as data.max_length leaves, a prompt (or conversation) leaving less is too long


# ---------------------------------------------------------------------------------------------------
# Generation


def render_prompts(tokenizer, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt as a single user turn through the chat template, with the assistant header appended."""
    return [render_prompt(tokenizer, p.text) for p in prompts]


def generate_replies(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int | Sequence[int],
                     temperature: float = 0.0, top_p: float = 1.0, batch_size: int | None = None,
                     seeds: list[int] | None = None, on_reply: Callable[[int], None] | None = None
                     ) -> list[tuple[str, str, int]]:
    """The target's reply to each prompt, `batch_size` in flight at once (`batch_decode.decode`: continuous
    batching; default all; vLLM schedules its own), at most `max_new_tokens` tokens (one limit, or one a prompt).
    Returns (reply text, finish, new tokens) per prompt, in order: the reply is cut at the first end-of-turn token
    (`finish="stop"`), else `finish="length"`. Greedy is the argmax at every step (what the engine verifies
    against); sampling draws prompt i from a generator seeded `seeds[i]` (default its index). `on_reply(tokens)`
    is called as each reply ends (progress)."""
    if temperature > 0 and seeds is None:
        seeds = list(range(len(prompt_ids)))
    limits = [max_new_tokens] * len(prompt_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    out: list[tuple[str, str, int]] = [("", "", 0)] * len(prompt_ids)
    for i, tokens, stopped in decode(model, prompt_ids, max_new_tokens=max(limits, default=1),
                                     stops=stop_ids(model, tokenizer), pad_id=pad_id(tokenizer),
                                     batch_size=batch_size or len(prompt_ids), temperature=temperature,
                                     top_p=top_p, seeds=seeds, limits=limits):
        out[i] = (tokenizer.decode(tokens, skip_special_tokens=True), "stop" if stopped else "length", len(tokens))
        if on_reply is not None:
            on_reply(len(tokens))
    return out


def _order(prompts: list[Prompt], lengths: list[int], order: Order) -> list[int]:
    idx = list(range(len(prompts)))
    if order == "shortest":
        idx.sort(key=lambda i: lengths[i])
    elif order == "longest":
        idx.sort(key=lambda i: -lengths[i])
    return idx


def distill(model, tokenizer, prompts: list[Prompt], out: str | os.PathLike, *, max_new_tokens: int | None = 256,
            max_length: int | None = None, temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 8,
            limit: int = 0, order: Order = "file", max_prompt_tokens: int = 1024, seed: int = 0, rank: int = 0,
            world_size: int = 1, progress: bool = True, row_extra: dict[str, Any] | None = None,
            turns: Turns = 1, follow_ups: FollowUps | None = None) -> dict[str, Any]:
    """Write the target's replies to `prompts` into `out` (JSONL), skipping ids already there.

    Prompts longer than `max_prompt_tokens` are skipped; `order` then `limit` pick which prompts form the
    job (so a rerun picks the same ones). With `world_size > 1` this process takes every world_size-th
    prompt of the job and appends to `out.rank{rank}`; call `merge_parts(out)` on one process afterwards.
    Returns counts: `job` (prompts in the job), `done_before`, `written` (by this process), `too_long`, `replies`
    and `cut` (replies written, and those that hit their limit), `new_tokens` (the replies' tokens).
    `row_extra` is recorded in every row written (self-written prompts say so).

    Reply length: `max_new_tokens` tokens, or with `max_new_tokens=None` as many as `max_length` (the recipe's
    data.max_length, where training cuts rows) leaves after the prompt or conversation so far; a prompt leaving fewer
    than MIN_REPLY is too long then.

    Turns: with `turns="all"` each prompt's later user turns (`Prompt.later`: a multi-turn source's) are answered
    in turn, after the conversation so far with the target's own earlier replies; with `turns > 1` the target
    writes the user's next turn itself (`follow_ups`: how it samples and filters them), up to `turns` user turns a
    row. Either way a conversation goes on only after a reply that ended (not one cut at its limit), while it fits
    `max_prompt_tokens` (and the reply room); a follow-up a filter drops ends it. The count of rows by their number
    of user turns is in `turns_written`.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if max_new_tokens is None and max_length is None:
        raise ValueError("distill: give max_new_tokens, or max_length for replies as long as it leaves")
    if turns != "all" and turns > 1 and follow_ups is None:
        follow_ups = FollowUps()
    settings = generation_settings(max_new_tokens, temperature, top_p, turns, follow_ups, max_length)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    def room(n: int) -> int:  # the reply's limit after n tokens of prompt
        return max_new_tokens if max_new_tokens is not None else max_length - n

    def fit(n: int) -> bool:
        return n <= max_prompt_tokens and (max_new_tokens is not None or room(n) >= MIN_REPLY)

    ids = render_prompts(tokenizer, prompts)
    fits = [i for i in range(len(prompts)) if fit(len(ids[i]))]
    too_long = len(prompts) - len(fits)
    kept = [prompts[i] for i in fits]
    kept_ids = [ids[i] for i in fits]
    job = _order(kept, [len(x) for x in kept_ids], order)
    if limit > 0:
        job = job[:limit]
    done, done_texts = read_done(out)

    def finished(i: int) -> bool:  # by id, or by text: the same prompt under another pool's id is not redone
        return kept[i].id in done or kept[i].text in done_texts

    # shard the job before dropping finished prompts, so every process sees the same split whenever it reads
    todo = [i for i in job[rank::world_size] if not finished(i)]
    target = out if world_size == 1 else _part_path(out, rank)
    _repair_tail(target)
    written = replies_written = cut = new_tokens = 0
    by_turns: dict[int, int] = {}
    bar = _Progress(len(todo), enabled=progress and rank == 0)
    gen = lambda ids, seeds: generate_replies(  # noqa: E731  (each reply's limit: what its prompt leaves)
        model, tokenizer, ids, [room(len(x)) for x in ids], temperature, top_p, batch_size, seeds, on_reply=bar.reply)
    chunk = batch_size * CHUNK
    for b in range(0, len(todo), chunk):
        batch = todo[b:b + chunk]
        seeds = [seed + hash_id(kept[i].id) for i in batch]  # a prompt's sample is the same wherever a run resumes
        bar.first_turn = True
        replies = gen([kept_ids[i] for i in batch], seeds)
        bar.first_turn = False
        convs = [[{"role": "user", "content": kept[i].text}, {"role": "assistant", "content": text}]
                 for i, (text, _, _) in zip(batch, replies)]
        ends = [finish for _, finish, _ in replies]
        later = [kept[i].later for i in batch] if turns == "all" else None
        n, c, tokens = _later_turns(gen, fit, convs, ends, seeds, later, turns, follow_ups, model, tokenizer,
                                    batch_size)
        replies_written, cut, new_tokens = replies_written + n, cut + c, new_tokens + tokens
        replies_written += len(batch)
        cut += sum(finish == "length" for _, finish, _ in replies)
        new_tokens += sum(n for _, _, n in replies)
        rows = [{"id": kept[i].id, "messages": conv, "finish": finish, "generation": settings, **(row_extra or {})}
                for i, conv, finish in zip(batch, convs, ends)]
        for conv in convs:
            by_turns[len(conv) // 2] = by_turns.get(len(conv) // 2, 0) + 1
        _append_rows(target, rows)  # a crash loses at most the chunk in flight
        written += len(rows)
        bar.rows = len(done) + written * world_size
    bar.close()
    return {"job": len(job), "done_before": len([i for i in job if finished(i)]), "written": written,
            "too_long": too_long, "turns_written": dict(sorted(by_turns.items())), "replies": replies_written,
            "cut": cut, "new_tokens": new_tokens}


def _later_turns(gen, fit, convs: list[list[dict]], ends: list[str], seeds: list[int], later: list[list[str]] | None,
                 turns: Turns, follow_ups: FollowUps | None, model, tokenizer, batch_size: int
                 ) -> tuple[int, int, int]:
    """The user's next turns and the target's replies to them, in place in `convs` and `ends`, for the conversations
    whose last reply ended: the source's turns (`later`, with turns="all") or ones the target writes. Returns
    (replies, of them cut at their limit, new tokens)."""
    replies = cut = new_tokens = 0
    most = max(len(x) for x in later) + 1 if later is not None else turns
    for t in range(1, most):  # the user's next turn (the source's, or the target writes it), then the reply
        live = [k for k in range(len(convs)) if ends[k] == "stop" and len(convs[k]) == 2 * t]
        if later is not None:
            asks = [later[k][t - 1] if len(later[k]) >= t else None for k in live]
        else:
            asks = follow_ups.write(model, tokenizer, [convs[k] for k in live], [seeds[k] + t for k in live],
                                    batch_size)
        go = [(k, q, render_prompt(tokenizer, convs[k] + [{"role": "user", "content": q}]))
              for k, q in zip(live, asks) if q is not None]
        go = [g for g in go if fit(len(g[2]))]
        if not go:
            break
        more = gen([g[2] for g in go], [seeds[k] + t for k, _, _ in go])
        for (k, q, _), (text, finish, n) in zip(go, more):
            convs[k] += [{"role": "user", "content": q}, {"role": "assistant", "content": text}]
            ends[k] = finish
            cut += finish == "length"
            new_tokens += n
        replies += len(go)
    return replies, cut, new_tokens


class _Progress:
    """distill's bar: a prompt advances it when its first reply ends (not when its chunk is written), and it says
    the new tokens a second and the rows in the file."""

    def __init__(self, total: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="distill", unit="prompt", disable=not enabled, dynamic_ncols=True)
        self.first_turn, self.rows, self.tokens, self.start = False, 0, 0, time.perf_counter()

    def reply(self, tokens: int) -> None:
        self.tokens += tokens
        self._postfix()
        self.bar.update(1 if self.first_turn else 0)

    def _postfix(self) -> None:
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix({"tokens/s": f"{rate:.1f}", "rows": self.rows}, refresh=False)

    def close(self) -> None:
        self._postfix()
        self.bar.close()


def generation_settings(max_new_tokens: int | None, temperature: float, top_p: float, turns: Turns = 1,
                        follow_ups: FollowUps | None = None, max_length: int | None = None) -> dict[str, Any]:
    """What each row records of how its reply was made: a rerun with other settings must not mix its rows in.
    Replies as long as the recipe leaves record `max_new_tokens: null` and the `max_length` they filled."""
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    if max_new_tokens is None:
        out["max_length"] = max_length
    if turns == "all":
        out["turns"] = "all"
    elif turns > 1:  # single-turn rows keep the keys they always had
        out |= {"turns": turns, "follow_ups": (follow_ups or FollowUps()).settings()}
    return out


def check_same_settings(out: Path, settings: dict[str, Any]) -> None:
    """ConfigError (before any model loads) when `out` or its parts hold rows made with other settings: one file
    of replies cut at 64 and 256 tokens, or greedy and sampled, would train heads on a mix nobody asked for. Rows
    of files written before rows recorded their settings are taken as they are."""
    flags = {"max_new_tokens": "--max-new-tokens", "max_length": "data.max_length (replies fill it)",
             "temperature": "--temperature", "top_p": "--top-p", "turns": "--turns",
             "follow_ups": "the follow-ups' --self-* settings"}
    for f in [out, *_parts(out)]:
        for row in _rows(f):
            had = row.get("generation")
            if not isinstance(had, dict):
                continue
            had = {"turns": 1, "follow_ups": None} | had  # one turn: rows record no follow-up keys
            mine = {"turns": 1, "follow_ups": None} | settings
            if any(had.get(k) != mine.get(k) for k in flags):
                def say(k: str, v: Any) -> str:
                    return "unset" if v is None and k in ("max_new_tokens", "max_length") else str(v)

                diff = ", ".join(f"{flags[k]} {say(k, had.get(k))} (this run: {say(k, mine.get(k))})" for k in flags
                                 if had.get(k) != mine.get(k))
                raise ConfigError(f"--out {out} holds rows made with {diff}: rerun with the same settings to "
                                  "continue it, or write to another --out")


def hash_id(text: str) -> int:
    """A stable (process-independent) small hash of an id, for seeding."""
    h = 0
    for ch in text:
        h = (h * 131 + ord(ch)) % 1_000_003
    return h


# ---------------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m medusa_train.data.distill",
                                description="Write the target's own replies to a prompt pool as chat JSONL.")
    p.add_argument("recipe", help="recipe YAML; only its target section is used")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. target.model=/path/to/model")
    p.add_argument("--prompts", required=True, help="`self` (the target writes them; with --limit N), `default` "
                                                    "(offline pool) or a json/jsonl/parquet file, directory, glob "
                                                    "or hub dataset with prompts")
    p.add_argument("--out", required=True, help="output JSONL (appended to; a rerun skips finished ids)")
    p.add_argument("--exclude", action="append", default=[], help="drop prompts found in this file "
                                                                   "(repeatable), e.g. the benchmark's")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="a reply's limit; default: what the recipe's data.max_length leaves after the prompt (or the "
                        "conversation so far), so no reply is cut before training would cut its row")
    p.add_argument("--batch-size", type=int, default=32,
                   help="prompts in flight at once, per process (continuous batching: one that ends frees its slot; "
                        "docs/history.md gives rows a minute by batch size)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (after --order); 0: all")
    p.add_argument("--order", choices=["file", "shortest", "longest"], default="file")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", type=_turns, default=1,
                   help="`all`: answer every user turn of a multi-turn source (ShareGPT, messages, MT-Bench turns) "
                        "in turn, after the conversation so far with the target's own earlier replies; N: user turns "
                        "a conversation, the target writing the user's next request itself after the first (sampled "
                        "with the --self-* settings, filtered like self-written requests); default 1")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="who generates: our batched decoding over transformers (default), or vLLM in its own venv "
                        "(--vllm-python), the fast way on a GPU")
    p.add_argument("--vllm-python", help="--engine vllm: the Python of a venv holding vLLM "
                                         "(scripts/vllm_cpu_venv.sh makes one on a CPU)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="--engine vllm: GPUs one vLLM spreads the target over (a process of a multi-process run "
                        "takes its own GPUs)")
    own = p.add_argument_group("--prompts self and --turns: the target writes requests "
                               "(medusa_train.data.self_prompts)")
    own.add_argument("--self-temperature", type=float, default=1.0, help="sampling temperature of the requests")
    own.add_argument("--self-top-p", type=float, default=0.95)
    own.add_argument("--self-max-tokens", type=int, default=96, help="a request not closed by then is dropped")
    own.add_argument("--latin-only", action="store_true", help="drop requests mostly outside the Latin alphabet")
    return p


def _turns(text: str) -> Turns:
    if text == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--turns takes a number or `all`, got {text!r}") from None


def _check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.limit < 0:
        raise ConfigError(f"--limit must be >= 0 (0: all), got {args.limit}")
    for f in args.exclude:
        if not Path(f).exists():
            raise ConfigError(f"--exclude: file not found: {f}")
    if args.turns != "all" and args.turns < 1:
        raise ConfigError(f"--turns must be >= 1 or all (got {args.turns})")
    if args.turns == "all" and args.prompts == "self":
        raise ConfigError("--turns all answers a multi-turn source's later user turns; --prompts self writes single "
                          "requests: use --turns N to have the target write the follow-ups too")
    if args.engine == "vllm":
        if not args.vllm_python or not Path(args.vllm_python).is_file():
            raise ConfigError(f"--engine vllm needs --vllm-python: the Python of a venv holding vLLM (got "
                              f"{args.vllm_python}; scripts/vllm_cpu_venv.sh makes one on a CPU)")
        if args.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.prompts == "self" or (args.turns != "all" and args.turns > 1):
        if args.self_temperature <= 0 or not 0 < args.self_top_p <= 1 or args.self_max_tokens < 1:
            raise ConfigError("--self-temperature must be > 0, --self-top-p in (0, 1], --self-max-tokens >= 1")
    if args.prompts == "self":
        if args.limit < 1:
            raise ConfigError("--prompts self needs --limit N: how many requests the target samples (then filtered)")
        return
    if args.prompts != "default" and not Path(args.prompts).exists() and (
            args.prompts.endswith((".json", ".jsonl", ".parquet")) or os.sep in args.prompts):
        raise ConfigError(f"--prompts: file not found: {args.prompts} (or use --prompts default)")


def requests_file(out: Path) -> Path:
    return out.with_name(out.name + ".requests")


def request_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What fixes the self-written requests: a cache drawn with other settings must not be mixed in."""
    return {"seed": args.seed, "temperature": args.self_temperature, "top_p": args.self_top_p,
            "max_tokens": args.self_max_tokens, "sampler": "per-request"}


def read_requests(cache: Path, settings: dict[str, Any]) -> dict[int, tuple[str, bool]]:
    """The requests drawn before, by index; ConfigError (before any model loads) if drawn with other settings."""
    have: dict[int, tuple[str, bool]] = {}
    for row in _rows(cache):
        if row.get("settings") != settings:
            raise ConfigError(f"{cache} holds requests drawn with {row.get('settings')} (this run: {settings}): "
                              "rerun with the same --seed and --self-* settings, or write to another --out")
        have[int(row["id"])] = (row["text"], bool(row["finished"]))
    return have


def self_written(model, tokenizer, args: argparse.Namespace, say, out: Path, rank: int = 0, world_size: int = 1,
                 wait: Callable[[], None] = lambda: None) -> list[Prompt]:
    """`--limit` requests sampled by the target from its user-turn prefix, filtered, `--exclude` files' prompts
    removed; ids `self-SEED-I` (I: the sample's index). Samples are kept in `OUT.requests`, so a rerun draws only those
    it lacks; each request has a generator of its own (the seed and its index), so whoever draws it draws the same.
    Under several processes each draws every `world_size`-th missing request into its own part
    (`OUT.requests.rankN`), the main process merges the parts in (`wait` is the processes' barrier), and every process
    then reads them all: no request is drawn twice."""
    cache, settings = requests_file(out), request_settings(args)
    if rank == 0:
        if _parts(cache):  # a crashed multi-process run: its parts first
            merge_parts(cache)
        _repair_tail(cache)
    wait()
    have = read_requests(cache, settings)
    missing = [i for i in range(args.limit) if i not in have]
    mine = missing[rank::world_size]
    part = cache if world_size == 1 else cache.with_name(f"{cache.name}.rank{rank}")
    if mine:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(mine), desc="requests" + (" (this process)" if world_size > 1 else ""), unit="request",
                   disable=rank != 0, dynamic_ncols=True)
        ended: list[dict[str, Any]] = []

        def keep(i: int, text: str, finished: bool) -> None:  # on disk as they come: a stop loses a few
            ended.append({"id": i, "text": text, "finished": finished, "settings": settings})
            if len(ended) >= args.batch_size:
                _append_rows(part, ended)
                bar.update(len(ended))
                ended.clear()

        have.update(self_prompts.sample_user_turns(model, tokenizer, mine, temperature=args.self_temperature,
                                                   top_p=args.self_top_p, max_new_tokens=args.self_max_tokens,
                                                   batch_size=args.batch_size, seed=args.seed, on_sample=keep))
        _append_rows(part, ended)
        bar.update(len(ended))
        bar.close()
    if world_size > 1:
        wait()
        if rank == 0:
            merge_parts(cache)
        wait()
        have = read_requests(cache, settings)
    samples = [have[i] for i in range(args.limit)]
    verdict = self_prompts.filter_prompts(samples, latin_only=args.latin_only)
    prompts = [Prompt(f"self-{args.seed}-{i}", samples[i][0]) for i in verdict.kept]
    kept = len(prompts)
    if args.exclude:
        prompts = exclude_prompts(prompts, args.exclude)
    verdict.dropped["excluded"] = kept - len(prompts)
    dropped = ", ".join(f"{n} {reason}" for reason, n in verdict.dropped.items() if n)
    say(f"[distill] the target wrote {len(samples)} requests ({args.limit - len(missing)} read back from "
        f"{cache.name}); {len(prompts)} kept ({dropped or 'none dropped'})")
    return prompts


def load_engine(cfg, args: argparse.Namespace, accelerator):
    """(model, tokenizer): the target loaded here (`--engine transformers`), or vLLM started in its own venv
    (`VllmTarget`), one a process: a process of a multi-process run takes its own GPUs (data parallel: an 8B
    target fits one, and engines that share nothing scale with their number), each vLLM spreading the target over
    `--tensor-parallel-size` of them (for a target no one GPU holds)."""
    from ..target.model import load_target, load_tokenizer

    if args.engine == "transformers":
        return load_target(cfg.target, device=accelerator.device)
    from .vllm_generate import start_for

    longest = cfg.data.max_length if args.max_new_tokens is None else args.max_prompt_tokens + args.max_new_tokens
    return start_for(cfg.target, args.vllm_python, longest=longest, tensor_parallel_size=args.tensor_parallel_size,
                     max_num_seqs=args.batch_size, seed=args.seed, processes=accelerator.num_processes,
                     local_rank=accelerator.local_process_index), load_tokenizer(cfg.target)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; exit code 2 on bad input, before any model is loaded; 75 when Ctrl-C or SIGTERM stopped it
    (what was written stays: rerun to continue)."""
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        # Only the target matters here; the recipe's data.dataset is usually the file we are about to write.
        cfg = load_config(args.recipe, list(args.overrides) + ["data.dataset=distill-prompts"])
        follow_ups = FollowUps(args.self_temperature, args.self_top_p, args.self_max_tokens,
                               latin_only=args.latin_only)
        check_same_settings(Path(args.out), generation_settings(args.max_new_tokens, args.temperature, args.top_p,
                                                                args.turns, follow_ups, cfg.data.max_length))
        own = args.prompts == "self"
        if args.engine == "vllm" and (cfg.target.adapter or cfg.target.gguf_file):
            raise ConfigError("--engine vllm serves a model directory or hub name: merge target.adapter into the "
                              "model, or convert target.gguf_file (python -m medusa_train.target.prepare), first")
        if own or args.turns != "all" and args.turns > 1:  # the template's user turn is checked before loading
            from ..target.model import load_tokenizer

            self_prompts.user_turn_prefix(load_tokenizer(cfg.target))
        if own:
            read_requests(requests_file(Path(args.out)), request_settings(args))
            prompts = []
        else:
            prompts = load_prompts(args.prompts)
        n_pool = len(prompts)
        if args.exclude and not own:
            prompts = exclude_prompts(prompts, args.exclude)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from accelerate import Accelerator

    accelerator = Accelerator()
    say = accelerator.print
    pool = (f"{args.limit} requests the target writes itself" if own
            else f"{len(prompts)} prompts from {args.prompts} ({n_pool - len(prompts)} excluded)")
    say(f"[distill] {pool}; target {cfg.target.model}; {accelerator.num_processes} process(es); "
        f"engine {args.engine}")
    out = Path(args.out)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop, like Ctrl-C
    model, stopped = None, False
    try:
        model, tokenizer = load_engine(cfg, args, accelerator)
        if own:
            prompts = self_written(model, tokenizer, args, say, out, accelerator.process_index,
                                   accelerator.num_processes, accelerator.wait_for_everyone)
        if accelerator.is_main_process and _parts(out):
            merge_parts(out)  # a crashed multi-process run: fold its parts in before counting what is done
        accelerator.wait_for_everyone()
        before = len(_ids_in(out))
        counts = distill(model, tokenizer, prompts, out, max_new_tokens=args.max_new_tokens,
                         max_length=cfg.data.max_length, temperature=args.temperature, top_p=args.top_p,
                         batch_size=args.batch_size, limit=0 if own else args.limit,
                         order=args.order, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
                         rank=accelerator.process_index, world_size=accelerator.num_processes,
                         progress=accelerator.is_main_process, row_extra={"prompt_source": "self"} if own else None,
                         turns=args.turns, follow_ups=follow_ups)
    except KeyboardInterrupt:  # every finished batch is on disk (fsynced): say so, no traceback
        stopped = True
        if accelerator.is_main_process:
            print(f"\n[distill] stopped: {out} and its parts hold {len(read_done(out)[0])} rows; rerun the same "
                  "command to continue", file=sys.stderr, flush=True)
        return 75
    finally:
        signal.signal(signal.SIGTERM, previous)
        if hasattr(model, "close"):
            model.close(now=stopped)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if accelerator.num_processes > 1:
            merge_parts(out)
        total = len(_ids_in(out))
        room = (f"or leaving under {MIN_REPLY} of data.max_length {cfg.data.max_length} "
                if args.max_new_tokens is None else "")
        say(f"[distill] wrote {total - before} rows ({counts['done_before']} of the job were done before; "
            f"{counts['too_long']} prompts over {args.max_prompt_tokens} tokens {room}skipped); {out} holds {total} "
            "rows")
        limit = (f"--max-new-tokens {args.max_new_tokens}" if args.max_new_tokens is not None
                 else f"what data.max_length {cfg.data.max_length} leaves")
        share = counts["cut"] / max(1, counts["replies"])
        say(f"[distill] replies cut at their limit ({limit}): {counts['cut']} of {counts['replies']} "
            f"({share:.0%}, this process)" + (": heads never see how those replies end; raise the limit"
                                              if share > 0.1 else ""))
        if args.turns == "all" or args.turns > 1:
            dropped = ", ".join(f"{n} {why}" for why, n in follow_ups.dropped.items()) or "none"
            say(f"[distill] rows written by user turns: {counts['turns_written']}" + (
                f"; follow-ups dropped: {dropped}" if args.turns != "all" else "") + " (this process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
