"""Time the heads' training step as a cached epoch runs it: the target's h (and greedy tokens) computed once,
then heads forward, chunked loss, backward and optimizer step over the same batches, with an op table.

    python scripts/profile_train_step.py recipes/smollm2-135m.yaml target.model=$(python -m medusa_train.prepare) \
        data.dataset=runs/s11/train-data heads.draft_vocab_size=8192 [--no-greedy] [--batches 12]

`--no-greedy` leaves the target's greedy tokens out, as a run without train.cache_hidden does: the teacher then
computes full-vocabulary logits every step. Numbers: README, design notes ("Training on a CPU").
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from torch.utils.data import DataLoader

from medusa_train.config import load_config
from medusa_train.data import build_datasets, collate
from medusa_train.losses import HeadsObjective, greedy_tokens
from medusa_train.target import load_model, load_tokenizer, target_hidden
from medusa_train.trainer import _setup_forward_target, _setup_heads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--batches", type=int, default=12, help="batches timed (after 2 of warm-up)")
    p.add_argument("--no-greedy", action="store_true", help="no cached greedy tokens: full-vocab teacher")
    p.add_argument("--table", type=int, default=15, help="rows of the op table (0: none)")
    args = p.parse_intermixed_args()

    cfg = load_config(args.recipe, args.overrides)
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.target)
    train_ds, _, _ = build_datasets(cfg, tokenizer)
    target = load_model(cfg.target, "cpu")
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    forward_target = _setup_forward_target(cfg, target, "cpu")
    heads = _setup_heads(cfg, target, train_ds)
    objective = HeadsObjective(heads, cfg.loss)
    optimizer = torch.optim.AdamW([q for q in objective.parameters() if q.requires_grad], lr=cfg.train.lr)
    loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, shuffle=True,
                        collate_fn=partial(collate, pad_token_id=tokenizer.pad_token_id))
    batches = []
    with torch.no_grad():
        for batch, _ in zip(loader, range(args.batches + 2)):
            h = target_hidden(forward_target, batch["input_ids"], batch["attention_mask"]).to(embed.weight.dtype)
            greedy = None if args.no_greedy else greedy_tokens(lm_head, h)
            batches.append((batch, h, greedy))

    def step(batch, h, greedy) -> int:
        loss, _ = objective(h, batch["input_ids"], batch["labels"], batch["attention_mask"], embed, lm_head, greedy)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(batch["attention_mask"].sum())

    for b in batches[:2]:
        step(*b)
    start = time.perf_counter()
    tokens = sum(step(*b) for b in batches[2:])
    elapsed = time.perf_counter() - start
    print(f"{len(batches) - 2} steps, {tokens} tokens, {elapsed:.2f} s: {tokens / elapsed:.0f} tokens/s "
          f"({'full-vocab teacher' if args.no_greedy else 'greedy tokens cached'}; target {target.dtype}, "
          f"{torch.get_num_threads()} threads)")
    if args.table:  # a second pass over the same batches, under the profiler
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for b in batches[2:]:
                step(*b)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.table))


if __name__ == "__main__":
    main()
