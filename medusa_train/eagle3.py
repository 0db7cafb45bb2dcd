"""EAGLE-3 draft layer (`heads.kind: eagle3`): the math of `speculators`' Eagle3DraftModel, trained and drafted here.

Notation (docs/design.md). The target's states at A layers (`aux_layers`, default a low, a middle and a high one)
at committed position j are fused into g_j = fc([a_j^1; ...; a_j^A]). One Llama decoder layer D, applied step after
step, reads the token embedding and a state:

    step 0 at position t:  s^0_t = D(embed(x_{t+1}), g_t)          attends to step-0 entries of positions <= t
    step k at position t:  s^k_t = D(embed(x_{t+1+k}), s^{k-1}_t)  attends to those and to steps 1..k at t
    logits of step k:      lm_head(norm(s^k_t)), guessing x_{t+2+k}

D's first layer takes [input_layernorm(e); hidden_norm(s)] (2d wide) into its q/k/v projections, its residual is s,
and its rotary position for step k at t is t+1+k (the position of the token it reads). The LM head scores the draft
vocabulary (the target's rows, frozen). The optional norms of speculators' trainer (EAGLE-3.1's; `NORMS`:
norm_before_fc, norm_before_residual, norm_output) are the heads' `norms`. Parameter names and rotary are
speculators 0.9's, so `medusa_train.export --format speculators` only renames the vocabulary maps and writes the
norm flags. In our head numbering step k is head k+1.

Training (`ttt_states`) runs the K steps over whole sequences, each step reading the previous step's own states,
with the attention pattern inference sees ("training-time test"). Inference keeps D's keys and values of the
committed positions (`extend`); a tree node at depth k runs step k (`tree_step`) and attends to that cache and to
its own ancestors' entries, which it carries along with its state.

Transformers' own Llama modules are used for the layer, norms and rotary; the imports live here only.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from .config import EAGLE3_NORMS
from .target import text_config

Cache = tuple[torch.Tensor, torch.Tensor]  # keys, values of committed positions: each [kv_heads, P, head_dim]


NORMS = EAGLE3_NORMS
"""speculators' optional norms (EAGLE-3.1's), as vLLM reads them from the config: `norm_before_fc` normalises the
concatenated aux states before `fc` (`input_norm`); `norm_before_residual` makes hidden_norm(s) the layer's residual;
`norm_output` feeds norm(s^k) (what the LM head scores) to step k+1 instead of s^k."""


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default layers [2, L//2, L-3] (a layer id i is the input of decoder layer i, as vLLM and speculators
    count), or, for targets too shallow for those to be distinct, up to three evenly spaced distinct ids in [1, L]."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 1:
        return ids
    n = min(3, num_layers)
    return sorted({round(1 + i * (num_layers - 1) / max(n - 1, 1)) for i in range(n)})


def _field(config: Any, name: str, default: Any = None) -> Any:
    """config.name, or `default` where it is missing or not one value (a per-layer attribute, as Gemma-4's head_dim,
    raises on global access: the draft layer then takes the default)."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error has no common base to catch
        return default


def layer_config(target_config: Any) -> dict[str, Any]:
    """The draft layer's LlamaConfig, sized like the target (hidden size, heads, MLP width, rotary, norm eps), as
    the diff dict speculators writes for `transformer_layer_config`."""
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


def spec_fields(target_config: Any, aux_layers: list[int] | None = None, norms: Sequence[str] = ()) -> dict[str, Any]:
    """The eagle3 fields of a `HeadsSpec` for a target of this config: `aux_layers` (default `default_aux_layers`),
    `layer_config` and `norms` (in `NORMS` order)."""
    layers = text_config(target_config).num_hidden_layers
    return {"aux_layers": list(aux_layers or default_aux_layers(layers)), "layer_config": layer_config(target_config),
            "norms": [n for n in NORMS if n in norms]}


def llama_config(layer: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(**{k: v for k, v in layer.items() if k not in ("model_type", "transformers_version")})


class Eagle3Layer(LlamaDecoderLayer):
    """The first (and only) draft decoder layer: q/k/v read [input_layernorm(e); hidden_norm(s)] (2d wide) and the
    residual is s (hidden_norm(s) with `norm_before_residual`). The attention is written here (the training and tree
    patterns are not causal); the projections, norms and MLP are Llama's own modules, so the state dict has
    speculators' names."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False):
        super().__init__(config, 0)
        self.norm_before_residual = norm_before_residual
        d, hd = config.hidden_size, config.head_dim
        self.hidden_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * d, config.num_attention_heads * hd, bias=False)
        attn.k_proj = nn.Linear(2 * d, config.num_key_value_heads * hd, bias=False)
        attn.v_proj = nn.Linear(2 * d, config.num_key_value_heads * hd, bias=False)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd

    def project(self, e: torch.Tensor, s: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, hd], k and v [B, Hkv, T, hd] (rotated) for embeddings e and states s [B, T, d]."""
        B, T, _ = e.shape
        x = torch.cat([self.input_layernorm(e), self.hidden_norm(s)], dim=-1)
        attn = self.self_attn
        q = attn.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The layer's output from the attention's output a [B, H, T, hd] and the state s [B, T, d] it read."""
        B, H, T, hd = a.shape
        residual = self.hidden_norm(s) if self.norm_before_residual else s
        x = residual + self.self_attn.o_proj(a.transpose(1, 2).reshape(B, T, H * hd))
        return x + self.mlp(self.post_attention_layernorm(x))


def init_draft(draft: nn.Module, std: float) -> None:
    """A draft model's start, as speculators' (eagle3 and dflash): every linear layer normal with the config's
    initializer_range; the LM head (`lm_head`: the target's rows of the draft vocabulary, `DraftHeads.for_target`)
    frozen, as speculators trains it (a trainable one cost a third of an eagle3 training step more on SmolLM2: its
    weight gradient)."""
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
    draft.lm_head.weight.requires_grad_(False)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[..., H, hd] -> [..., Hkv, H/Hkv, hd]: the query heads that share each key/value head."""
    *lead, H, hd = q.shape
    return q.view(*lead, kv_heads, H // kv_heads, hd)


class Eagle3Draft(nn.Module):
    """fc, one Eagle3Layer, the final norm and the LM head over the draft vocabulary (speculators' layout), with the
    optional `norms` (`NORMS`)."""

    def __init__(self, layer: dict[str, Any], num_aux: int, scored_vocab: int, norms: tuple[str, ...] = ()):
        super().__init__()
        unknown = sorted(set(norms) - set(NORMS))
        if unknown:
            raise ValueError(f"unknown eagle3 norm {unknown[0]!r}: the choices are {', '.join(NORMS)}")
        config = llama_config(layer)
        d = config.hidden_size
        self.input_norm = LlamaRMSNorm(num_aux * d, eps=config.rms_norm_eps) if "norm_before_fc" in norms else None
        self.norm_output = "norm_output" in norms
        self.fc = nn.Linear(num_aux * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config, "norm_before_residual" in norms)])
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, scored_vocab, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)  # no parameters; its buffers are not saved
        init_draft(self, config.initializer_range)

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, hd] at positions [B, T] (or [T])."""
        if positions.dim() == 1:
            positions = positions[None]
        return self.rotary_emb(x, positions)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """g = fc(aux) (fc(input_norm(aux)) with `norm_before_fc`): the state step 0 reads."""
        return self.fc(aux if self.input_norm is None else self.input_norm(aux))

    def output(self, s: torch.Tensor) -> torch.Tensor:
        """The state a step passes on from its layer's output s: s, or norm(s) with `norm_output`."""
        return self.norm(s) if self.norm_output else s

    def scoring_input(self, s: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of a step's state: norm(s) (already applied with `norm_output`)."""
        return s if self.norm_output else self.norm(s)

    # -- training ---------------------------------------------------------------------------------------

    def ttt_states(self, aux: torch.Tensor, embeds: torch.Tensor, steps: int) -> torch.Tensor:
        """norm(s^k_t) for k = 0..steps-1: [steps, B, T, d] from aux [B, T, A*d] (the target's layers at every
        position) and embeds [B, T, d] (embed(x_t)). Step k at t reads embed(x_{t+1+k}) (zero past the end: mask
        those positions) and attends causally to step 0 and to steps 1..k at t alone."""
        B, T, d = embeds.shape
        layer = self.layer
        s = self.fuse(aux)
        idx = torch.arange(T, device=s.device)
        causal = idx[:, None] >= idx[None, :]  # [T, T]
        diagonal = idx[:, None] == idx[None, :]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out = []
        for k in range(steps):
            e = F.pad(embeds[:, k + 1:], (0, 0, 0, k + 1))  # embed(x_{t+1+k})
            cos, sin = self.rotary(s, idx + 1 + k)
            q, kk, vv = layer.project(e, s, cos, sin)
            keys.append(kk)
            values.append(vv)
            mask = torch.cat([causal] + [diagonal] * k, dim=1)  # [T, (k+1) T]
            a = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                               scale=layer.self_attn.scaling, enable_gqa=True)
            s = self.output(layer.finish(a, s))
            out.append(self.scoring_input(s))
        return torch.stack(out)

    # -- inference --------------------------------------------------------------------------------------

    def extend(self, aux: torch.Tensor, e_next: torch.Tensor, cache: Cache | None) -> tuple[torch.Tensor, Cache]:
        """Append n committed positions (aux [n, A*d], the embedding of the token after each [n, d]) to `cache`
        (None: a new sequence); returns (s^0 at the last of them [1, d], the grown cache). Entry j sits at rotary
        position j+1."""
        layer = self.layer
        start = 0 if cache is None else cache[0].shape[1]
        n = aux.shape[0]
        s = self.fuse(aux)[None]  # [1, n, d]
        positions = torch.arange(start + 1, start + 1 + n, device=s.device)
        q, k, v = layer.project(e_next[None], s, *self.rotary(s, positions))
        if cache is not None:
            k, v = torch.cat([cache[0][None], k], dim=2), torch.cat([cache[1][None], v], dim=2)
        if start == 0:
            mask = None
        else:
            mask = torch.ones(n, start + n, dtype=torch.bool, device=s.device).tril(start)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n > 1,
                                           scale=layer.self_attn.scaling, enable_gqa=True)
        out = self.output(layer.finish(a[:, :, -1:], s[:, -1:]))
        return out[0], (k[0], v[0])

    def kv_width(self) -> int:
        layer = self.layer
        return layer.num_kv_heads * layer.head_dim

    def tree_step(self, e: torch.Tensor, s: torch.Tensor, path_k: torch.Tensor, path_v: torch.Tensor, cache: Cache,
                  position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step k for M tree nodes at depth k >= 1: e [M, d] their tokens' embeddings, s [M, d] their parents'
        outputs, path_k / path_v [M, k-1, Hkv, hd] their ancestors' (depths 1..k-1) keys and values; all at rotary
        `position` (the committed length + k). Returns (s^k [M, d], this step's keys and values [M, Hkv, hd])."""
        layer = self.layer
        M = e.shape[0]
        positions = torch.full((M, 1), position, device=e.device)
        q, k, v = layer.project(e[:, None], s[:, None], *self.rotary(s[:, None], positions))  # [M, H|Hkv, 1, hd]
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        qg = _grouped(q, layer.num_kv_heads) * layer.self_attn.scaling  # [M, Hkv, G, hd]
        ck, cv = cache  # [Hkv, P, hd]
        scores_c = torch.einsum("mkgd,kpd->mkgp", qg, ck)
        pk = torch.cat([path_k, k[:, None]], dim=1)  # [M, k, Hkv, hd]: ancestors, then itself
        pv = torch.cat([path_v, v[:, None]], dim=1)
        scores_p = torch.einsum("mkgd,mjkd->mkgj", qg, pk)
        scores = torch.cat([scores_c, scores_p], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        P = ck.shape[1]
        a = torch.einsum("mkgp,kpd->mkgd", probs[..., :P], cv) + torch.einsum("mkgj,mjkd->mkgd", probs[..., P:], pv)
        a = a.reshape(M, layer.num_heads, 1, layer.head_dim)
        return self.output(layer.finish(a, s[:, None]))[:, 0], k, v
