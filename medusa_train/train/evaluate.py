"""Held-out evaluation: per-head top-k acceptance along a chain, and the expected tau it implies.

For head k (1-based) at position t the reference is the target's greedy token at position t+k (its guess
for x_{t+1+k}). Head k is counted only where the path before it is right: for every j < k, head j's
top-1 equals the target's greedy token at t+j *and* the data token x_{t+1+j} equals it too, so that the
teacher-forced tokens head k has read are exactly what the engine would feed it after accepting heads
1..k-1. `topk_accuracy[k][r]` is the probability that the target's token is exactly head k's (r+1)-th
candidate given a right path (not cumulative), and the expected tau of a chain (one candidate per head,
the bonus token included) is

    tau = 1 + sum_k prod_{j <= k} topk_accuracy[j][0].

`acceptance.json` in the output directory holds these numbers; the inference engine builds its static
tree from them.

The same numbers for trained heads on any chat data (your users' prompts with the target's replies, e.g. from
`python -m medusa_train.data.distill`), before serving them:

    python -m medusa_train.train.evaluate recipes/smollm2-135m.yaml target.model=$T data.dataset=replies.jsonl \
        --heads runs/smollm2-135m-chained [--max-reply-tokens 128] [--split eval] [--out acceptance.json]

`--max-reply-tokens N` scores only each row's first N supervised tokens (what generating N tokens sees);
`--split eval` scores the recipe's own held-out split (same shuffle and size as training) instead of every row:
with the recipe's `eval.max_batches` as `--max-batches` (default 0: all) and batches of the recipe's
`train.batch_size` (the default), it reproduces a single-process run's acceptance.json. Besides the chain it reports
the expected tau of the best static tree at each of the recipe's `eval.tree_budgets` (or `--budgets 4 8 64`), the
tree the engine builds from these numbers, and bootstrap standard errors: the numbers the trainer keeps its best
heads by.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from inference.engine.tree import expected_tau_curve

from ..config import LossConfig
from ..base.errors import ArgumentParser
from ..base.files import write_json
from ..kinds.heads import DraftHeads, HeadsMismatchError
from .losses import STATS, chunked_head_losses, head_logits, head_targets, shift_left, summarize
from ..target.states import TargetStates
from ..target.model import chunk_positions, logit_transform

MAX_RANK = 10
ACCEPTANCE_NAME = "acceptance.json"


@torch.no_grad()
def conditional_rank_hits(heads: DraftHeads, states: torch.Tensor, greedy: torch.Tensor, input_ids: torch.Tensor,
                          labels: torch.Tensor, attention_mask: torch.Tensor | None, lm_head: nn.Module | None,
                          chunk_size: int = 1024, max_rank: int = MAX_RANK) -> torch.Tensor:
    """Per-sequence counts [B, K, max_rank + 1]: column r < max_rank counts positions where the target's
    greedy token (`greedy` [B, T], from `TargetStates`) is exactly head k's (r+1)-th candidate, given a right
    path; the last column counts the positions where head k was scored (valid and right path)."""
    K, B, T, _ = states.shape
    target_ids, valid = head_targets(input_ids, labels, attention_mask, K)  # [K, B, T]
    greedy_next = torch.cat([shift_left(greedy, 1, 0), greedy.new_zeros(B, K)], dim=1)  # [:, u] = greedy[:, u+1]
    out = torch.zeros(B, K, max_rank + 1, device=states.device)
    step = chunk_positions(chunk_size, B, heads.spec.scored_vocab, states.device)
    for a in range(0, T, step):
        b = min(a + step, T)
        c = b - a
        path_right = torch.ones(B, c, dtype=torch.bool, device=states.device)
        for k in range(K):
            greedy_k = greedy_next[:, a + k:b + k]  # the target's token at t+1+k for x_{t+2+k}
            logits = head_logits(heads, k, states[k, :, a:b], lm_head)  # [B, c, Vs]
            top = heads.to_target_ids(logits.topk(min(max_rank, logits.shape[-1]), dim=-1).indices)
            counted = valid[k, :, a:b] & path_right
            hits = (top == greedy_k.unsqueeze(-1)) & counted.unsqueeze(-1)  # [B, c, R]
            out[:, k, :hits.shape[-1]] += hits.sum(1).float()
            out[:, k, max_rank] += counted.sum(1).float()
            data = target_ids[k, :, a:b]
            path_right = counted & (top[..., 0] == greedy_k) & (data == greedy_k)
    return out


def topk_from_hits(hits: torch.Tensor) -> list[list[float]]:
    """[head][rank] p(the target's token is exactly that candidate | a right path) from summed hits [K, R + 1]."""
    hits = hits.double().cpu()
    counted = hits[:, -1]
    return [[float(x) for x in hits[k, :-1] / max(float(counted[k]), 1.0)] for k in range(hits.shape[0])]


def chain_tau(topk_accuracy: Sequence[Sequence[float]]) -> float:
    """Expected tau of a chain (top-1 per head, the bonus token included)."""
    tau, chain = 1.0, 1.0
    for row in topk_accuracy:
        chain *= row[0]
        tau += chain
    return tau


def tree_taus(topk_accuracy: Sequence[Sequence[float]], budgets: Iterable[int]) -> dict[int, float]:
    """Expected tau of the best static tree at each budget (draft nodes, root excluded): the engine's own tree
    search (`inference.engine.tree`), which shapes the tree a heads directory is served with."""
    budgets = sorted(set(budgets))
    if not budgets:
        return {}
    curve = expected_tau_curve(topk_accuracy, budgets[-1])
    return {b: curve[b] for b in budgets}


def acceptance_from_hits(hits: torch.Tensor, budgets: Iterable[int] = ()) -> dict[str, Any]:
    """{"topk_accuracy": [[p(rank r) for r in 1..R] per head], "expected_tau" (chain), "expected_tau_tree"
    ({budget: tau}), "expected_tau_curve", "positions"} from summed hits [K, R + 1] (the last column: positions
    counted per head)."""
    acc = topk_from_hits(hits)
    counted = hits.double().cpu()[:, -1]
    budgets = sorted(set(budgets))
    curve = expected_tau_curve(acc, budgets[-1]) if budgets else [1.0]
    return {"topk_accuracy": acc, "expected_tau": chain_tau(acc),
            "expected_tau_tree": {str(b): curve[b] for b in budgets},
            "expected_tau_curve": curve,  # [tau at budget 0, 1, ..., max(budgets)]
            "positions": int(counted[0]), "positions_per_head": [int(x) for x in counted]}


def bootstrap_stderr(seq_hits: torch.Tensor, budgets: Iterable[int] = (), samples: int = 200,
                     seed: int = 0) -> dict[str, Any]:
    """Standard errors of the chain's and each budget's expected tau, from `samples` resamples of the sequences
    (per-sequence hits [N, K, R + 1]); a generator of its own, so the global RNG (training's) is untouched. Empty
    for fewer than 2 sequences."""
    n = seq_hits.shape[0]
    if n < 2:  # no spread to measure
        return {}
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (samples, n), generator=g)
    ones = torch.ones(samples, n, dtype=torch.float64)
    weights = torch.zeros(samples, n, dtype=torch.float64).scatter_add_(1, idx, ones)  # [S, N] times drawn
    resampled = (weights @ seq_hits.double().reshape(n, -1)).reshape(samples, *seq_hits.shape[1:])  # [S, K, R + 1]
    chains, trees = [], {b: [] for b in sorted(set(budgets))}
    for hits in resampled:
        acc = topk_from_hits(hits)
        chains.append(chain_tau(acc))
        for b, t in tree_taus(acc, trees).items():
            trees[b].append(t)
    std = lambda xs: float(torch.tensor(xs, dtype=torch.float64).std())  # noqa: E731
    return {"expected_tau_stderr": std(chains), "expected_tau_tree_stderr": {str(b): std(v) for b, v in trees.items()}}


@torch.no_grad()
def evaluate(heads: DraftHeads, target: nn.Module, batches: Iterable[dict[str, torch.Tensor]],
             loss_cfg: LossConfig, max_batches: int = 0, accelerator=None,
             budgets: Sequence[int] = (4, 8, 64)) -> tuple[dict[str, float], dict[str, Any]]:
    """Run the heads over held-out batches: (metrics, acceptance).

    metrics: eval loss, per-head accuracies (as in training), `expected_tau` (a chain), `expected_tau@B` (the best
    static tree of B draft nodes, per budget) and their bootstrap standard errors; acceptance: the contents of
    acceptance.json. With an `accelerator`, per-sequence counts are gathered across processes with
    `gather_for_metrics`, so duplicated padding samples are dropped.
    """
    was_training = heads.training
    heads.eval()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    target_states = TargetStates(target, lm_head, layers=heads.target_layers)
    transform = logit_transform(target.config)
    dtype = next(heads.parameters()).dtype
    K = heads.spec.num_heads
    stats = torch.zeros(K, len(STATS))
    seq_hits_all = []
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        h, greedy = target_states(batch)
        states = heads(h.to(dtype), ids, embed)
        h = h[..., :heads.spec.hidden_size]  # h_t, without the aux layers' states eagle3 heads read
        # per-sequence loss statistics, so that gather_for_metrics can drop duplicated samples
        per_seq = torch.stack([chunked_head_losses(heads, states[:, b:b + 1], h[b:b + 1], greedy[b:b + 1],
                                                   ids[b:b + 1], labels[b:b + 1], mask[b:b + 1], lm_head,
                                                   loss_cfg, transform)[1]
                               for b in range(ids.shape[0])])  # [B, K, S]
        seq_hits = conditional_rank_hits(heads, states, greedy, ids, labels, mask, lm_head, loss_cfg.chunk_size)
        if accelerator is not None:
            per_seq, seq_hits = accelerator.gather_for_metrics((per_seq, seq_hits))
        stats += per_seq.sum(0).cpu()
        seq_hits_all.append(seq_hits.cpu())
    heads.train(was_training)
    seq_hits = torch.cat(seq_hits_all) if seq_hits_all else torch.zeros(0, K, MAX_RANK + 1)
    acceptance = acceptance_from_hits(seq_hits.sum(0), budgets) | bootstrap_stderr(seq_hits, budgets)
    acceptance["sequences"] = seq_hits.shape[0]
    metrics = summarize(stats, loss_cfg)
    metrics["expected_tau"] = acceptance["expected_tau"]
    if "expected_tau_stderr" in acceptance:
        metrics["expected_tau_stderr"] = acceptance["expected_tau_stderr"]
    for b, tau in acceptance["expected_tau_tree"].items():
        metrics[f"expected_tau@{b}"] = tau
        if "expected_tau_tree_stderr" in acceptance:
            metrics[f"expected_tau@{b}_stderr"] = acceptance["expected_tau_tree_stderr"][b]
    for k, row in enumerate(acceptance["topk_accuracy"]):
        metrics[f"head{k + 1}/accept_top1"] = row[0]
    return metrics, acceptance


def save_acceptance(directory: str | os.PathLike, acceptance: dict[str, Any], split: str) -> Path:
    """Write acceptance.json (temp file, then rename) and return its path."""
    path = Path(directory) / ACCEPTANCE_NAME
    write_json(path, acceptance | {"split": split})
    return path


# ---------------------------------------------------------------------------------------------------
# CLI


def crop_replies(row: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Keep a tokenized row up to its `max_tokens`-th supervised label (labels != -100), so that only the
    first `max_tokens` reply tokens are scored."""
    seen = 0
    for i, label in enumerate(row["labels"]):
        if label != -100:
            seen += 1
            if seen == max_tokens:
                return {"input_ids": row["input_ids"][:i + 1], "labels": row["labels"][:i + 1]}
    return {"input_ids": row["input_ids"], "labels": row["labels"]}


def format_report(acceptance: dict[str, Any], ranks: int = 3) -> str:
    """A per-head table: top-1, top-`ranks` (cumulative, given a right path) and positions, then the chain tau."""
    lines = [f"{'head':>4}  {'top-1':>6}  {f'top-{ranks}':>6}  {'positions':>9}"]
    for k, row in enumerate(acceptance["topk_accuracy"]):
        lines.append(f"{k + 1:>4}  {row[0]:>6.3f}  {sum(row[:ranks]):>6.3f}  {acceptance['positions_per_head'][k]:>9}")
    lines.append(f"expected tau of a chain (top-1 per head, bonus token included): {acceptance['expected_tau']:.3f}"
                 + _pm(acceptance.get("expected_tau_stderr")))
    for b, tau in acceptance.get("expected_tau_tree", {}).items():
        lines.append(f"expected tau of the best static tree of {b} draft nodes (the engine's tree search): {tau:.3f}"
                     + _pm(acceptance.get("expected_tau_tree_stderr", {}).get(b)))
    return "\n".join(lines)


def _pm(stderr: float | None) -> str:
    return "" if stderr is None else f" +- {stderr:.3f}"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m medusa_train.train.evaluate",
                                description="Per-head acceptance and the expected tau of trained heads (a chain, "
                                            "and the engine's static tree per budget) on chat data.")
    p.add_argument("recipe", help="recipe YAML: its target and data sections are used (override data.dataset)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.dataset=replies.jsonl")
    p.add_argument("--heads", required=True, help="trained heads directory")
    p.add_argument("--split", choices=("all", "eval"), default="all",
                   help="all: every row of data.dataset (default); eval: the recipe's held-out split")
    p.add_argument("--max-reply-tokens", type=int, default=0, help="score only each row's first N reply tokens")
    p.add_argument("--batch-size", type=int, default=None, help="default: the recipe's train.batch_size")
    p.add_argument("--max-batches", type=int, default=0, help="score only the first N batches (0: all)")
    p.add_argument("--budgets", type=int, nargs="+", default=None,
                   help="tree budgets (draft nodes) for the expected tau of the best static tree; default: the "
                        "recipe's eval.tree_budgets")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default=None, help="write the acceptance JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; exit code 2 on bad input (recipe, data, heads directory or target mismatch)."""
    from torch.utils.data import DataLoader

    from ..config import ConfigError, load_config
    from ..data.rows import build_datasets, collate
    from ..kinds.heads import load_spec
    from ..target.model import default_device, load_model, load_tokenizer, merge_recorded_adapter

    args = build_parser().parse_intermixed_args(argv)
    try:
        if args.max_reply_tokens < 0 or args.max_batches < 0 or (args.batch_size is not None and args.batch_size < 1):
            raise ConfigError("--max-reply-tokens and --max-batches must be >= 0 (0: all), --batch-size >= 1")
        if args.budgets is not None and min(args.budgets) < 1:
            raise ConfigError(f"--budgets must be draft-node budgets >= 1, got {args.budgets}")
        heads_dir = Path(args.heads)
        if not heads_dir.is_dir():
            raise ConfigError(f"--heads: no such directory: {heads_dir}")
        # this CLI never generates: the recipe's eval.tau_every (which needs a held-out split) is not its business
        overrides = list(args.overrides) + ["eval.tau_every=0"] + (["data.eval_size=0"] if args.split == "all" else [])
        cfg = load_config(args.recipe, overrides)
        batch_size = args.batch_size or cfg.train.batch_size
        tokenizer = load_tokenizer(cfg.target)
        train_ds, eval_ds, _ = build_datasets(cfg, tokenizer)
        if args.split == "eval" and eval_ds is None:
            raise ConfigError("--split eval: the recipe has no held-out split (data.eval_size=0); use --split all")
        ds = train_ds if args.split == "all" else eval_ds
        if args.max_reply_tokens:
            ds = ds.map(partial(crop_replies, max_tokens=args.max_reply_tokens), desc="Cropping replies")
        device = default_device(args.device)
        target = load_model(cfg.target, device)
        if not cfg.target.adapter:  # heads trained for base + adapter (target.adapter, target.lora) bring it back
            target = merge_recorded_adapter(target, load_spec(heads_dir).target_fingerprint, cfg.target.model)
        heads = DraftHeads.from_pretrained(heads_dir, target, device=device, dtype=torch.float32)
    except (ConfigError, FileNotFoundError, HeadsMismatchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loader = DataLoader(ds, batch_size=batch_size, shuffle=False,
                        collate_fn=partial(collate, pad_token_id=tokenizer.pad_token_id))
    batches = ({k: v.to(device) for k, v in b.items()} for b in loader)
    _, acceptance = evaluate(heads, target, batches, cfg.loss, args.max_batches,
                             budgets=args.budgets or cfg.eval.tree_budgets)
    rows = min(len(ds), args.max_batches * batch_size) if args.max_batches else len(ds)
    print(f"{heads_dir} on {cfg.data.dataset} ({args.split}: {rows} rows"
          f"{f', first {args.max_reply_tokens} reply tokens' if args.max_reply_tokens else ''}; "
          f"target {cfg.target.model}, {cfg.target.dtype})")
    print(format_report(acceptance))
    if args.out:
        meta = {"heads": str(heads_dir), "dataset": str(cfg.data.dataset), "split": args.split,
                "rows": rows, "max_reply_tokens": args.max_reply_tokens}
        write_json(args.out, acceptance | meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
