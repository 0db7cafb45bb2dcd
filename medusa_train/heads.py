"""Draft heads: chained (residual or mlp_speculator block) and parallel (Medusa-1), their save format and export.

Notation (docs/design.md): h_t is the target's final post-norm hidden state; head k (1-based) predicts
x_{t+1+k}. In code heads are indexed 0-based (`k = 0..K-1` is head k+1).

- chained: s_0 = h_t; s_k = block_k(s_{k-1}, embed(x_{t+k})); logits_k = lm_head(s_k), with one of two
  blocks (`heads.block`):
  - `residual` (default): s = s_prev + silu(W [s_prev; embed(x)] + b), zero-initialised, so an untrained
    head starts as the target's own next-token guess and the state keeps the shape the target's LM head
    reads (Hydra-style). On SmolLM2 it learns far faster than the mlp_speculator block with the target's
    frozen LM head, whose GELU output cannot take negative values.
  - `mlp_speculator`: exactly the step of IBM's MLP speculator, so the checkpoint exports to that format
    (`export_mlp_speculator`; vLLM served it up to 0.32 and removed it in 0.33, so no current serving engine
    loads it):
      s = proj_k(s_prev) + (emb_weight / state_weight) * embed(x)
      s = gelu(ln_k(s))                     # ln: RMS-normalise, then elementwise scale and shift
- parallel: s_k = blocks_k(h_t), each block x + silu(W x + b), zero-initialised so an untrained head
  starts as the target's own next-token guess.
- eagle3: EAGLE-3's draft layer (`medusa_train.eagle3`): the target's states at three layers fused by `fc`, one
  decoder layer applied step after step with its own KV cache, a final norm and its own LM head over the draft
  vocabulary; exported in speculators' format for vLLM and SGLang (`medusa_train.export`).
- dflash: DFlash's block drafter (`medusa_train.dflash`): the target's states at a few layers fused by `fc` as
  context, a few small decoder layers over a block of the anchor token and K mask tokens (non-causal within the
  block), one forward giving every depth's distribution; its own LM head over the draft vocabulary; exported in
  speculators' format for vLLM and SGLang.
- context (`heads.context_layers` > 0, EAGLE-style): the heads also see the whole committed context, not
  only h_t. At every position j a small causal transformer reads u_j = W [h_j; embed(x_{j+1})] (the
  target's state and the token it chose next) and gives c_t; the chain then starts from
  s_0 = h_t + c_t. The output projection is zero-initialised, so untrained context heads behave as
  plain ones. At inference the drafter keeps the layer's own small KV cache over committed positions
  (`ContextEncoder.extend`).

By default `embed` and `lm_head` are the target's own frozen modules, passed in at call time (never
stored here, so checkpoints hold only head weights).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .files import CONFIG_NAME, WEIGHTS_NAME, atomic_write, atomic_write_text, is_heads_dir
from .target import decoder, output_signature, target_fingerprint, text_config

FORMAT_VERSION = 1
FINGERPRINT_ATOL = 2e-3  # cosines move ~1e-5 between fp32/bf16 copies; another model's move ~1/sqrt(d)


class HeadsMismatchError(ValueError):
    """Heads were trained for another target (hidden size, vocab size or weights differ)."""


@dataclass
class HeadsSpec:
    """Everything needed to rebuild the heads; saved as `config.json` next to the weights."""

    kind: Literal["chained", "parallel", "eagle3", "dflash"]
    num_heads: int
    hidden_size: int
    vocab_size: int
    layers_per_head: int = 1
    block: Literal["residual", "mlp_speculator"] = "residual"
    own_embed: bool = False
    own_lm_head: bool = False
    draft_vocab_size: int = 0
    context_layers: int = 0
    aux_layers: list[int] = field(default_factory=list)
    """eagle3, dflash: the target layers whose states it reads (`medusa_train.eagle3.default_aux_layers`)."""
    layer_config: dict[str, Any] = field(default_factory=dict)
    """eagle3: its decoder layer's LlamaConfig (`medusa_train.eagle3.layer_config`); dflash: its layers' Qwen3Config
    (`medusa_train.dflash.layer_config`)."""
    mask_token_id: int = -1
    """dflash: the token whose (target's, frozen) embedding fills the block's K mask slots."""
    norms: list[str] = field(default_factory=list)
    """eagle3: the optional norms its layer has (`medusa_train.eagle3.NORMS`); none in heads saved before them."""
    target_name: str = ""
    target_fingerprint: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def scored_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of the target states the heads read per position: h_t, then the aux layers' states (eagle3)."""
        return self.hidden_size * (1 + len(self.aux_layers))


# ---------------------------------------------------------------------------------------------------
# Target fingerprint


def fingerprint_difference(expected: dict[str, Any], got: dict[str, Any], target: nn.Module | None = None
                           ) -> str | None:
    """None when `got` is the same target as `expected` (signatures within FINGERPRINT_ATOL, so copies in
    another dtype match); else what differs, as the tail of a sentence. When `expected` records an adapter, `target`
    (whose fingerprint `got` is) is run once to tell the adapted model from its bare base: the nearer of the two
    recorded output signatures decides."""
    for key in ("hidden_size", "vocab_size"):
        if key in expected and expected[key] != got.get(key):
            return f"{key} is {got.get(key)}, expected {expected[key]}"
    for key in ("embed_signature", "lm_head_signature"):
        if key in expected:
            diff = max(abs(a - b) for a, b in zip(expected[key], got[key]))
            if diff > FINGERPRINT_ATOL:
                what = "embedding" if key == "embed_signature" else "LM head"
                return f"its {what} weights differ (signature off by {diff:.3g})"
    want, have = expected.get("adapter"), got.get("adapter")
    if want:
        # without a target to run, a fingerprint with no adapter is the bare base's
        sig = have["adapted_signature"] if have else output_signature(target) if target is not None else None

        def gap(ref: list[float]) -> float:
            return max(abs(a - b) for a, b in zip(ref, sig))

        if sig is None or gap(want["base_signature"]) < gap(want["adapted_signature"]):
            return (f"it is the bare base model, but they were trained for it with the adapter {want['path']} "
                    "merged in: load the target with that adapter (SpeculativeGenerator.from_pretrained(heads_dir) "
                    "does, and target.adapter in a recipe)")
    elif have:
        return (f"it has the adapter {have['path']} merged in, but they were made for the bare base model: load the "
                "target without it, or train for the adapted model (target.adapter)")
    return None


def check_fingerprint(expected: dict[str, Any], target: nn.Module, target_name: str = "") -> None:
    """Raise HeadsMismatchError naming the first property in which `target` differs from `expected`."""
    diff = fingerprint_difference(expected, target_fingerprint(target), target)
    if diff is not None:
        where = f" (heads were trained for {target_name})" if target_name else ""
        raise HeadsMismatchError(f"heads do not fit this target: {diff}{where}")


# ---------------------------------------------------------------------------------------------------
# Blocks


class SpeculatorNorm(nn.Module):
    """RMS normalisation with elementwise scale and shift, as the MLP speculator's layer norm."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        if self.weight is not None:
            y = y * self.weight + self.bias
        return y


class ResBlock(nn.Module):
    """x + silu(W x + b), zero-initialised so the block starts as the identity (Medusa-1)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


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


# ---------------------------------------------------------------------------------------------------
# Context encoder (heads.context_layers > 0)

ROPE_THETA = 10000.0
ContextCache = list  # per layer: (keys, values), each [B, heads, positions, head_dim]


def context_num_heads(dim: int) -> int:
    """Attention heads of width 64 where the hidden size allows it, else one head."""
    return dim // 64 if dim % 64 == 0 else 1


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [B, H, T, hd] at integer positions [T] (rotate-half form)."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq  # [T, half]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:2 * half]
    out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([out, x[..., 2 * half:]], dim=-1) if x.shape[-1] % 2 else out


class ContextLayer(nn.Module):
    """A pre-norm causal transformer layer: rotary self-attention, then a SiLU-gated MLP."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = SpeculatorNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = SpeculatorNorm(dim)
        inner = 2 * dim
        self.gate_up = nn.Linear(dim, 2 * inner, bias=False)
        self.down = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, T, d] at `positions` [T]; `past` the keys/values of earlier positions (inference).
        Returns (x after the layer, keys/values including these positions)."""
        B, T, d = x.shape
        H = self.num_heads
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, H, d // H).permute(2, 0, 3, 1, 4)  # [B, H, T, hd]
        q, k = _rotate(q, positions), _rotate(k, positions)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        P = k.shape[2] - T  # earlier positions: every new row sees all of them
        if P == 0:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        elif T == 1:
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            allowed = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.attn_out(a.transpose(1, 2).reshape(B, T, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), (k, v)


class ContextEncoder(nn.Module):
    """c_t from the committed context: causal layers over u_j = W [h_j; embed(x_{j+1})], j <= t.

    `forward` is the teacher-forced form over whole sequences (training); `extend` appends committed
    positions to a KV cache and returns c at the last one (inference). Both compute the same numbers.
    """

    def __init__(self, dim: int, num_layers: int):
        super().__init__()
        self.fc_in = nn.Linear(2 * dim, dim)
        self.layers = nn.ModuleList(ContextLayer(dim, context_num_heads(dim)) for _ in range(num_layers))
        self.out_norm = SpeculatorNorm(dim)
        self.out = nn.Linear(dim, dim)
        nn.init.zeros_(self.out.weight)  # c starts at 0: untrained context heads are plain heads
        nn.init.zeros_(self.out.bias)

    def forward(self, h: torch.Tensor, e_next: torch.Tensor) -> torch.Tensor:
        """h [B, T, d] and embed(x_{t+1}) [B, T, d] -> c [B, T, d] (right padding is harmless: causal)."""
        x = self.fc_in(torch.cat([h, e_next], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)
        for layer in self.layers:
            x, _ = layer(x, positions)
        return self.out(self.out_norm(x))

    def extend(self, h: torch.Tensor, e_next: torch.Tensor, cache: ContextCache | None
               ) -> tuple[torch.Tensor, ContextCache]:
        """Append n committed positions (h [n, d], embed of the token after each [n, d]) to `cache` (None
        for a new sequence); returns (c at the last of them [1, d], the grown cache)."""
        x = self.fc_in(torch.cat([h, e_next], dim=-1))[None]  # [1, n, d]
        start = 0 if cache is None else cache[0][0].shape[2]
        positions = torch.arange(start, start + x.shape[1], device=x.device)
        grown: ContextCache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, None if cache is None else cache[i])
            grown.append(kv)
        return self.out(self.out_norm(x[0, -1:])), grown


# ---------------------------------------------------------------------------------------------------
# The heads


class DraftHeads(nn.Module):
    """K draft heads on a frozen target. Holds only head weights; target modules are passed in."""

    def __init__(self, spec: HeadsSpec):
        super().__init__()
        self.spec = spec
        d, K = spec.hidden_size, spec.num_heads
        if spec.kind == "chained" and spec.block == "mlp_speculator":
            state_weight = 0.5 ** (0.5 / K)
            emb_weight = math.sqrt((1 - state_weight**2) * (d / 2))
            self.input_norm = SpeculatorNorm(d, affine=False)  # mlp_speculator's scale_input ln0
            self.blocks = nn.ModuleList(
                ChainedBlock(d, emb_weight / state_weight, spec.layers_per_head - 1) for _ in range(K))
        elif spec.kind == "chained" and spec.block == "residual":
            self.blocks = nn.ModuleList(ResidualChainedBlock(d, spec.layers_per_head - 1) for _ in range(K))
        elif spec.kind == "parallel":
            self.blocks = nn.ModuleList(
                nn.Sequential(*[ResBlock(d) for _ in range(spec.layers_per_head)]) for _ in range(K))
        elif spec.kind == "eagle3":
            from .eagle3 import Eagle3Draft

            if not spec.aux_layers or not spec.layer_config:
                raise ValueError("eagle3 heads need aux_layers and layer_config in their config.json")
            self.eagle3 = Eagle3Draft(spec.layer_config, len(spec.aux_layers), spec.scored_vocab, tuple(spec.norms))
        elif spec.kind == "dflash":
            from .dflash import DFlashDraft

            if not spec.aux_layers or not spec.layer_config or spec.mask_token_id < 0:
                raise ValueError("dflash heads need aux_layers, layer_config and mask_token_id in their config.json")
            self.dflash = DFlashDraft(spec.layer_config, len(spec.aux_layers), spec.scored_vocab, K,
                                      spec.mask_token_id)
        else:
            raise ValueError(f"heads.kind must be 'chained', 'parallel', 'eagle3' or 'dflash' and heads.block "
                             f"'residual' or 'mlp_speculator', got {spec.kind!r} / {spec.block!r}")
        self.context = ContextEncoder(d, spec.context_layers) if spec.context_layers else None
        self.embed = nn.Embedding(spec.vocab_size, d) if spec.own_embed else None
        self.lm_heads = (nn.ModuleList(nn.Linear(d, spec.scored_vocab, bias=False) for _ in range(K))
                         if spec.own_lm_head else None)
        # draft id -> target id; an identity map (length 0) when the heads score the full vocabulary.
        self.register_buffer("draft_ids", torch.zeros(spec.draft_vocab_size, dtype=torch.long))

    # -- construction ---------------------------------------------------------------------------------

    @classmethod
    def for_target(cls, target: nn.Module, kind: str = "chained", num_heads: int = 4, layers_per_head: int = 1,
                   own_embed: bool = False, own_lm_head: bool = False, draft_ids: torch.Tensor | None = None,
                   target_name: str = "", block: str = "residual", context_layers: int = 0,
                   aux_layers: list[int] | None = None, norms: Sequence[str] = (), mask_token_id: int | None = None
                   ) -> DraftHeads:
        """Fresh heads sized for `target`; owned embed / LM heads start as copies of the target's. eagle3 and dflash
        read the target at `aux_layers` (default: `medusa_train.eagle3.default_aux_layers`); eagle3 has the optional
        `norms`; dflash has `layers_per_head` decoder layers and fills its block with `mask_token_id`."""
        emb = target.get_input_embeddings().weight
        out = target.get_output_embeddings().weight
        reader: dict[str, Any] = {}  # the spec fields of heads that read the target's layers
        if kind == "eagle3":
            from .eagle3 import spec_fields

            reader = spec_fields(target.config, aux_layers, norms)
        elif kind == "dflash":
            from .dflash import spec_fields as dflash_fields

            if mask_token_id is None:  # the trainer resolves it from the tokenizer (`dflash.resolve_mask_token`)
                from .dflash import default_mask_token

                mask_token_id = default_mask_token(text_config(target.config), emb)
            reader = dflash_fields(target.config, layers_per_head, aux_layers, mask_token_id)
        if kind in ("eagle3", "dflash"):
            if draft_ids is not None:  # ascending, as speculators' t2d mask orders the draft vocabulary
                draft_ids = torch.sort(draft_ids).values
        spec = HeadsSpec(kind=kind, num_heads=num_heads, hidden_size=emb.shape[1], vocab_size=out.shape[0],
                         layers_per_head=layers_per_head, block=block, own_embed=own_embed, own_lm_head=own_lm_head,
                         draft_vocab_size=0 if draft_ids is None else len(draft_ids),
                         context_layers=context_layers, target_name=target_name,
                         target_fingerprint=target_fingerprint(target), **reader)
        heads = cls(spec)
        with torch.no_grad():
            if draft_ids is not None:
                heads.draft_ids.copy_(draft_ids)
            if kind in ("eagle3", "dflash"):  # its LM head starts as the target's rows, its norm as the target's final
                draft = heads.eagle3 if kind == "eagle3" else heads.dflash
                rows = out.float() if draft_ids is None else out.float()[draft_ids.to(out.device)]
                draft.lm_head.weight.copy_(rows)
                norm = getattr(decoder(target), "norm", None)
                if isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.shape == (emb.shape[1],):
                    draft.norm.weight.copy_(norm.weight.float())
            if heads.embed is not None:
                heads.embed.weight.copy_(emb.float())
            if heads.lm_heads is not None:
                rows = out.float() if draft_ids is None else out.float()[draft_ids.to(out.device)]
                for lin in heads.lm_heads:
                    lin.weight.copy_(rows)
        return heads

    # -- the math -------------------------------------------------------------------------------------

    def embed_tokens(self, token_ids: torch.Tensor, embed: nn.Module | None) -> torch.Tensor:
        if self.embed is not None:
            return self.embed(token_ids)
        if embed is None:
            raise ValueError("these heads use the target's embedding: pass embed=target.get_input_embeddings()")
        return embed(token_ids)

    def start(self, h: torch.Tensor) -> torch.Tensor:
        """s_0 from the target's hidden state h_t (mlp_speculator: parameter-free input scaling)."""
        return self.input_norm(h) / math.sqrt(2) if hasattr(self, "input_norm") else h

    def step(self, k: int, s_prev: torch.Tensor, token_ids: torch.Tensor | None,
             embed: nn.Module | None = None) -> torch.Tensor:
        """Head k's state (0-based k). Chained: from s_{k-1} and token x_{t+k}; parallel: from h_t = s_prev
        (pass `start(h)` and ignore tokens)."""
        if self.spec.kind == "parallel":
            return self.blocks[k](s_prev)
        e = self.embed_tokens(token_ids, embed).to(s_prev.dtype)
        return self.blocks[k](s_prev, e)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module | None = None) -> torch.Tensor:
        """Teacher-forced states for training: [K, B, T, d] where states[k, :, t] is head k+1's state at
        position t, having read tokens x_{t+1}..x_{t+k+1} (positions past the end see padding; mask them).
        With a context encoder, position t also reads (h_j, x_{j+1}) for every j <= t. eagle3 heads take the target's
        features (h, then the aux layers' states: [B, T, feature_size]) and return what their LM head scores,
        norm(s^k) (`medusa_train.eagle3`)."""
        if self.spec.kind == "eagle3":  # h: the features [B, T, (1 + A) d]; the chain reads the aux layers
            e = self.embed_tokens(input_ids, embed).to(h.dtype)
            return self.eagle3.ttt_states(h[..., self.spec.hidden_size:], e, self.spec.num_heads)
        if self.spec.kind == "dflash":  # every position is an anchor (evaluation); training draws some
            B, T = input_ids.shape
            return self.dflash_states(h, input_ids, torch.arange(T, device=h.device).expand(B, T), None, embed)
        s0 = self.start(h)
        chained = self.spec.kind == "chained"
        if chained or self.context is not None:  # plain parallel heads read no tokens
            e = self.embed_tokens(input_ids, embed).to(h.dtype)  # [B, T, d]
        if self.context is not None:  # s_0 = h_t + c_t, c_t reading (h_j, x_{j+1}) for j <= t
            s0 = s0 + self.context(h, F.pad(e[:, 1:], (0, 0, 0, 1)))
        if not chained:
            return torch.stack([block(s0) for block in self.blocks])
        states, s = [], s0
        for k, block in enumerate(self.blocks):
            # head k+1 at position t reads the embedding of x_{t+k+1}: shift left by k+1, zero-pad the end
            e_k = F.pad(e[:, k + 1:], (0, 0, 0, k + 1))
            s = block(s, e_k)
            states.append(s)
        return torch.stack(states)

    def dflash_states(self, h: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                      attention_mask: torch.Tensor | None, embed: nn.Module | None = None) -> torch.Tensor:
        """dflash: the block slots' states [K, B, N, d] for the blocks after positions `anchors` [B, N] (slot k+1 of
        the block after t, head k's state at t, guesses x_{t+2+k}); h the target's features [B, T, feature_size]."""
        ids = input_ids.gather(1, (anchors + 1).clamp_max(input_ids.shape[1] - 1))  # the anchor tokens x_{t+1}
        e = self.embed_tokens(ids, embed).to(h.dtype)
        mask = self.embed_tokens(torch.tensor([self.spec.mask_token_id], device=h.device), embed)[0]
        return self.dflash.anchored_states(h[..., self.spec.hidden_size:], e, mask, anchors, attention_mask)

    def scoring_weight(self, k: int, lm_head: nn.Module | None = None) -> torch.Tensor:
        """The [V_scored, d] matrix head k's logits come from: its own LM head, or the target's (rows of the
        draft vocabulary if set). Callers that score often may gather it once and keep it."""
        if self.lm_heads is not None:
            return self.lm_heads[k].weight
        if self.spec.kind == "eagle3":
            return self.eagle3.lm_head.weight
        if self.spec.kind == "dflash":
            return self.dflash.lm_head.weight
        if lm_head is None:
            raise ValueError("these heads use the target's LM head: pass lm_head=target.get_output_embeddings()")
        return lm_head.weight[self.draft_ids] if self.spec.draft_vocab_size else lm_head.weight

    @property
    def owns_lm_head(self) -> bool:
        """Whether the heads score with LM heads of their own (else the target's, passed in at call time)."""
        return self.lm_heads is not None or self.spec.kind in ("eagle3", "dflash")

    def logits(self, k: int, states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Head k's logits over the scored vocabulary (the draft vocab if set): [..., V_draft]."""
        return F.linear(states, self.scoring_weight(k, lm_head))

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Map indices into the scored vocabulary back to target token ids."""
        return self.draft_ids[ids] if self.spec.draft_vocab_size else ids

    # -- save / load ----------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """Write config.json and model.safetensors (heads only). Both are written to temp files first and
        renamed, so a crash never leaves a half-written file under the final name."""
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        config = asdict(self.spec) | (extra or {})
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
        atomic_write_text(path / CONFIG_NAME, json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, target: nn.Module | None = None,
                        device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> DraftHeads:
        """Load heads; with `target`, first check they were trained for it (HeadsMismatchError if not)."""
        from safetensors.torch import load_file

        path = Path(directory)
        spec = load_spec(path)
        if target is not None:
            check_fingerprint(spec.target_fingerprint, target, spec.target_name)
        heads = cls(spec)
        try:
            state = load_file(str(path / WEIGHTS_NAME))
        except Exception as e:  # noqa: BLE001 - safetensors reports a damaged file in several error types
            raise ValueError(f"{path / WEIGHTS_NAME} cannot be read ({str(e).splitlines()[0][:120]}): the file is "
                             "damaged or incomplete; train again or use a checkpoint") from None
        bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise ValueError(f"{path / WEIGHTS_NAME} holds non-finite weights ({bad[0]}): these heads diverged in "
                             "training; use an earlier checkpoint or retrain with a lower train.lr")
        heads.load_state_dict(state)
        return heads.to(device=device, dtype=dtype) if (device or dtype) else heads

    def export_mlp_speculator(self, directory: str | os.PathLike, target: nn.Module) -> None:
        """Write an `mlp_speculator` checkpoint (config.json + model.safetensors), IBM's format (vLLM <= 0.32).

        The target's frozen embedding and LM head are copied into every head, as that format keeps one
        per head. Needs chained heads with one layer per head and the full vocabulary.
        """
        from safetensors.torch import save_file

        spec = self.spec
        if spec.kind != "chained" or spec.block != "mlp_speculator" or spec.layers_per_head != 1 \
                or spec.draft_vocab_size or spec.context_layers:
            raise ValueError("mlp_speculator export needs heads.kind=chained, heads.block=mlp_speculator, "
                             "heads.layers_per_head=1, heads.draft_vocab_size=0 and heads.context_layers=0")
        emb = (self.embed.weight if self.embed is not None else target.get_input_embeddings().weight).detach()
        state: dict[str, torch.Tensor] = {}
        for k, block in enumerate(self.blocks):
            head_w = (self.lm_heads[k].weight if self.lm_heads is not None
                      else target.get_output_embeddings().weight).detach()
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
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
        atomic_write_text(path / CONFIG_NAME, json.dumps(config, indent=2) + "\n")


def load_spec(directory: str | os.PathLike) -> HeadsSpec:
    """The heads' config.json; FileNotFoundError if `directory` is not a heads directory."""
    if not is_heads_dir(directory):
        raise FileNotFoundError(f"{directory} is not a heads directory: expected {CONFIG_NAME} and {WEIGHTS_NAME} "
                                "(written by train.py)")
    raw = json.loads((Path(directory) / CONFIG_NAME).read_text())
    if raw.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{directory} was written by a newer medusa-train (format {raw['format_version']})")
    names = set(HeadsSpec.__dataclass_fields__)
    missing = [k for k in ("kind", "num_heads", "hidden_size", "vocab_size") if k not in raw]
    if missing:
        raise ValueError(f"{Path(directory) / CONFIG_NAME} is not a draft heads config (no {', '.join(missing)}): "
                         "is this a model directory? Name the directory train.py wrote the heads to")
    adapter = (raw.get("target_fingerprint") or {}).get("adapter")
    if adapter and not Path(os.path.expanduser(adapter["path"])).is_absolute():  # saved next to the heads (target.lora)
        adapter["path"] = str(Path(directory).resolve() / adapter["path"])
    return HeadsSpec(**{k: v for k, v in raw.items() if k in names})
