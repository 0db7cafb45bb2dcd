"""Chained heads (`heads.kind: chained`, the default): each head reads the previous head's state and the embedding of
the token before the one it predicts, so each guess is conditioned on the guesses before it (Hydra, IBM's MLP
speculator, EAGLE), with one of two blocks (`heads.block`):

    s_0 = h_t;  s_k = block_k(s_{k-1}, embed(x_{t+k}));  logits_k = lm_head(s_k)

- `residual` (default): s = s_prev + silu(W [s_prev; embed(x)] + b), zero-initialised, so an untrained head starts as
  the target's own next-token guess and the state keeps the shape the target's LM head reads (Hydra-style). On
  SmolLM2 it learns far faster than the mlp_speculator block with the target's frozen LM head, whose GELU output
  cannot take negative values.
- `mlp_speculator`: exactly the step of IBM's MLP speculator, so the checkpoint exports to that format
  (`--format mlp_speculator`; vLLM served it up to 0.32 and removed it in 0.33, so no current serving engine loads
  it):
      s = proj_k(s_prev) + (emb_weight / state_weight) * embed(x)
      s = gelu(ln_k(s))                     # ln: RMS-normalise, then elementwise scale and shift

Heads with `heads.layers_per_head` > 1 follow each step with residual blocks; `heads.context_layers` adds the context
encoder (`medusa_train.kinds.blocks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import ExportError
from .blocks import OnTargetHeads, OnTargetOptions, ResBlock, SpeculatorNorm
from .heads import Export, ExportSource, register


@dataclass
class ChainedOptions(OnTargetOptions):
    block: Literal["residual", "mlp_speculator"] = "residual"
    """chained: `residual`: s_k = s_{k-1} + silu(W [s_{k-1}; embed(x)] + b), zero-initialised so a head starts as the
    target's own guess (learns fastest with the target's frozen LM head). `mlp_speculator`: IBM's MLP speculator step,
    exportable to its format (`--format mlp_speculator`, which vLLM no longer serves since 0.33)."""


class ResidualChainedBlock(nn.Module):
    """s = s_prev + silu(W [s_prev; e] + b), zero-initialised: starts by passing the previous state on."""

    def __init__(self, dim: int, extra_layers: int = 0):
        super().__init__()
        self.fc = nn.Linear(2 * dim, dim)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)
        self.extra = nn.ModuleList(ResBlock(dim) for _ in range(extra_layers))

    def forward(self, s_prev: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        s = s_prev + F.silu(self.fc(torch.cat([s_prev, e], dim=-1)))
        for block in self.extra:
            s = block(s)
        return s


class ChainedBlock(nn.Module):
    """One mlp_speculator step: s = gelu(ln(proj(s_prev) + c * e)), plus optional residual blocks."""

    def __init__(self, dim: int, emb_scale: float, extra_layers: int = 0):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln = SpeculatorNorm(dim)
        self.emb_scale = emb_scale
        self.extra = nn.ModuleList(ResBlock(dim) for _ in range(extra_layers))
        nn.init.eye_(self.proj.weight)  # start by carrying the previous state through
        # A small output scale makes an untrained head's guess nearly uniform instead of confidently wrong:
        # on SmolLM2-135M head 1 starts at KL ~28 nats from the target with scale 1 (uniform is ~10), and
        # after 60 steps is more accurate (top-1 0.14 vs 0.12).
        nn.init.constant_(self.ln.weight, 0.1)

    def forward(self, s_prev: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        s = F.gelu(self.ln(self.proj(s_prev) + self.emb_scale * e))
        for block in self.extra:
            s = block(s)
        return s


def mlp_speculator_files(heads: ChainedHeads, source: ExportSource) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """IBM's MLP speculator layout (config.json + tensors; vLLM <= 0.32). The target's frozen embedding and LM head are
    copied into every head, as that format keeps one per head."""
    spec = heads.spec
    emb = (heads.embed.weight if heads.embed is not None else source.embedding()).detach()
    state: dict[str, torch.Tensor] = {}
    for k, block in enumerate(heads.blocks):
        head_w = (heads.lm_heads[k].weight if heads.lm_heads is not None else source.lm_head()).detach()
        state[f"emb.{k}.weight"] = emb.float().cpu().clone()
        state[f"proj.{k}.weight"] = block.proj.weight.detach().float().cpu().clone()
        state[f"head.{k}.weight"] = head_w.float().cpu().clone()
        state[f"ln.{k}.weight"] = block.ln.weight.detach().float().cpu().clone()
        state[f"ln.{k}.bias"] = block.ln.bias.detach().float().cpu().clone()
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
        "vocab_size": spec.vocab_size, "emb_dim": spec.hidden_size, "inner_dim": spec.hidden_size,
        "n_predict": spec.num_heads, "top_k_tokens_per_head": [1] * spec.num_heads, "n_candidates": 1,
        "tie_weights": False, "scale_input": True, "torch_dtype": "float32",
    }
    return config, state


MLP_SPECULATOR_NEEDS = {"block": "mlp_speculator", "layers_per_head": 1, "draft_vocab_size": 0, "context_layers": 0}


@register
class ChainedHeads(OnTargetHeads):
    kind = "chained"
    Options = ChainedOptions
    exports = {"mlp_speculator": Export("vLLM <= 0.32; no current engine", mlp_speculator_files, MLP_SPECULATOR_NEEDS)}

    def __init__(self, spec):
        super().__init__(spec)
        d, K, o = spec.hidden_size, spec.num_heads, spec.options
        if o.block == "mlp_speculator":
            state_weight = 0.5 ** (0.5 / K)
            emb_weight = math.sqrt((1 - state_weight**2) * (d / 2))
            self.input_norm = SpeculatorNorm(d, affine=False)  # mlp_speculator's scale_input ln0
            self.blocks = nn.ModuleList(
                ChainedBlock(d, emb_weight / state_weight, o.layers_per_head - 1) for _ in range(K))
        else:
            self.blocks = nn.ModuleList(ResidualChainedBlock(d, o.layers_per_head - 1) for _ in range(K))

    def start(self, h: torch.Tensor) -> torch.Tensor:
        return self.input_norm(h) / math.sqrt(2) if hasattr(self, "input_norm") else h

    def step(self, k, s_prev, token_ids, embed=None):
        e = self.embed_tokens(token_ids, embed).to(s_prev.dtype)
        return self.blocks[k](s_prev, e)

    def export_mlp_speculator(self, directory, target: nn.Module) -> None:
        """Write an `mlp_speculator` checkpoint (config.json + model.safetensors) into `directory`, IBM's format
        (vLLM <= 0.32): `python -m medusa_train.export ... --format mlp_speculator` is the same with its checks."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        from ..base.files import CONFIG_NAME, WEIGHTS_NAME, atomic_write, atomic_write_text

        spec = self.spec
        if any(getattr(spec, k) != v for k, v in MLP_SPECULATOR_NEEDS.items()):
            raise ExportError("mlp_speculator export needs heads.kind=chained, heads.block=mlp_speculator, "
                              "heads.layers_per_head=1, heads.draft_vocab_size=0 and heads.context_layers=0")
        config, state = mlp_speculator_files(self, ExportSource(lambda: target.get_input_embeddings().weight,
                                                                lambda: target.get_output_embeddings().weight,
                                                                lambda: [], ""))
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
        atomic_write_text(path / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
