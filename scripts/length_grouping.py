"""The padded share of training batches, random against `data.group_by_length`, on a recipe's own rows (tokenized as
training tokenizes them): what fraction of each step's positions is padding.

    python scripts/length_grouping.py recipes/smollm2-135m.yaml data.dataset=ROWS.jsonl --batch-sizes 4 8 32

A chat file of uneven length (Alpaca as messages, ShareGPT) shows the effect; rows of one length show none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch
    from torch.utils.data import BatchSampler, RandomSampler

    from medusa_train.config import load_config
    from medusa_train.data.rows import LengthGroupedSampler, build_datasets, padded_share, row_lengths
    from medusa_train.target.model import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as train.py takes them")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8, 32])
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    cfg = load_config(args.recipe, [*args.overrides, "data.eval_size=0", "eval.tau_every=0"], world_size=1)
    train_ds, _, _ = build_datasets(cfg, load_tokenizer(cfg.target))
    lengths = row_lengths(train_ds)
    ordered = sorted(lengths)
    result = {"rows": len(lengths), "median": statistics.median(lengths), "p10": ordered[len(ordered) // 10],
              "p90": ordered[9 * len(ordered) // 10], "max": ordered[-1], "batches": []}
    print(f"{result['rows']} rows; tokens a row: median {result['median']}, p10 {result['p10']}, p90 {result['p90']}, "
          f"max {result['max']}")
    for size in args.batch_sizes:
        torch.manual_seed(0)
        random = list(BatchSampler(RandomSampler(range(len(lengths))), size, False))
        grouped = list(BatchSampler(LengthGroupedSampler(lengths, size, 0), size, False))
        row = {"batch_size": size, "random": padded_share(lengths, random),
               "grouped": padded_share(lengths, grouped)}
        result["batches"].append(row)
        print(f"batch {size}: padding {row['random']:.1%} of a step's positions at random, "
              f"{row['grouped']:.1%} grouped")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
