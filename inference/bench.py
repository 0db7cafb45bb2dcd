"""Side-by-side benchmark: plain decoding, transformers' prompt lookup, and our engine with n-gram, bigram and
trained heads of any kind, on the same prompts, greedy, with a fixed `max_new_tokens`.

    python -m inference.bench --heads runs/demo/heads-chained runs/demo/heads-parallel \\
        --prompts question.jsonl --max-new-tokens 128 --out results.json --plot bench.png

Methods (every speedup is over `ar`, measured in the same run):
- `ar`: the target's plain `generate(do_sample=False)`;
- `pld`: `generate(prompt_lookup_num_tokens=...)`, what transformers gives for free;
- `ngram`, `bigram`: draft-free drafters in our engine (`NGramDrafter`, `BigramDrafter`);
- `chained`, `parallel`, `eagle3`, `dflash` (each kind's name): the trained heads of that kind among `--heads` (one
  directory a kind) in our engine;
- `chained+ngram`, ... (a kind's name and `+ngram`): those heads' tree with the n-gram lookup's continuation grafted
  on (`HybridDrafter`; the lookup takes up to `--lookup-nodes` of each step's budget).

Methods run interleaved per prompt (the order rotates from prompt to prompt) after a warm-up, `--repeats`
times, so machine drift hits all alike. Per method: tokens/s (all new tokens over all seconds), tau (new
tokens per target forward, summed over prompts; plain decoding is 1.0), speedup (tokens/s over `ar`'s),
and `exact_match`: whether every output equals `ar`'s token for token (it is reported, never assumed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from inference.generate import parse_tree_budget
from medusa_train.base.errors import ArgumentParser
from medusa_train.kinds import KINDS

PLAIN_METHODS = ("ar", "ar-compiled", "pld", "ngram", "bigram")
ALL_METHODS = PLAIN_METHODS + tuple(m for kind in KINDS for m in (kind, f"{kind}+ngram"))
"""Every method, in the order the table lists them: the draft-free ones, then each kind's heads, alone and with the
n-gram lookup grafted on."""


class BenchError(ValueError):
    """Bad benchmark input; the message names the option and the fix."""


@dataclass
class RunResult:
    tokens: list[int]  # the new tokens (EOS included when generation stopped on it)
    forwards: int  # target forwards, prefill included
    seconds: float


@dataclass
class MethodTotals:
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    mismatches: list[int] = field(default_factory=list)  # prompt indices whose output differs from ar's


Runner = Callable[[torch.Tensor, int], RunResult]  # (input_ids [1, T], max_new_tokens) -> result


# ---------------------------------------------------------------------------------------------------
# Prompts


def load_bench_prompts(source: str, limit: int = 0, stride: int = 1, turn: int = 1) -> list[str | list[dict]]:
    """First user turns (MT-Bench `turns`, `prompt`/`question`/`instruction`, a conversation's first user
    message), each distinct text once, from whatever the trainer reads (a JSON/JSONL/parquet file, a directory,
    a hub name) or `default`: the held-out split of the offline default pool (topics and tasks the default
    training split never uses). `stride` keeps every stride-th prompt (MT-Bench is ordered by category, so
    stride 2 keeps 5 of each category's 10), then `limit` the first N of those. `turn` > 1: each conversation up to
    its user turn `turn` (a list of messages), from rows that hold the replies before it (`distill --turns all`)."""
    if turn > 1:
        return _later_turns(source, turn)[::stride][:limit or None]
    if source == "default":
        from medusa_train.data.prompts import default_prompts

        texts = [t for _, t in default_prompts("heldout")]
    else:
        from medusa_train.config import ConfigError
        from medusa_train.data.prompts import load_prompts

        try:
            texts = [p.text for p in load_prompts(source)]
        except ConfigError as e:  # the data loader's own message, about our flag
            raise BenchError(str(e).replace("data.dataset", "--prompts")) from None
    texts = texts[::stride]
    return texts[:limit] if limit > 0 else texts


def _later_turns(source: str, turn: int) -> list[list[dict]]:
    from medusa_train.data.formats import rows_to_messages
    from medusa_train.data.prompts import _load_rows

    out = []
    for row in _load_rows(source):
        try:
            msgs = [m for m in rows_to_messages(row) or [] if m["role"] in ("user", "assistant")]
        except ValueError:
            continue
        if len(msgs) >= 2 * turn - 1 and [m["role"] for m in msgs[:2 * turn - 1]] == ["user", "assistant"] * (
                turn - 1) + ["user"]:
            out.append(msgs[:2 * turn - 1])
    if not out:
        raise BenchError(f"--turn {turn}: no row of {source} holds {turn} user turns with the replies between them; "
                         f"write the target's own replies first: python -m medusa_train.data.distill RECIPE --prompts "
                         f"{source} --turns all --out FILE, then --prompts FILE")
    return out


def describe_prompts(source: str, n: int, stride: int = 1, turn: int = 1) -> str:
    """What the benchmark ran on, in words, for the table, the JSON and the plot's title."""
    every = f", every {stride}th" if stride > 1 else ""
    if turn > 1:
        every += f", user turn {turn} after the replies before it"
    if source == "default":
        return f"{n} held-out prompts of the offline default pool{every} (medusa_train/data/prompts.py)"
    return f"{n} prompts of {Path(source).name}{every}"


def render(tokenizer, text: str | list[dict]) -> torch.Tensor:
    """The prompt as one user turn (or the conversation ending with one) through the chat template, with the
    assistant header (raw text if the tokenizer has none): [1, T]."""
    from medusa_train.data.chat import render_prompt

    ids = render_prompt(tokenizer, text) if getattr(tokenizer, "chat_template", None) else tokenizer(text)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


def prompts_that_fit(prompts: Sequence[torch.Tensor], limit: int | None, max_new_tokens: int, depth: int,
                     log: Callable[[str], None]) -> list[int]:
    """Indices of the prompts that fit the target's context with `max_new_tokens` and a tree `depth` deep; says how
    many do not (a long ShareGPT prompt on a 2k-context model is skipped, not a crash halfway through a run)."""
    if limit is None:
        return list(range(len(prompts)))
    kept = [i for i, p in enumerate(prompts) if p.shape[-1] + max_new_tokens + depth <= limit]
    if len(kept) < len(prompts):
        log(f"[bench] skipped {len(prompts) - len(kept)} of {len(prompts)} prompts: with {max_new_tokens} new tokens "
            f"they do not fit the target's context of {limit} tokens")
    return kept


def bigram_texts(path: str) -> list[str]:
    """Texts to count bigrams on: the assistant replies of chat rows, else a `text` or answer field (the
    trainer's `ANSWER_KEYS`), from whatever the trainer reads (a JSONL file, a directory of them, a hub name)."""
    from medusa_train.config import DataConfig
    from medusa_train.data.rows import load_raw
    from medusa_train.base.errors import DataError
    from medusa_train.data.formats import ANSWER_KEYS, rows_to_messages

    out = []
    for row in load_raw(DataConfig(dataset=path)):
        try:
            msgs = rows_to_messages(row) or []
        except DataError:
            msgs = []
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        if not replies:
            replies = [row[k] for k in ("text", *ANSWER_KEYS) if isinstance(row.get(k), str)]
        out += replies
    return out


# ---------------------------------------------------------------------------------------------------
# Runners


def hf_runner(model: nn.Module, pad_token_id: int | None, prompt_lookup_num_tokens: int | None = None,
              compiled: bool = False) -> Runner:
    """`model.generate` greedy (with prompt lookup when asked). Target forwards are counted with a hook.
    `compiled`: transformers' fastest plain decoding, a static cache with the forward compiled (CUDA graphs on
    CUDA; the first calls compile)."""
    extra: dict[str, Any] = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}
    if compiled:
        from transformers.generation.configuration_utils import CompileConfig

        config = CompileConfig()
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        extra |= {"cache_implementation": "static", "compile_config": config}

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> RunResult:
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            ids = input_ids.to(model.device)
            _sync(model.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, temperature=None, top_p=None, top_k=None,
                                     pad_token_id=pad_token_id, **extra)
            _sync(model.device)
            seconds = time.perf_counter() - t0
        finally:
            hook.remove()
        return RunResult(out[0, ids.shape[1]:].tolist(), calls[0], seconds)

    return run


def engine_runner(generator, tree: str = "static", tree_budget: str | int = "auto",
                  counts: dict[str, int] | None = None) -> Runner:
    """Our engine, greedy, with the given tree settings. Forwards come from the engine's own stats; `counts`
    (if given) accumulates its steps and verified tree nodes."""

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> RunResult:
        if tree_budget == "auto":  # timings the generator takes (first call, or again after drift): not timed here
            generator.step_budget(tree, tree_budget)
        _sync(generator.device)
        t0 = time.perf_counter()
        out = generator.generate(input_ids, max_new_tokens=max_new_tokens, temperature=0.0, tree=tree,
                                 tree_budget=tree_budget)
        _sync(generator.device)
        seconds = time.perf_counter() - t0
        if counts is not None:
            counts["steps"] = counts.get("steps", 0) + out.stats.steps
            counts["nodes"] = counts.get("nodes", 0) + out.stats.verified_nodes
        return RunResult(out.token_ids.tolist(), out.stats.target_forwards, seconds)

    return run


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------
# The benchmark


def run_benchmark(runners: dict[str, Runner], prompts: Sequence[torch.Tensor], max_new_tokens: int,
                  repeats: int = 1, warmup: int = 1, log: Callable[[str], None] | None = None,
                  replies: list[list[int]] | None = None) -> dict[str, dict[str, float | bool]]:
    """Run every method on every prompt, interleaved, and summarise.

    `runners` must include `ar` (the reference). Warm-up: each method generates `warmup` times on the
    first prompt (not counted). Then, per prompt, `repeats` rounds of all methods in an order rotated by
    the prompt's index. Returns {method: {tokens_per_s, tau, speedup, exact_match}}; `replies`, when given,
    receives `ar`'s reply (new token ids) to every prompt.
    """
    if "ar" not in runners:
        raise BenchError("the benchmark needs the `ar` method: every speedup is divided by it")
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name](prompts[0], min(max_new_tokens, 16))
    totals = {name: MethodTotals() for name in names}
    for i, ids in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        outputs: dict[str, list[list[int]]] = {name: [] for name in names}
        for _ in range(repeats):
            for name in order:
                res = runners[name](ids, max_new_tokens)
                t = totals[name]
                t.tokens += len(res.tokens)
                t.forwards += res.forwards
                t.seconds += res.seconds
                outputs[name].append(res.tokens)
        reference = outputs["ar"][0]
        if replies is not None:
            replies.append(reference)
        for name in names:
            differing = [out for out in outputs[name] if out != reference]
            if differing:
                totals[name].mismatches.append(i)
                if log is not None:
                    out = differing[0]
                    first = next((j for j, (a, b) in enumerate(zip(out, reference)) if a != b),
                                 min(len(out), len(reference)))
                    log(f"[bench] prompt {i + 1}: {name} differs from ar at new token {first} "
                        f"({len(out)} vs {len(reference)} tokens)")
        if log is not None:
            rates = "  ".join(f"{n} {totals[n].tokens / max(totals[n].seconds, 1e-9):.1f}" for n in names)
            log(f"[bench] prompt {i + 1}/{len(prompts)}: {len(reference)} tokens; cumulative tok/s: {rates}")
    ar_rate = totals["ar"].tokens / max(totals["ar"].seconds, 1e-9)
    summary = {}
    for name in names:
        t = totals[name]
        rate = t.tokens / max(t.seconds, 1e-9)
        summary[name] = {"tokens_per_s": round(rate, 3), "tau": round(t.tokens / max(t.forwards, 1), 3),
                         "speedup": round(rate / ar_rate, 3), "exact_match": not t.mismatches}
    return summary


def machine_description(device: torch.device | str) -> str:
    """OS, CPU model and core count (or the GPU), and the torch / transformers versions."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.device(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu}, {os.cpu_count()} CPU cores"
    return (f"{platform.system()} {platform.machine()}, {where}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def format_table(summary: dict[str, dict[str, float | bool]]) -> str:
    w = max([len("method")] + [len(name) for name in summary]) + 2
    lines = [f"{'method':<{w}}{'tokens/s':>10}{'tau':>8}{'speedup':>10}  exact_match"]
    for name, m in summary.items():
        lines.append(f"{name:<{w}}{m['tokens_per_s']:>10.1f}{m['tau']:>8.2f}{m['speedup']:>9.2f}x  "
                     f"{'yes' if m['exact_match'] else 'NO'}")
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, float | bool]], path: str, title: str = "") -> None:
    """Two bar charts: tau and speedup over `ar` per method (mismatching methods hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in ((axes[0], "tau", "tau (tokens per target forward)"),
                           (axes[1], "speedup", "speedup over ar (wall clock)")):
        vals = [float(summary[n][key]) for n in names]
        bars = ax.bar(names, vals, color=["#888888" if n in ("ar", "pld") else "#3b75af" for n in names],
                      hatch=None)
        for bar, n, v in zip(bars, names, vals):
            if not summary[n]["exact_match"]:
                bar.set_hatch("//")
            ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
        ax.set_title(label, fontsize=10)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# CLI


def load_replies(path: str, prompts: int) -> list[list[int]]:
    """The replies another run wrote with `--replies`, one per prompt; BenchError unless there are `prompts`."""
    try:
        other = [json.loads(line)["tokens"] for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"--replies-against {path} cannot be read ({e}): give a file bench --replies wrote") from None
    if len(other) != prompts:
        raise BenchError(f"--replies-against {path} holds {len(other)} replies, this run has {prompts} prompts: use "
                         "the same --prompts, --limit and --stride as the run that wrote it")
    return other


def compare_replies(replies: list[list[int]], other: list[list[int]], path: str) -> dict[str, Any]:
    """How many of `replies` equal, token for token, `other` (another run's `--replies` from `path`, same prompts),
    and where the others first differ (median new-token index): how far an adapted target moved."""
    firsts = sorted(next((j for j, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
                    for r, o in zip(replies, other) if r != o)
    return {"against": str(path), "prompts": len(replies), "identical": len(replies) - len(firsts),
            "median_first_difference": firsts[len(firsts) // 2] if firsts else None}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m inference.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model directory or name (default: the one the heads "
                                                   "name)")
    p.add_argument("--heads", nargs="+", action="extend", default=[], metavar="DIR",
                   help="trained heads directories, one a kind: each gives the methods named by its kind (`chained`, "
                        "`chained+ngram`, `parallel`, ...)")
    p.add_argument("--prompts", default="default", help="JSONL/JSON with `prompt` or MT-Bench `turns` (first "
                                                        "turn), or `default` (the offline pool's held-out split)")
    p.add_argument("--limit", type=int, default=0, help="use the first N prompts (0: all), after --stride")
    p.add_argument("--stride", type=int, default=1,
                   help="keep every stride-th prompt (MT-Bench: 2 keeps 5 per category)")
    p.add_argument("--turn", type=int, default=1,
                   help="benchmark the reply to user turn K, after the conversation before it (rows holding the "
                        "target's earlier replies: `distill --prompts question.jsonl --turns all`)")
    p.add_argument("--methods", default=None, help=f"comma list from {','.join(ALL_METHODS)} (default: every "
                                                   "method whose inputs were given)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="warm-up generations per method (not counted)")
    p.add_argument("--tree", choices=("static", "dynamic"), default="static")
    p.add_argument("--compile", action="store_true",
                   help="engine methods verify through a static cache with the forward compiled per tree size "
                        "(CUDA graphs on CUDA); compare with `ar-compiled`, transformers' compiled plain decoding")
    p.add_argument("--tree-budget", default="auto", help="draft nodes per step for engine methods, or `auto`")
    p.add_argument("--lookup-nodes", type=int, default=4, help="`chained+ngram`: draft nodes per step the n-gram "
                                                               "lookup may take from the budget")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for `pld`")
    p.add_argument("--bigram-data", default=None, help="JSONL whose assistant replies (or text) build the bigram "
                                                       "table (default: the data the --heads were trained on)")
    p.add_argument("--bigram-top-k", type=int, default=4)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="the target's dtype for every method (auto: bfloat16 on a GPU that supports it, else float32)")
    p.add_argument("--cpu-linear", default="onednn", choices=("onednn", "onednn-unpacked", "default"),
                   help="float32 CPU targets: run every method's linear layers through oneDNN with pre-packed "
                        "weights (faster at every row count; inference/engine/kernels.py), oneDNN on the weights as "
                        "stored, or PyTorch's default MKL path")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument("--replies", default=None, help="write `ar`'s greedy reply to every prompt here (JSONL of token "
                   "ids), e.g. the original target's, for --replies-against")
    p.add_argument("--replies-against", default=None, help="count how many of `ar`'s replies equal those in this "
                   "--replies file (the same prompts on another target, e.g. before joint training)")
    p.add_argument("--plot", default=None, help="draw tau and speedup per method into this PNG")
    return p


def _heads_training_data(heads_dir: str | None) -> str | None:
    """data.dataset from the heads' saved recipe, if it is a local JSONL file or a directory of them."""
    if not heads_dir or not (Path(heads_dir) / "recipe.yaml").is_file():
        return None
    import yaml

    data = (yaml.safe_load((Path(heads_dir) / "recipe.yaml").read_text()) or {}).get("data") or {}
    path = str(data.get("dataset") or "")
    if path.endswith(".jsonl") and Path(path).is_file():
        return path
    return path if path and Path(path).is_dir() and any(Path(path).glob("*.jsonl")) else None


def heads_by_kind(dirs: Sequence[str]) -> dict[str, str]:
    """kind -> its heads directory, from each directory's config.json (BenchError: one missing, or two of a kind)."""
    from medusa_train.kinds import load_spec

    found: dict[str, str] = {}
    for d in dirs:
        if not Path(d).exists():
            raise BenchError(f"--heads: not found: {d}")
        try:
            kind = load_spec(d).kind
        except (FileNotFoundError, ValueError) as e:
            raise BenchError(f"--heads: {e}") from None
        if kind in found:
            raise BenchError(f"--heads: {found[kind]} and {d} both hold {kind} heads: bench them in separate runs")
        found[kind] = d
    return found


def resolve_methods(args: argparse.Namespace) -> list[str]:
    """The methods to run, checked against the inputs given (errors name the missing option); sets `args.heads_dirs`
    (method's kind -> its heads directory) and fills `args.bigram_data` and `args.target` from the heads when unset."""
    args.heads_dirs = heads_by_kind(args.heads)
    if args.bigram_data is None:
        args.bigram_data = next(filter(None, map(_heads_training_data, args.heads)), None)
    if args.methods is None:
        given = {"ar", "pld", "ngram"} | ({"ar-compiled"} if args.compile else set()) \
            | ({"bigram"} if args.bigram_data else set()) | {m for k in args.heads_dirs for m in (k, f"{k}+ngram")}
        methods = [m for m in ALL_METHODS if m in given]
    else:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in ALL_METHODS]
        if unknown:
            raise BenchError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(ALL_METHODS)}")
        if "ar" not in methods:
            methods.insert(0, "ar")  # the reference for speedup and exact_match
    for m in methods:
        if m == "bigram" and not args.bigram_data:
            raise BenchError("method bigram needs --bigram-data")
        if m == "bigram" and not Path(args.bigram_data).exists():
            raise BenchError(f"--bigram-data: not found: {args.bigram_data}")
        if m not in PLAIN_METHODS and m.removesuffix("+ngram") not in args.heads_dirs:
            raise BenchError(f"method {m} needs --heads with {m.removesuffix('+ngram')} heads")
    if args.target is None:
        from medusa_train.kinds import load_spec

        args.target = next((load_spec(d).target_name for d in args.heads if load_spec(d).target_name), None)
        if args.target is None:
            raise BenchError("--target is required (no heads directory names its target)")
    return methods


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[str], list[list[int]] | None, str | int]:
    """Everything that can be refused before a model loads: (methods, prompt texts, the --replies-against replies,
    the tree budget). BenchError / ValueError naming the option."""
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--repeats", args.repeats, 1),
                             ("--stride", args.stride, 1), ("--warmup", args.warmup, 0), ("--limit", args.limit, 0),
                             ("--lookup-nodes", args.lookup_nodes, 0)):
        if value < low:
            raise BenchError(f"{flag} must be >= {low}, got {value}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - checked now, not after the whole benchmark has run
        except ImportError:
            raise BenchError("--plot needs matplotlib: pip install matplotlib (or medusa-train[bench]), or drop "
                             "--plot") from None
    budget = parse_tree_budget(args.tree_budget)
    methods = resolve_methods(args)
    if args.turn < 1:
        raise BenchError(f"--turn must be >= 1, got {args.turn}")
    texts = load_bench_prompts(args.prompts, args.limit, args.stride, args.turn)
    against = load_replies(args.replies_against, len(texts)) if args.replies_against else None
    return methods, texts, against, budget


def load_bench_target(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[nn.Module, Any, str]:
    """The target every method runs (with the adapter the heads were trained for merged in), its tokenizer and what
    its linear layers run on; BenchError if the heads were trained for different targets."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.engine.kernels import use_onednn_linear
    from medusa_train.kinds import load_spec
    from medusa_train.target.model import default_device, merge_recorded_adapter, recorded_adapter, resolve_dtype

    device = default_device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=resolve_dtype(args.dtype, device))
    fingerprints = [load_spec(d).target_fingerprint for d in args.heads]
    adapters = {recorded_adapter(fp) for fp in fingerprints}
    if len(adapters) > 1:
        raise BenchError(f"the heads were trained for different targets (adapters {sorted(map(str, adapters))})")
    if fingerprints:  # heads for base + adapter: every method runs that target, ar included
        target = merge_recorded_adapter(target, fingerprints[0], args.target)
    target = target.to(device).eval()
    kernels = ""
    # (not with --compile: inductor cannot lower the packed oneDNN linears, and generates its own kernels)
    if args.cpu_linear != "default" and not args.compile and use_onednn_linear(target,
                                                                               pack=args.cpu_linear == "onednn"):
        # shared by every method, `ar` included
        kernels = ", float32 linear layers on oneDNN" + (" (packed weights)" if args.cpu_linear == "onednn" else "")
    return target, tokenizer, kernels


def build_runners(args: argparse.Namespace, methods: list[str], target: nn.Module, tokenizer, budget: str | int
                  ) -> tuple[dict[str, Runner], dict[str, Any], dict[str, dict[str, int]]]:
    """One runner per method; the engine's generators and their per-method counts (tree nodes, steps)."""
    from inference import BigramDrafter, HeadsDrafter, HybridDrafter, NGramDrafter, SpeculativeGenerator
    from medusa_train.target.model import pad_id

    pad = pad_id(tokenizer)
    plain = {"ar": lambda: hf_runner(target, pad), "ar-compiled": lambda: hf_runner(target, pad, compiled=True),
             "pld": lambda: hf_runner(target, pad, args.pld_tokens)}
    runners: dict[str, Runner] = {}
    generators: dict[str, SpeculativeGenerator] = {}
    counts: dict[str, dict[str, int]] = {}
    for m in methods:
        if m in plain:
            runners[m] = plain[m]()
            continue
        if m == "ngram":
            drafter = NGramDrafter()
        elif m == "bigram":
            drafter = BigramDrafter.from_texts(bigram_texts(args.bigram_data), tokenizer, args.bigram_top_k)
        else:
            drafter = HeadsDrafter.from_pretrained(args.heads_dirs[m.removesuffix("+ngram")], target)
            if m.endswith("+ngram"):
                drafter = HybridDrafter(drafter, lookup_nodes=args.lookup_nodes)
        generators[m] = SpeculativeGenerator(target, tokenizer, drafter, compile=args.compile)
        counts[m] = {}
        runners[m] = engine_runner(generators[m], args.tree, budget, counts[m])
    return runners, generators, counts


def report(args: argparse.Namespace, result: dict[str, Any], replies: list[list[int]], log: Callable[[str], None]
           ) -> None:
    """The table on stdout; the replies, the JSON and the plot where asked."""
    from medusa_train.base.files import atomic_write_text, write_json

    if args.replies:
        atomic_write_text(args.replies, "".join(json.dumps({"prompt": i, "tokens": r}) + "\n"
                                                for i, r in enumerate(replies)))
        log(f"[bench] wrote the target's greedy replies to {args.replies}")
    print(f"\n{result['machine']}\ntarget {result['target']}; {result['prompt_set']}; greedy, "
          f"{args.max_new_tokens} new tokens, tree {args.tree} budget {args.tree_budget}, {args.repeats} repeat(s)\n")
    print(format_table(result["methods"]))
    if args.replies_against:
        c = result["replies_against"]
        rest = "" if c["identical"] == c["prompts"] else \
            f" (the others part at new token {c['median_first_difference']} in the median)"
        print(f"\ngreedy replies identical to {args.replies_against}: {c['identical']} of {c['prompts']}{rest}")
    if args.out:
        write_json(args.out, result)
        log(f"[bench] wrote {args.out}")
    if args.plot:
        plot(result["methods"], args.plot,
             f"{Path(str(args.target)).name}: {result['prompt_set']}, {args.max_new_tokens} new tokens")
        log(f"[bench] wrote {args.plot}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; exit code 2 on bad input, before any model is loaded."""
    from inference.engine.support import context_limit

    args = build_parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        methods, texts, against, budget = check_arguments(args)
        log(f"[bench] loading {args.target}; methods: {', '.join(methods)}; {len(texts)} prompts, "
            f"{args.max_new_tokens} new tokens, {args.repeats} repeat(s)")
        target, tokenizer, kernels = load_bench_target(args, log)
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runners, generators, counts = build_runners(args, methods, target, tokenizer, budget)
    prompts = [render(tokenizer, t) for t in texts]
    depth = max((g.drafter.max_depth for g in generators.values()), default=0)
    kept = prompts_that_fit(prompts, context_limit(target), args.max_new_tokens, depth, log)
    if not kept:
        log(f"error: no prompt of {args.prompts} fits the target's context with --max-new-tokens "
            f"{args.max_new_tokens}: lower it, or pick shorter prompts")
        return 2
    prompts = [prompts[i] for i in kept]
    replies: list[list[int]] = []
    summary = run_benchmark(runners, prompts, args.max_new_tokens, args.repeats, args.warmup, log, replies)
    if budget == "auto" and generators:  # each generator timed its own verify forwards once, at warm-up
        log("[bench] auto tree budget (draft nodes per step): "
            + ", ".join(f"{m} {g.auto_tree_budget()}" for m, g in generators.items()))
    for m, g in generators.items():
        c = counts[m]
        log(f"[bench] {m}: {c.get('nodes', 0) / max(c.get('steps', 0), 1):.2f} tree nodes verified per step "
            f"(root included); acceptance rate given the parent was accepted (rate/tries): {g.calibrator.summary()}")
        if g.choice.tried():
            log(f"[bench] {m}: what its steps ran (auto budget, per-step choice): {g.choice.summary()}")
    result = {"machine": machine_description(next(target.parameters()).device) + kernels, "target": str(args.target),
              "prompts": len(prompts), "prompt_set": describe_prompts(args.prompts, len(prompts), args.stride,
                                                                            args.turn),
              "max_new_tokens": args.max_new_tokens, "methods": summary}
    if args.replies_against:
        result["replies_against"] = compare_replies(replies, [against[i] for i in kept], args.replies_against)
    report(args, result, replies, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
