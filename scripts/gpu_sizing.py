"""What a training step costs a GPU, by target shape and head kind, counted without one: the heads are built on the
meta device at Llama-3.1-8B's and -70B's shapes with the recipe's options, and one step (forward, chunked loss,
backward, through the GPU's attention path) runs on meta tensors, counting what autograd keeps for backward and the
FLOPs (torch's FlopCounterMode). On the `small` shape the same count gives what this CPU measured
(scripts/attention_memory.py: eagle3, 2 rows of 2048 tokens, 1,670 MiB kept, of which ~50 MiB are weights, left out
here: they are counted once, as weights). From those counts: the memory of a
process at 1, 2, 4 rows of 2048 tokens and the rows that fit 24, 40 and 80 GB cards.

    python scripts/gpu_sizing.py --out docs/results/gpu-sizing.json

Assumptions (not counts): the target in bfloat16; 8B whole on every GPU (DDP); 70B sharded over 8 GPUs by FSDP2
(1/8 of its layers, the embedding and LM head whole, two layers gathered at a time); the heads' float32 weights,
gradients and AdamW moments; 1.5 GiB for the CUDA context, the target's forward of one layer and a loss chunk; a card
usable to 92%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "small": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2),
    "8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    "70B": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
}
# the recipes' heads (eagle3: EAGLE-3's 7 steps)
STEPS = {"chained": 4, "parallel": 4, "eagle3": 7, "dflash": 8, "dspark": 8}
GIB = 2 ** 30
OVERHEAD_GIB = 1.5
USABLE = 0.92


def count(shape: str, kind: str, rows: int, tokens: int) -> dict:
    """In the child: one meta-device step; bytes kept for backward, FLOPs, parameters."""
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    import medusa_train.kinds.attention as attention
    from medusa_train.config import LossConfig, load_config
    from medusa_train.kinds.heads import DraftHeads
    from medusa_train.train.losses import HeadsObjective
    from medusa_train.train.preflight import heads_spec

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    cfg = load_config(str(ROOT / "recipes" / "llama-3.1-8b-instruct.yaml"),
                      [f"heads.kind={kind}", f"heads.num_heads={STEPS[kind]}", "eval.tau_every=0"], world_size=1)
    with torch.device("meta"):
        target = LlamaForCausalLM(config).to(torch.bfloat16)
        heads = DraftHeads(heads_spec(cfg, config))
    attention.MODE = "torch"  # keeps for backward what a GPU's flash kernel does (q, k, v, output, log-sum-exp)
    width = config.hidden_size * (1 + len(heads.target_layers))
    h = torch.empty(rows, tokens, width, device="meta")
    ids = torch.zeros(rows, tokens, dtype=torch.long, device="meta")
    mask = torch.ones_like(ids)
    kept = [0]
    weights = {id(p) for p in [*heads.parameters(), *target.parameters()]}

    def pack(t):  # a weight saved for backward (once a step for eagle3's layer) costs nothing more
        if id(t) not in weights and id(getattr(t, "_base", None)) not in weights:
            kept[0] += t.numel() * t.element_size()
        return t

    flops = FlopCounterMode(display=False)
    with flops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = HeadsObjective(heads, LossConfig())(h, ids, ids, ids.clone(), mask, target.get_input_embeddings(),
                                                          target.get_output_embeddings())
        loss.backward()
    target_flops = FlopCounterMode(display=False)
    with target_flops, torch.no_grad():
        out = target.model(input_ids=ids).last_hidden_state  # no mask: all rows full (a mask needs data)
        target.lm_head(out)  # the greedy tokens: the full-vocabulary LM head at every position
    return {"shape": shape, "kind": kind, "rows": rows, "tokens": tokens, "kept_bytes": kept[0],
            "params": sum(p.numel() for p in heads.parameters()),
            "trainable": sum(p.numel() for p in heads.parameters() if p.requires_grad),
            "heads_flops_per_token": flops.get_total_flops() / (rows * tokens),
            "target_flops_per_token": target_flops.get_total_flops() / (rows * tokens),
            "target_bytes": sum(p.numel() for p in target.parameters()) * 2,
            "layer_bytes": sum(p.numel() for p in target.model.layers[0].parameters()) * 2,
            "layers": config.num_hidden_layers}


def process_gib(row: dict, per_row: float, fixed: float, rows: int, shards: int) -> float:
    """A process's memory at `rows` rows a micro-step: target (whole, or 1/shards of its layers + the rest whole + two
    gathered layers), the heads' training state, what the step keeps, the overhead."""
    layers = row["layer_bytes"] * row["layers"]
    target = row["target_bytes"] if shards == 1 else layers / shards + (row["target_bytes"] - layers) + \
        2 * row["layer_bytes"]
    heads = 4 * row["params"] + 12 * row["trainable"]
    return (target + heads) / GIB + fixed + per_row * rows + OVERHEAD_GIB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(count(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]))))
        return 0

    def child(shape: str, kind: str, rows: int, tokens: int) -> dict:
        out = subprocess.run([sys.executable, __file__, "--child", shape, kind, str(rows), str(tokens)],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    check = child("small", "eagle3", 2, 2048)
    print(f"check, small shape, eagle3, 2 rows of 2048: {check['kept_bytes'] / 2 ** 20:,.0f} MiB kept "
          "(this CPU measured 1,670 with the weights saved for backward, which this count leaves out)")
    table = []
    print(f"{'target':>6} {'kind':>8} | {'heads GFLOP/token':>17} {'target':>6} | kept a row | GiB at 1 / 2 / 4 rows "
          "| rows of 2048 that fit 24 / 40 / 80 GB")
    for shape, shards in (("8B", 1), ("70B", 8)):
        for kind in STEPS:
            one, two = child(shape, kind, 1, args.tokens), child(shape, kind, 2, args.tokens)
            per_row = (two["kept_bytes"] - one["kept_bytes"]) / GIB
            fixed = one["kept_bytes"] / GIB - per_row
            gib = [process_gib(one, per_row, fixed, r, shards) for r in (1, 2, 4)]
            fit = [max(0, int((card * 1e9 / GIB * USABLE - process_gib(one, per_row, fixed, 0, shards)) // per_row))
                   for card in (24, 40, 80)]
            row = {"shape": shape, "kind": kind, "shards": shards, "per_row_gib": per_row, "fixed_gib": fixed,
                   "gib_at_rows": dict(zip((1, 2, 4), gib)), "rows_that_fit": dict(zip((24, 40, 80), fit)),
                   "heads_gflop_per_token": one["heads_flops_per_token"] / 1e9,
                   "target_gflop_per_token": one["target_flops_per_token"] / 1e9, "params": one["params"],
                   "trainable": one["trainable"]}
            table.append(row)
            print(f"{shape:>6} {kind:>8} | {row['heads_gflop_per_token']:17.1f} {row['target_gflop_per_token']:6.1f} | "
                  f"{per_row:8.2f} GiB | " + " / ".join(f"{g:.1f}" for g in gib) + " | " +
                  " / ".join(map(str, fit)))
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens": args.tokens, "check": check, "table": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
