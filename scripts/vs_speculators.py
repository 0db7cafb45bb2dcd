"""Our EAGLE-3 trainer against the reference one (the `speculators` package) on the same rows: the helpers behind
`scripts/vs_speculators.sh`.

    python scripts/vs_speculators.py prepare OUT --val VAL.jsonl -- RECIPE [overrides]   # our venv
    SPEC/bin/python scripts/vs_speculators.py train -- [speculators train flags]          # speculators' venv
    python scripts/vs_speculators.py import CHECKPOINT OUT --target T                      # our venv

`prepare` writes what `speculators train` reads, from exactly the rows our trainer trains on for RECIPE and its
overrides (`medusa_train.data.rows.build_datasets`: same tokens, same assistant mask): OUT/ holds the dataset
(`input_ids`, `loss_mask`, `seq_len`; the VAL rows appended last, for its validation split), `token_freq.pt` (the
supervised tokens' counts, from which it picks its draft vocabulary) and `hidden_states/hs_{i}.safetensors` (the
target's states at the aux layers and its last layer's output before the final norm, in the target dtype of the
recipe). `train` runs `speculators train` on a machine without an accelerator: its trainer moves the model and each
batch to the local rank (a CUDA index), autocasts for "cuda" when no accelerator is found and synchronizes the
accelerator in its step timer; the shim points the first two at the CPU, makes the third a no-op and changes nothing
else. `import` turns a checkpoint it wrote into our heads directory, so our engine
drafts with it (`medusa_train.kinds.eagle3.import_speculators`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def prepare(out: Path, val: str, recipe_and_overrides: list[str]) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from medusa_train.data.chat import end_of_turn_ids, tokenize_chat
    from medusa_train.config import load_config
    from medusa_train.data.rows import build_datasets
    from medusa_train.kinds.heads import default_aux_layers
    from medusa_train.target.model import decoder_layers, load_target, resolve_dtype, target_hidden

    cfg = load_config(recipe_and_overrides[0], recipe_and_overrides[1:])
    model, tok = load_target(cfg.target, "cpu", resolve_dtype(cfg.target.dtype, "cpu"))
    train, _, info = build_datasets(cfg, tok)
    rows = [(list(r["input_ids"]), list(r["labels"])) for r in train]
    end_ids = end_of_turn_ids(tok)
    for line in open(val):
        enc = tokenize_chat(json.loads(line)["messages"], tok, cfg.data.max_length, end_ids)
        rows.append((enc["input_ids"], enc["labels"]))
    layers = len(decoder_layers(model))
    aux = list(cfg.heads.aux_layers or default_aux_layers(layers))
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    freq: dict[int, int] = {}
    for i, (ids, labels) in enumerate(rows):
        x = torch.tensor([ids])
        states = target_hidden(model, x, layers=aux + [layers])[0]  # [T, (1 + A + 1) d]: h, aux..., last pre-norm
        d = states.shape[-1] // (len(aux) + 2)
        hs = states[:, d:].reshape(len(ids), len(aux) + 1, d).contiguous()
        save_file({"hidden_states": hs, "token_ids": x[0]}, str(out / "hidden_states" / f"hs_{i}.safetensors"))
        if i < len(train):
            for t, label in zip(ids, labels):
                if label != -100:
                    freq[t] = freq.get(t, 0) + 1
    ds = Dataset.from_dict({"input_ids": [r[0] for r in rows],
                            "loss_mask": [[int(label != -100) for label in r[1]] for r in rows],
                            "seq_len": [len(r[0]) for r in rows]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    torch.save(freq, out / "token_freq.pt")
    json.dump({"train_rows": len(train), "val_rows": len(rows) - len(train), "tokens": info["tokens"],
               "aux_layers": aux, "dtype": cfg.target.dtype}, open(out / "prepared.json", "w"))
    print(f"prepared {len(train)} training rows ({info['tokens']} tokens) + {len(rows) - len(train)} validation "
          f"rows, aux layers {aux}, into {out}")


def train(argv: list[str]) -> None:
    import speculators.train.trainer as trainer
    import torch
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    trainer.get_local_rank = lambda: "cpu"  # model.to(local_rank) and batch.to(local_rank)
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"  # autocast's device; "cuda" when no accelerator is found

    trainer.Trainer.__init__ = cpu_init
    if not torch.accelerator.is_available():  # its step timer synchronizes the accelerator at every mark
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    main(TrainConfig.resolve(argv))


def import_checkpoint(checkpoint: str, out: str, target: str) -> None:
    from medusa_train.config import TargetConfig
    from medusa_train.kinds.eagle3 import import_speculators
    from medusa_train.target.model import load_model

    heads = import_speculators(checkpoint, load_model(TargetConfig(model=target)), target)
    heads.save_pretrained(out)
    print(f"imported {checkpoint} into {out}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("out", type=Path)
    pp.add_argument("--val", required=True, help="chat JSONL rows for speculators' validation split")
    pp.add_argument("recipe", nargs="+", help="-- RECIPE [overrides], as train.py takes them")
    pt = sub.add_parser("train")
    pt.add_argument("flags", nargs=argparse.REMAINDER)
    pi = sub.add_parser("import")
    pi.add_argument("checkpoint")
    pi.add_argument("out")
    pi.add_argument("--target", required=True)
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args.out, args.val, args.recipe)
    elif args.cmd == "train":
        train([a for a in args.flags if a != "--"])
    else:
        import_checkpoint(args.checkpoint, args.out, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
