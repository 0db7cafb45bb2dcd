"""Our EAGLE-3 trainer against the reference one (the `speculators` package) on the same rows: the helpers behind
`scripts/vs_speculators.sh`.

    python scripts/vs_speculators.py prepare OUT --val VAL.jsonl -- RECIPE [overrides]   # our venv
    SPEC/bin/python scripts/vs_speculators.py train -- [speculators train flags]          # speculators' venv
    python scripts/vs_speculators.py import CHECKPOINT OUT --target T                      # our venv
    python scripts/vs_speculators.py split VLLM.json WORK         # vllm_serve_bench.py results, a file a drafter
    python scripts/vs_speculators.py table WORK EPOCHS NAME...    # the comparison: WORK/result.json and a table

`prepare` writes what `speculators train` reads, from exactly the rows our trainer trains on for RECIPE and its
overrides (`medusa_train.data.rows.build_datasets`: same tokens, same assistant mask): OUT/ holds the dataset
(`input_ids`, `loss_mask`, `seq_len`; the VAL rows appended last, for its validation split), `token_freq.pt` (the
supervised tokens' counts, from which it picks its draft vocabulary) and `hidden_states/hs_{i}.safetensors` (the
target's states at the aux layers and its last layer's output before the final norm, in the target dtype of the
recipe). `train` runs `speculators train` on a machine without an accelerator: its trainer moves the model and each
batch to the local rank (a CUDA index), autocasts for "cuda" when no accelerator is found and synchronizes the
accelerator in its step timer; the shim points the first two at the CPU, makes the third a no-op, runs Muon's
Newton-Schulz iteration in float32 as our trainer does off a GPU (torch's bfloat16 one crawls on a CPU without AMX)
and changes nothing else. `import` turns a checkpoint it wrote into our heads directory, so our engine
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
        # torch.optim.Muon's Newton-Schulz iteration runs in bfloat16, ~20x slower than float32 on a CPU without AMX
        # (~25 s an EAGLE-3 step here): the same iteration in float32, as our trainer runs it off a GPU
        import torch.optim._muon as muon

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this repo, for our trainer's iteration
        from medusa_train.train.optim import orthogonalize

        muon._zeropower_via_newtonschulz = lambda grad, coefficients, steps, eps: orthogonalize(
            grad, steps, torch.float32)
    main(TrainConfig.resolve(argv))


def import_checkpoint(checkpoint: str, out: str, target: str) -> None:
    from medusa_train.config import TargetConfig
    from medusa_train.kinds.eagle3 import import_speculators
    from medusa_train.target.model import load_model

    heads = import_speculators(checkpoint, load_model(TargetConfig(model=target)), target)
    heads.save_pretrained(out)
    print(f"imported {checkpoint} into {out}")


def split(results: str, work: Path) -> None:
    """One file a drafter (WORK/vllm-NAME.json) from a vllm_serve_bench run, so a later run measures new ones only."""
    data = json.loads(Path(results).read_text())
    run = data["runs"][0]
    for name in run["identical"]:
        keep = {k: run[name][k] for k in ("drafts", "accepted", "mean_acceptance_length", "acceptance_per_position")}
        keep |= {"identical": run["identical"][name], "prompts": data["prompts"], "batch": run["batch"],
                 "max_tokens": data["max_tokens"], "vllm": data["vllm"]}
        (work / f"vllm-{name}.json").write_text(json.dumps(keep, indent=2))


def steps_and_tokens(work: Path, name: str, epochs: int) -> tuple[int, float]:
    """(optimizer steps, tokens a step) of a run: ours from its metrics.jsonl, theirs from the training state of its
    last checkpoint (its tokens: the prepared rows', once an epoch)."""
    metrics = work / name / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        last = max((r for r in rows if "train/tokens" in r), key=lambda r: r["step"])
        return last["step"], last["train/tokens"] / last["step"]
    steps = json.loads((work / name / str(epochs - 1) / "training_state.json").read_text())["global_step"]
    tokens = json.loads((work / "theirs-data" / "prepared.json").read_text())["tokens"]
    return steps, tokens * epochs / steps


def table(work: Path, epochs: int, names: list[str]) -> None:
    rows = []
    for name in names:
        v = json.loads((work / f"vllm-{name}.json").read_text())
        steps, per_step = steps_and_tokens(work, name, epochs)
        seconds = work / f"{name}.seconds"
        rows.append({"name": name, "trainer": "speculators" if name.startswith("theirs") else "ours",
                     "steps": steps, "tokens_per_step": round(per_step),
                     "train_seconds": float(seconds.read_text().split()[-1]) if seconds.is_file() else None,
                     "mean_acceptance_length": v["mean_acceptance_length"],
                     "acceptance_per_position": v["acceptance_per_position"], "drafts": v["drafts"],
                     "identical": f"{v['identical']}/{v['prompts']}"})
    best = {who: max((r for r in rows if r["trainer"] == who), key=lambda r: r["mean_acceptance_length"], default=None)
            for who in ("ours", "speculators")}
    ours = [r for r in rows if r["trainer"] == "ours"]
    pairs = [(t["name"], r["name"]) for t in rows if t["trainer"] == "speculators" and ours for r in ours
             if abs(r["steps"] - t["steps"]) == min(abs(o["steps"] - t["steps"]) for o in ours)]
    (work / "result.json").write_text(json.dumps({"runs": rows, "best": {k: v and v["name"] for k, v in best.items()},
                                                  "nearest_steps": pairs}, indent=2))
    print("| drafter | trainer | optimizer steps | tokens a step | vLLM mean acceptance length | "
          "acceptance at positions 1, 2, 3 | outputs identical to plain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pos = ", ".join(f"{100 * a:.1f}%" for a in r["acceptance_per_position"])
        print(f"| {r['name']} | {r['trainer']} | {r['steps']} | {r['tokens_per_step']:,} | "
              f"{r['mean_acceptance_length']:.3f} | {pos} | {r['identical']} |")
    if best["ours"] and best["speculators"]:
        o, t = best["ours"], best["speculators"]
        print(f"best against best: {o['name']} {o['mean_acceptance_length']:.3f}, {t['name']} "
              f"{t['mean_acceptance_length']:.3f} ({o['mean_acceptance_length'] - t['mean_acceptance_length']:+.3f})")
    for theirs, ours_name in pairs:
        a, b = (next(r for r in rows if r["name"] == n) for n in (ours_name, theirs))
        print(f"nearest steps: {ours_name} ({a['steps']}) {a['mean_acceptance_length']:.3f} against {theirs} "
              f"({b['steps']}) {b['mean_acceptance_length']:.3f}")


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
    ps = sub.add_parser("split")
    ps.add_argument("results")
    ps.add_argument("work", type=Path)
    pt2 = sub.add_parser("table")
    pt2.add_argument("work", type=Path)
    pt2.add_argument("epochs", type=int)
    pt2.add_argument("names", nargs="+")
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args.out, args.val, args.recipe)
    elif args.cmd == "train":
        train([a for a in args.flags if a != "--"])
    elif args.cmd == "split":
        split(args.results, args.work)
    elif args.cmd == "table":
        table(args.work, args.epochs, args.names)
    else:
        import_checkpoint(args.checkpoint, args.out, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
