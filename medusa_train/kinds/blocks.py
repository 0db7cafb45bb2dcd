"""What chained and parallel heads share: they read h_t (and, with `heads.context_layers`, the committed context) and
score with the target's frozen LM head (or LM heads of their own, `heads.own_lm_head`), over the draft vocabulary's rows
when there is one. Their blocks, the EAGLE-style context encoder, and `OnTargetHeads`, the base of both kinds.

- context (`heads.context_layers` > 0, EAGLE-style): the heads also see the whole committed context, not
  only h_t. At every position j a small causal transformer reads u_j = W [h_j; embed(x_{j+1})] (the
  target's state and the token it chose next) and gives c_t; the chain then starts from
  s_0 = h_t + c_t. The output projection is zero-initialised, so untrained context heads behave as
  plain ones. At inference the drafter keeps the layer's own small KV cache over committed positions
  (`ContextEncoder.extend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import ConfigError
from .heads import DraftHeads, Drafting


@dataclass
class OnTargetOptions:
    layers_per_head: int = 1
    """Blocks per head (the mlp_speculator export needs 1). dflash: its decoder layers."""
    own_embed: bool = False
    """chained and parallel: give the heads their own (trainable) token embedding instead of the target's frozen
    one."""
    own_lm_head: bool = False
    """chained and parallel: give each head its own (trainable) LM head instead of the target's frozen one."""
    context_layers: int = 0
    """chained and parallel: if > 0, an EAGLE-style context encoder: this many small causal transformer layers over
    every committed position's (h_j, embed(x_{j+1})) give c_t, and the heads start from s_0 = h_t + c_t instead of
    h_t alone (at inference the drafter keeps its own KV cache). 0: heads read h_t only."""


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
# The base of chained and parallel heads


class OnTargetHeads(DraftHeads):
    """Heads on h_t: K blocks (`self.blocks`, built by the kind), an optional context encoder, optional own embedding
    and LM heads. `chained`: whether head k reads head k-1's state and the token x_{t+k} (else every head reads h_t
    alone)."""

    chained = True
    served_by_plugin = True
    train_defaults = {"warmup_steps": 0.1}  # the panel's choice for both kinds (docs/training.md, "The lr")

    @classmethod
    def default_lr(cls, hidden_size: int) -> float:
        """3 / the target's width (the panel's choice for chained and parallel heads, docs/training.md "The lr"): a
        step of Adam moves a block's output by about lr x its fan-in, so the lr that trains alike at every width falls
        as 1 / width."""
        return 3.0 / hidden_size

    @classmethod
    def check_options(cls, options: OnTargetOptions) -> None:
        if not 1 <= options.layers_per_head <= 8:
            raise ConfigError(f"heads.layers_per_head must be between 1 and 8, got {options.layers_per_head}")
        if not 0 <= options.context_layers <= 8:
            raise ConfigError(f"heads.context_layers must be between 0 and 8, got {options.context_layers}")

    def __init__(self, spec):
        super().__init__(spec)
        d, K, o = spec.hidden_size, spec.num_heads, spec.options
        self.context = ContextEncoder(d, o.context_layers) if o.context_layers else None
        self.embed = nn.Embedding(spec.vocab_size, d) if o.own_embed else None
        self.lm_heads = (nn.ModuleList(nn.Linear(d, spec.scored_vocab, bias=False) for _ in range(K))
                         if o.own_lm_head else None)

    def init_from_target(self, target: nn.Module, draft_ids: torch.Tensor | None) -> None:
        """Owned embedding and LM heads start as copies of the target's (its draft vocabulary's rows)."""
        super().init_from_target(target, draft_ids)
        if self.embed is not None:
            self.embed.weight.copy_(target.get_input_embeddings().weight.float())
        if self.lm_heads is not None:
            out = target.get_output_embeddings().weight.float()
            rows = out if draft_ids is None else out[draft_ids.to(out.device)]
            for lin in self.lm_heads:
                lin.weight.copy_(rows)

    @property
    def owns_lm_head(self) -> bool:
        return self.lm_heads is not None

    def scoring_weight(self, k: int, lm_head: nn.Module | None = None) -> torch.Tensor:
        if self.lm_heads is not None:
            return self.lm_heads[k].weight
        return super().scoring_weight(k, lm_head)

    def score(self, k: int, states: torch.Tensor) -> torch.Tensor:
        return self.lm_heads[k](states)  # the module, whose kernel the engine may have swapped for a faster one

    def start(self, h: torch.Tensor) -> torch.Tensor:
        """s_0 from the target's hidden state h_t (parameter-free; mlp_speculator's scales its input)."""
        return h

    def step(self, k: int, s_prev: torch.Tensor, token_ids: torch.Tensor | None,
             embed: nn.Module | None = None) -> torch.Tensor:
        """Head k's state (0-based k): chained, from s_{k-1} and token x_{t+k}; parallel, from h_t = s_prev (pass
        `start(h)`; tokens are ignored)."""
        raise NotImplementedError

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module | None = None) -> torch.Tensor:
        """Teacher-forced states [K, B, T, d]: head k+1 at position t has read tokens x_{t+1}..x_{t+k+1}. With a
        context encoder, position t also reads (h_j, x_{j+1}) for every j <= t."""
        s0 = self.start(h)
        if self.chained or self.context is not None:  # plain parallel heads read no tokens
            e = self.embed_tokens(input_ids, embed).to(h.dtype)  # [B, T, d]
        if self.context is not None:  # s_0 = h_t + c_t, c_t reading (h_j, x_{j+1}) for j <= t
            s0 = s0 + self.context(h, F.pad(e[:, 1:], (0, 0, 0, 1)))
        if not self.chained:
            return torch.stack([self.step(k, s0, None) for k in range(self.spec.num_heads)])
        states, s = [], s0
        for k in range(self.spec.num_heads):
            # head k+1 at position t reads the embedding of x_{t+k+1}: shift left by k+1, zero-pad the end
            s = self.blocks[k](s, F.pad(e[:, k + 1:], (0, 0, 0, k + 1)))
            states.append(s)
        return torch.stack(states)

    def drafting(self, embed, score, dtype) -> Drafting:
        return OnTargetDrafting(self, embed, score, dtype)


class OnTargetDrafting(Drafting):
    """Chained heads expand the tree level by level, running head k once on the batch of a level's nodes (each reads
    its parent's state and token); parallel heads score every head at the root, in one pass over a shared LM head. With
    a context encoder, its KV cache over committed positions gives c at the last one."""

    def __init__(self, heads: OnTargetHeads, embed, score, dtype):
        super().__init__(heads, embed, score, dtype)
        self.per_node = heads.chained
        self.needs_history = heads.context is not None
        self.reset()

    def reset(self) -> None:
        self._context_cache, self._context = None, None

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        if not self.needs_history:
            return
        e = self.heads.embed_tokens(next_tokens, self.embed).to(self.dtype)
        self._context, self._context_cache = self.heads.context.extend(hidden.to(self.dtype), e, self._context_cache)

    def root(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        heads = self.heads
        s0 = heads.start(hidden[None].to(self.dtype))  # s_0: [1, d]
        if self.needs_history:
            if self._context is None:
                raise RuntimeError("these heads have a context encoder: feed it the committed positions with "
                                   "observe() (SpeculativeGenerator does) before drafting")
            s0 = s0 + self._context  # s_0 = h_t + c_t
        if not self.per_node:
            # parallel heads all read h_t: score every head now, in one pass over a shared LM head (one read of its
            # weight instead of K), and let `step` take head k's row
            states = torch.cat([heads.step(k, s0, None) for k in range(heads.spec.num_heads)])  # [K, d]
            if heads.owns_lm_head:
                logits = torch.cat([self.score(k, states[k:k + 1]) for k in range(heads.spec.num_heads)])
            else:
                logits = self.score(0, states)  # [K, V_draft]
            self._parallel_logits = logits
        return s0

    def step(self, k, tokens, states):
        if self.per_node:
            s = self.heads.step(k, states, tokens, self.embed)  # [M, d]: s_{k+1}, reads the token at depth k
            return self.score(k, s), s
        return self._parallel_logits[k:k + 1], states  # [1, V_draft], the same for every node
