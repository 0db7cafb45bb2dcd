"""Parallel heads (`heads.kind: parallel`): Medusa-1, the baseline. Every head reads h_t alone, s_k = blocks_k(h_t),
each block x + silu(W x + b), zero-initialised so an untrained head starts as the target's own next-token guess; one
pass over the target's LM head scores all of them. Exported in vLLM's Medusa layout (`--format medusa`, vLLM <= 0.32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .blocks import OnTargetHeads, OnTargetOptions, ResBlock
from .heads import Export, ExportSource, register


@dataclass
class ParallelOptions(OnTargetOptions):
    pass


def medusa_files(heads: ParallelHeads, source: ExportSource) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) in vLLM's Medusa layout, with the target's LM head copied into each head."""
    spec = heads.spec
    lm_head = None if heads.lm_heads is not None else source.lm_head()
    state: dict[str, torch.Tensor] = {}
    for k, block in enumerate(heads.blocks):
        for i, res in enumerate(block):
            state[f"blocks.{k}.layers.{i}.weight"] = res.linear.weight.detach().float().cpu().contiguous()
            state[f"blocks.{k}.layers.{i}.bias"] = res.linear.bias.detach().float().cpu().contiguous()
        w = heads.lm_heads[k].weight if heads.lm_heads is not None else lm_head
        state[f"lm_heads.{k}.weight"] = w.detach().float().cpu().clone()  # one copy per head, as vLLM loads
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": spec.hidden_size,
              "vocab_size": spec.vocab_size, "num_heads": spec.num_heads, "num_hidden_layers": spec.layers_per_head,
              "max_paths": 64, "topk": 10, "truncated_vocab_size": None, "medusa_fc_bias": True,
              "torch_dtype": "float32"}
    return config, state


@register
class ParallelHeads(OnTargetHeads):
    kind = "parallel"
    Options = ParallelOptions
    chained = False
    exports = {"medusa": Export("vLLM <= 0.32", medusa_files, {"draft_vocab_size": 0, "context_layers": 0})}

    def __init__(self, spec):
        super().__init__(spec)
        d, o = spec.hidden_size, spec.options
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(d) for _ in range(o.layers_per_head)]) for _ in range(spec.num_heads))

    def step(self, k, s_prev, token_ids=None, embed=None):
        return self.blocks[k](s_prev)
