"""What eagle3 and dflash heads share: both are speculators' draft models. They read the target's states at a few layers
(`heads.aux_layers`, fused by their `fc`), own a norm and an LM head over the draft vocabulary (the target's rows,
frozen; the norm starts as the target's final one), hold their layers in a module of their own (`draft_model`, whose
tensor names are speculators 0.9's), and are written in speculators' format (`--format speculators`), which vLLM
serves and SGLang loads: `SpeculatorHeads` is their base, and the format's shared parts are here.

Their decoder layers' transformers config (`layer_config`) is sized like the target's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..target.model import decoder, text_config
from .heads import (DraftHeads, HeadsSpec, TargetLayersOptions, check_aux_layers, check_target_layers,
                    resolved_aux_layers)

SPECULATORS_VERSION = "0.9.0"


def _field(config: Any, name: str, default: Any = None) -> Any:
    """config.name, or `default` where it is missing or not one value (a per-layer attribute, as Gemma-4's head_dim,
    raises on global access: the draft layer then takes the default)."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error has no common base to catch
        return default


def llama_layer_config(target_config: Any) -> dict[str, Any]:
    """The draft layer's LlamaConfig, sized like the target (hidden size, heads, MLP width, rotary, norm eps), as
    the diff dict speculators writes for `transformer_layer_config`."""
    from transformers import LlamaConfig

    text = text_config(target_config)
    d, heads = text.hidden_size, text.num_attention_heads
    default = {"rope_type": "default", "rope_theta": 10000.0}
    rope = _field(text, "rope_parameters", None) or default
    if "sliding_attention" in rope or "full_attention" in rope:  # per-layer-type rotary: take the full one
        rope = rope.get("full_attention") or next((v for v in rope.values() if v), None) or default
    cfg = LlamaConfig(
        vocab_size=text.vocab_size, hidden_size=d, num_attention_heads=heads,
        num_key_value_heads=_field(text, "num_key_value_heads", None) or heads,
        head_dim=_field(text, "head_dim", None) or d // heads,
        intermediate_size=_field(text, "intermediate_size", None) or 4 * d,
        rms_norm_eps=_field(text, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=_field(text, "max_position_embeddings", 2048),
        rope_parameters=dict(rope), num_hidden_layers=1, hidden_act="silu", attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False)
    return cfg.to_diff_dict()


def init_draft(draft: nn.Module, std: float) -> None:
    """A draft model's start, as speculators' (eagle3 and dflash): every linear layer normal with the config's
    initializer_range; the LM head (`lm_head`: the target's rows of the draft vocabulary, `DraftHeads.for_target`)
    frozen, as speculators trains it (a trainable one cost a third of an eagle3 training step more on SmolLM2: its
    weight gradient)."""
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
    draft.lm_head.weight.requires_grad_(False)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [B, H, T, hd] with cos, sin [B, T, hd] (rotate-half form, as Llama's and Qwen3's
    `apply_rotary_pos_emb`)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class SpeculatorHeads(DraftHeads):
    """The base of eagle3 and dflash heads: `draft_model` (a module of speculators' layout, built by the kind, with
    `lm_head` and `norm`) reads the target's `aux_layers`."""

    Options = TargetLayersOptions

    @property
    def draft_model(self) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def check_options(cls, options: TargetLayersOptions) -> None:
        check_aux_layers(options.aux_layers)

    @classmethod
    def check_target(cls, options, target_config, trust_remote_code: bool = False) -> None:
        check_target_layers(cls.kind, options.aux_layers, target_config, trust_remote_code)

    @classmethod
    def resolve(cls, options, target_config, embedding=None, tokenizer=None):
        options.aux_layers = resolved_aux_layers(options.aux_layers, target_config)
        return options

    def init_from_target(self, target: nn.Module, draft_ids: torch.Tensor | None) -> None:
        """The LM head starts as the target's rows of the draft vocabulary (ascending ids, as speculators' t2d mask
        orders them), the final norm as the target's."""
        if draft_ids is not None:
            draft_ids = torch.sort(draft_ids).values
        super().init_from_target(target, draft_ids)
        out = target.get_output_embeddings().weight.float()
        draft = self.draft_model
        draft.lm_head.weight.copy_(out if draft_ids is None else out[draft_ids.to(out.device)])
        norm = getattr(decoder(target), "norm", None)
        if isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.shape == (self.spec.hidden_size,):
            draft.norm.weight.copy_(norm.weight.float())

    @property
    def target_layers(self) -> list[int]:
        return list(self.spec.aux_layers)

    @property
    def owns_lm_head(self) -> bool:
        return True

    def scoring_weight(self, k: int, lm_head: nn.Module | None = None) -> torch.Tensor:
        return self.draft_model.lm_head.weight


# ---------------------------------------------------------------------------------------------------
# speculators' format


def speculators_common(spec: HeadsSpec, algorithm: str, verifier: str, architectures: list[str], layer: dict[str, Any]
                       ) -> dict[str, Any]:
    """What every speculators 0.9 config holds: the proposal (a greedy chain of num_heads tokens), the verifier, the
    versions and the draft layers' transformers config."""
    return {
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": spec.num_heads, "verifier_accept_k": 1}],
            "verifier": {"architectures": list(architectures), "name_or_path": verifier},
        },
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "transformer_layer_config": layer,
        "torch_dtype": "float32",
    }


def speculators_tensors(heads: SpeculatorHeads, embed: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The heads' tensors under speculators' names, the draft vocabulary ordered by target id: `d2t` (target id = draft
    id + d2t[draft id]) and `t2d` (a mask over the target vocabulary); `embed_tokens.weight` the target's embedding
    when given."""
    spec = heads.spec
    state = {k: v.detach().float().cpu().contiguous() for k, v in heads.draft_model.state_dict().items()
             if not k.startswith("rotary_emb.")}
    if spec.draft_vocab_size:
        ids, order = torch.sort(heads.draft_ids.cpu())
        state["lm_head.weight"] = state["lm_head.weight"][order].contiguous()
        state["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    if embed is not None:
        state["embed_tokens.weight"] = embed.detach().float().cpu().contiguous()
    return state


def speculators_source_tensors(heads: SpeculatorHeads, source) -> dict[str, torch.Tensor]:
    """`speculators_tensors` with the target's embedding unless the export leaves it out (`--no-embed`)."""
    return speculators_tensors(heads, source.embedding() if source.embed else None)


def vocab_maps_to_draft_ids(state: dict[str, torch.Tensor], vocab: int) -> torch.Tensor | None:
    """The draft vocabulary (target ids, ascending) from a speculators checkpoint's `t2d` (None: the full
    vocabulary); removes the maps from `state`."""
    t2d = state.pop("t2d", None)
    state.pop("d2t", None)
    return torch.nonzero(t2d).flatten() if t2d is not None and int(t2d.sum()) < vocab else None



