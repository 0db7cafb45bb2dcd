"""Time the heads' training step as a cached epoch runs it: the target's h and greedy tokens computed once
(`TargetStates`), then heads forward, chunked loss, backward and optimizer step over the same batches, with an
op table. With `target.lora.r=N` (joint training) the step is the real joint step, target forwards included, and
the table opens with its phases (`JointObjective`'s named ranges).

    python scripts/profile_train_step.py recipes/smollm2-135m.yaml \
        target.model=$(python -m medusa_train.target.prepare) data.dataset=runs/full/data \
        heads.draft_vocab_size=8192 [--batches 12]

Numbers: docs/history.md ("Training on a CPU", "Joint training").
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from torch.profiler import record_function
from torch.utils.data import DataLoader

from medusa_train.config import load_config, resolve_lr
from medusa_train.data.rows import build_datasets, collate
from medusa_train.train.joint import add_lora
from medusa_train.target.model import load_model, load_tokenizer, text_config
from medusa_train.target.states import TargetStates
from medusa_train.train.optim import param_groups
from medusa_train.train.run import make_objective, setup_forward_target, setup_heads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--batches", type=int, default=12, help="batches timed (after 2 of warm-up)")
    p.add_argument("--table", type=int, default=15, help="rows of the op table (0: none)")
    args = p.parse_intermixed_args()

    cfg = load_config(args.recipe, args.overrides)
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.target)
    train_ds, _, _ = build_datasets(cfg, tokenizer)
    target = load_model(cfg.target, "cpu")
    resolve_lr(cfg, text_config(target.config).hidden_size)  # train.lr auto: the kind's own, as the trainer does
    joint = cfg.target.lora.r > 0
    peft = add_lora(target, cfg.target.lora) if joint else None
    target = peft.get_base_model() if joint else target
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    heads = setup_heads(cfg, target, train_ds, tokenizer)
    states = TargetStates(setup_forward_target(cfg, target, "cpu"), lm_head, layers=heads.target_layers)
    objective = make_objective(cfg, heads, target, peft)
    optimizer = torch.optim.AdamW(param_groups(objective, cfg.train.weight_decay), lr=cfg.train.lr)
    loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, shuffle=True,
                        collate_fn=partial(collate, pad_token_id=tokenizer.pad_token_id))
    batches = []
    with torch.no_grad():
        for batch, _ in zip(loader, range(args.batches + 2)):
            if joint:  # the target runs inside the step
                batches.append((batch, None, None))
                continue
            h, greedy = states(batch)
            batches.append((batch, h.to(embed.weight.dtype), greedy))

    def step(batch, h, greedy) -> int:
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        if joint:
            loss, _, _ = objective(ids, labels, mask, embed, lm_head, True)
        else:
            loss, _ = objective(h, greedy, ids, labels, mask, embed, lm_head)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return int(mask.sum())

    for b in batches[:2]:
        step(*b)
    start = time.perf_counter()
    tokens = sum(step(*b) for b in batches[2:])
    elapsed = time.perf_counter() - start
    print(f"{len(batches) - 2} steps, {tokens} tokens, {elapsed:.2f} s: {tokens / elapsed:.0f} tokens/s "
          f"(target {target.dtype}, "
          f"{torch.get_num_threads()} threads)")
    if args.table:  # a second pass over the same batches, under the profiler
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for b in batches[2:]:
                step(*b)
        averages = prof.key_averages()
        phases = [e for e in averages if e.key.startswith("joint: ") or e.key in ("backward", "optimizer step")]
        steps = len(batches) - 2
        for e in sorted(phases, key=lambda e: -e.cpu_time_total):
            print(f"{e.key:<32}{e.cpu_time_total / steps / 1e6:8.3f} s a step")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.table))


if __name__ == "__main__":
    main()
