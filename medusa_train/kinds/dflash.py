"""DFlash block drafter (`heads.kind: dflash`): the math of `speculators`' DFlashDraftModel, trained and drafted here.

Notation (docs/design.md). The target's states at A layers (`aux_layers`, layer id i: the input of decoder layer i,
as speculators and vLLM's speculators loader count) at committed position j are fused into the context
c_j = hidden_norm(fc([a_j^1; ...; a_j^A])). A block of S = K + 1 tokens follows the last committed position t: the
anchor x_{t+1} (the token the target already decided: the tree's root) and K copies of the mask token, at rotary
positions t+1 .. t+1+K. One forward of L small Qwen3 decoder layers runs over the block; in every layer each block
token attends to the context (keys and values k_norm(k_proj(c_j)), v_proj(c_j) at positions j <= t, the same in every
step: computed once per committed position) and, non-causally, to the whole block. The block's slot i (1..K) gives
logits lm_head(norm(x_i)) for x_{t+1+i}: slot i is our head i (0-based head i-1). Unlike eagle3's steps, the slots do
not read each other's chosen tokens: one forward gives every depth's distribution, and the tree is built from them
as from parallel heads.

Training (`DFlashDraft.anchored_states`) draws random anchors per row (the reference trainers' recipe) and runs their
blocks together: every block attends to the context before its anchor and to itself only. The loss weights slot i by
`loss.decay`**(i-1), the reference's exp(-(i-1)/gamma) (decay 0.8 is gamma 4.5; gamma 4, the reference's for blocks
of 8, is decay 0.78). Parameter names are speculators 0.9's (`layers.N.self_attn.q_norm`, `fc`, `hidden_norm`,
`norm`, `lm_head`), so the export only drops our prefix and renames the vocabulary maps.

Transformers' own Qwen3 modules are used for the MLP, norms and rotary, imported when heads are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import ConfigError
from ..target.model import text_config
from .attention import Prefix, attention
from .heads import Drafting, Export, ExportSource, HeadsSpec, TargetLayersOptions, register
from .speculators import (SpeculatorHeads, apply_rotary, init_draft, llama_layer_config, speculators_common,
                          speculators_source_tensors, speculators_tensors)

Cache = list  # per layer: (keys, values) of the committed positions, each [kv_heads, P, head_dim]

ANCHOR_CHUNK = 32  # blocks a pass when every position is an anchor (evaluation): bounds the activations
DEFAULT_ANCHORS = 64  # blocks per row per step: docs/results.md, "The dflash kind"


@dataclass
class DFlashOptions(TargetLayersOptions):
    layers_per_head: int = 1
    """Blocks per head (the mlp_speculator export needs 1). dflash: its decoder layers."""
    mask_token_id: int | None = None
    """dflash only: the token whose embedding (the target's, frozen) fills the block's mask slots. None: the
    tokenizer's mask token, else the first embedding row no token uses, else its pad, EOS or unknown token (the
    order of speculators' trainer), passing over rows of zeros (a padding row would give the slots no input)."""
    anchors: int | None = None
    """dflash only: blocks trained per row per step, at random positions with a supervised next-but-one token,
    redrawn every step (DFlash's random anchors); 0: a block after every position. None: DEFAULT_ANCHORS (64)."""


def layer_config(target_config: Any, num_layers: int) -> dict[str, Any]:
    """The draft layers' Qwen3Config, sized like the target (hidden size, heads, MLP width, rotary, norm eps), as the
    diff dict speculators writes for `transformer_layer_config`."""
    fields = {k: v for k, v in llama_layer_config(target_config).items()
              if k not in ("model_type", "transformers_version", "architectures", "mlp_bias")}
    fields |= {"num_hidden_layers": num_layers, "attention_bias": False, "tie_word_embeddings": False,
               "layer_types": ["full_attention"] * num_layers, "use_sliding_window": False}
    from transformers import Qwen3Config

    return Qwen3Config(**fields).to_diff_dict()


def qwen3_config(layer: dict[str, Any]) -> Any:
    """The draft layers' transformers Qwen3Config from their saved diff dict."""
    from transformers import Qwen3Config

    return Qwen3Config(**{k: v for k, v in layer.items() if k not in ("model_type", "transformers_version")})


def resolve_mask_token(tokenizer: Any, embedding: torch.Tensor, explicit: int | None = None) -> int:
    """The mask token's id: `explicit`, else the first of the tokenizer's mask token, the first embedding row no token
    uses, its pad, EOS and unknown tokens (speculators' order) whose row of `embedding` [V, d] (the target's, frozen in
    the block) is not all zeros: a zero row (a padding row) gives the mask slots no input, so the first layer cannot
    tell them apart. ConfigError (one line) for an explicit id out of range or with a zero row, or no candidate."""
    vocab = embedding.shape[0]
    if explicit is not None:
        if not 0 <= explicit < vocab:
            raise ConfigError(f"heads.mask_token_id={explicit}: the target's embedding has {vocab} rows; pick an id "
                             "below that (or leave it unset)")
        if not _nonzero_row(embedding, explicit):
            raise ConfigError(f"heads.mask_token_id={explicit}: its embedding row is all zeros (a padding row), so the "
                             "block's mask slots would carry no input; pick another token (or leave it unset)")
        return int(explicit)
    spare = [len(tokenizer)] if len(tokenizer) < vocab else []
    candidates = [getattr(tokenizer, "mask_token_id", None), *spare,
                  *(getattr(tokenizer, name, None) for name in ("pad_token_id", "eos_token_id", "unk_token_id"))]
    for i in candidates:
        if isinstance(i, int) and 0 <= i < vocab and _nonzero_row(embedding, i):
            return i
    raise ConfigError("no mask token for heads.kind=dflash: the tokenizer's mask, pad, EOS and unknown tokens and its "
                     "spare embedding rows are missing or all zeros; set heads.mask_token_id")


def default_mask_token(config: Any, embedding: torch.Tensor) -> int:
    """Without a tokenizer (`DraftHeads.for_target`): the config's pad or EOS token, else the last row, whichever
    first has a row that is not all zeros."""
    eos = getattr(config, "eos_token_id", None)
    candidates = [getattr(config, "pad_token_id", None), *(eos if isinstance(eos, list) else [eos]),
                  *range(embedding.shape[0] - 1, -1, -1)]
    return next(i for i in candidates if isinstance(i, int) and 0 <= i < embedding.shape[0]
                and _nonzero_row(embedding, i))


def _nonzero_row(embedding: torch.Tensor, i: int) -> bool:
    return bool(embedding[i].detach().abs().sum() > 0)


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose keys and values also come from the context states (never normalised by
    input_layernorm: the context is already hidden_norm's output)."""

    def __init__(self, config: Any):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.scaling = hd ** -0.5
        attn = nn.Module()
        attn.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        attn.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        attn.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        attn.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        attn.q_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        attn.k_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        self.self_attn = attn
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normalised, rotated) and values [B, Hkv, T, hd] of states x [B, T, d] (context or block)."""
        B, T, _ = x.shape
        attn = self.self_attn
        k = attn.k_norm(attn.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, sees: Prefix | None) -> torch.Tensor:
        """Blocks x [B, Q, d] at rotary cos/sin [B, Q, hd] (Q = n blocks of S), attending to the context's keys/values
        [B, Hkv, P, hd] as `sees` lets each row (None: one block seeing every context position) and to their own
        block's."""
        B, Q, _ = x.shape
        attn = self.self_attn
        y = self.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(y).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = self.kv(y, cos, sin)
        if sees is None:  # drafting: one block that sees every cached position and itself
            keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
            a = F.scaled_dot_product_attention(q, keys, values, scale=self.scaling, enable_gqa=True)
        else:  # training's anchored blocks (kinds/attention.py: the context by a kernel, each block's own merged in)
            n = Q // sees.block
            own = [(k.reshape(B, self.num_kv_heads, n, sees.block, self.head_dim),
                    v.reshape(B, self.num_kv_heads, n, sees.block, self.head_dim))]
            a = attention(q, ctx_k, ctx_v, self.scaling, sees.prefix, own)
        x = x + attn.o_proj(a.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True, eq=False)
class BlockSight:
    """What training's blocks see: `prefix` of the context (row r: context j <= its anchor, real), and their own block
    of `block` rows."""

    prefix: Prefix
    block: int


class DFlashDraft(nn.Module):
    """fc, hidden_norm, the draft layers, the final norm and the LM head over the draft vocabulary (speculators'
    layout). `num_slots` = K, the mask tokens after the anchor."""

    def __init__(self, layer: dict[str, Any], num_aux: int, scored_vocab: int, num_slots: int, mask_token_id: int):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        config = qwen3_config(layer)
        d = config.hidden_size
        self.num_slots, self.mask_token_id = num_slots, mask_token_id
        self.fc = nn.Linear(num_aux * d, d, bias=False)
        self.hidden_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, scored_vocab, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # no parameters; its buffers are not saved
        init_draft(self, config.initializer_range)

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, hd] at positions [B, T]."""
        return self.rotary_emb(x, positions)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """c = hidden_norm(fc(aux)): the context states the block attends to."""
        return self.hidden_norm(self.fc(aux))

    def block_inputs(self, anchor_embeds: torch.Tensor, mask_embed: torch.Tensor) -> torch.Tensor:
        """[..., S, d]: each anchor's embedding [..., d] followed by K mask embeddings ([d])."""
        masks = mask_embed.to(anchor_embeds.dtype).expand(*anchor_embeds.shape[:-1], self.num_slots, -1)
        return torch.cat([anchor_embeds[..., None, :], masks], dim=-2)

    def run_blocks(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                   sees: BlockSight | None, run=lambda fn, *a: fn(*a)) -> torch.Tensor:
        """The layers over blocks x [B, Q, d] at `positions` [B, Q]; norm(output) [B, Q, d]. `run(layer, *inputs)`
        runs each layer (training: DraftHeads.checkpointed)."""
        cos, sin = self.rotary(x, positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = run(layer, x, cos, sin, k, v, sees)
        return self.norm(x)

    # -- training ---------------------------------------------------------------------------------------

    def anchored_states(self, aux: torch.Tensor, anchor_embeds: torch.Tensor, mask_embed: torch.Tensor,
                        anchors: torch.Tensor, attention_mask: torch.Tensor | None, run=lambda fn, *a: fn(*a)
                        ) -> torch.Tensor:
        """norm(x_i) of slots 1..K for the blocks after positions `anchors` [B, N] (the last context position t of
        each block; its anchor token is x_{t+1}, whose embedding is anchor_embeds [B, N, d]): [K, B, N, d]. aux
        [B, T, A*d] are the target's layers at every position; `attention_mask` [B, T] marks real positions. Block n
        attends to the context j <= anchors[n] and to itself; the blocks are run ANCHOR_CHUNK at a time."""
        B, T, _ = aux.shape
        S = self.num_slots + 1
        c = self.context(aux)
        idx = torch.arange(T, device=aux.device)
        ctx_kv = [layer.kv(c, *self.rotary(c, idx.expand(B, T))) for layer in self.layers]
        real = None if attention_mask is None else attention_mask.bool()
        out = []
        for a in range(0, anchors.shape[1], ANCHOR_CHUNK):
            t = anchors[:, a:a + ANCHOR_CHUNK]  # [B, n]
            n = t.shape[1]
            x = self.block_inputs(anchor_embeds[:, a:a + n], mask_embed).reshape(B, n * S, -1)
            positions = (t[..., None] + 1 + torch.arange(S, device=t.device)).reshape(B, n * S)
            limit = t.repeat_interleave(S, 1)  # read once on the host here, not by every layer's attention
            host = limit.cpu() if limit.device.type != "meta" else None  # (the meta device: sizing, nothing to read)
            sees = BlockSight(Prefix(limit=limit, keep=real, limit_on_host=host), S)
            y = self.run_blocks(x, positions, ctx_kv, sees, run).view(B, n, S, -1)
            out.append(y[:, :, 1:].permute(2, 0, 1, 3))
        return torch.cat(out, dim=2)

    # -- inference --------------------------------------------------------------------------------------

    def extend(self, aux: torch.Tensor, cache: Cache | None) -> Cache:
        """Append n committed positions (aux [n, A*d]) to every layer's context keys and values (None: a new
        sequence). Entry j sits at rotary position j."""
        start = 0 if cache is None else cache[0][0].shape[1]
        c = self.context(aux)[None]  # [1, n, d]
        positions = torch.arange(start, start + c.shape[1], device=c.device)[None]
        cos, sin = self.rotary(c, positions)
        grown = []
        for i, layer in enumerate(self.layers):
            k, v = layer.kv(c, cos, sin)
            if cache is not None:
                k, v = torch.cat([cache[i][0][None], k], dim=2), torch.cat([cache[i][1][None], v], dim=2)
            grown.append((k[0], v[0]))
        return grown

    def draft(self, anchor_embed: torch.Tensor, mask_embed: torch.Tensor, cache: Cache) -> torch.Tensor:
        """norm(x_i) of slots 1..K [K, d] for the block after the cached positions, whose anchor (the root) has the
        embedding anchor_embed [d]: one forward, the block attending to every cached position and to itself."""
        P = cache[0][0].shape[1]
        x = self.block_inputs(anchor_embed[None], mask_embed)  # [1, S, d]
        positions = torch.arange(P, P + self.num_slots + 1, device=x.device)[None]
        kv = [(k[None], v[None]) for k, v in cache]
        return self.run_blocks(x, positions, kv, None)[0, 1:]


def sample_anchors(supervised: torch.Tensor, num: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num` random anchors per row (positions t whose next-but-one token x_{t+2}, the first slot's target, is
    supervised: `supervised` [B, T] bool marks tokens that carry a label), sorted; returns (anchors [B, num],
    valid [B, num]). Rows with fewer candidates repeat position 0 in the spare places, marked invalid."""
    B, T = supervised.shape
    candidates = torch.zeros_like(supervised)
    candidates[:, :T - 2] = supervised[:, 2:]
    keys = torch.rand(B, T, generator=generator, device=supervised.device)
    keys = torch.where(candidates, keys, torch.full_like(keys, 2.0))  # non-candidates sort last
    n = min(num, T)
    chosen = keys.topk(n, dim=1, largest=False)
    valid = chosen.values < 2.0
    anchors = torch.where(valid, chosen.indices, torch.zeros_like(chosen.indices))
    order = torch.where(valid, anchors, torch.full_like(anchors, T)).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


# ---------------------------------------------------------------------------------------------------
# The kind


def speculators_config(heads: DFlashHeads, verifier: str, architectures: list[str]) -> dict[str, Any]:
    """config.json as speculators 0.9 writes a DFlashSpeculatorConfig (see the module docs for the causal flag)."""
    spec = heads.spec
    layer = dict(spec.layer_config)
    layer.setdefault("model_type", "qwen3")
    return {
        "architectures": ["DFlashSpeculator"],
        "aux_hidden_state_layer_ids": list(spec.aux_layers),
        "block_size": spec.num_heads + 1,
        "draft_vocab_size": spec.scored_vocab,
        "mask_token_id": spec.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,
        **speculators_common(spec, "dflash", verifier, architectures, layer),
    }



def speculators_files(heads: DFlashHeads, source: ExportSource) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """speculators' DFlash layout, which vLLM serves with `{"method": "dflash", "model": OUT,
    "num_speculative_tokens": num_heads}`."""
    return speculators_config(heads, source.verifier, source.architectures()), speculators_source_tensors(heads, source)


def dflash_release(heads: DFlashHeads, state: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) in DFlash's release layout, from the speculators tensors of the same (full-vocabulary)
    heads, without the LM head and the embedding: SGLang shares the target's."""
    spec = heads.spec
    config = {k: v for k, v in spec.layer_config.items() if k != "transformers_version"}
    config |= {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "block_size": spec.num_heads + 1,
               "dflash_config": {"target_layer_ids": [i - 1 for i in spec.aux_layers],
                                 "mask_token_id": spec.mask_token_id},
               "torch_dtype": "float32"}
    return config, {k: v for k, v in state.items() if k not in ("lm_head.weight", "embed_tokens.weight")}



def dflash_files(heads: DFlashHeads, source: ExportSource) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """DFlash's release layout (no embedding, no LM head: nothing read from the target), which SGLang loads with
    `--speculative-algorithm DFLASH`."""
    return dflash_release(heads, speculators_tensors(heads, None))


@register
class DFlashHeads(SpeculatorHeads):
    kind = "dflash"
    recomputes = True
    Options = DFlashOptions
    training_options = ("anchors",)
    exports = {"speculators": Export("vLLM", speculators_files),
               "dflash": Export("SGLang", dflash_files, {"draft_vocab_size": 0})}

    def __init__(self, spec: HeadsSpec):
        super().__init__(spec)
        if not spec.aux_layers or not spec.layer_config or spec.mask_token_id is None or spec.mask_token_id < 0:
            raise ValueError(f"{self.kind} heads need aux_layers, layer_config and mask_token_id in their config.json")
        self.dflash = self.make_draft(spec)

    def make_draft(self, spec: HeadsSpec) -> DFlashDraft:
        """The block drafter's module (a kind built on dflash's block adds its own parts here)."""
        return DFlashDraft(spec.layer_config, len(spec.aux_layers), spec.scored_vocab, spec.num_heads,
                           spec.mask_token_id)

    @property
    def draft_model(self) -> DFlashDraft:
        return self.dflash

    @classmethod
    def check_options(cls, options: DFlashOptions) -> None:
        super().check_options(options)
        if not 1 <= options.layers_per_head <= 8:
            raise ConfigError(f"heads.layers_per_head must be between 1 and 8, got {options.layers_per_head}")
        if options.mask_token_id is not None and options.mask_token_id < 0:
            raise ConfigError(f"heads.mask_token_id must be a token id >= 0 (unset: the tokenizer chooses), got "
                              f"{options.mask_token_id}")
        if options.anchors is not None and options.anchors < 0:
            raise ConfigError(f"heads.anchors must be >= 0 (0: a block after every position), got {options.anchors}")

    @classmethod
    def resolve(cls, options, target_config, embedding=None, tokenizer=None):
        options = super().resolve(options, target_config)
        if embedding is not None and tokenizer is not None:
            options.mask_token_id = resolve_mask_token(tokenizer, embedding, options.mask_token_id)
        elif options.mask_token_id is None:  # without a tokenizer: the config's choice; before loading: a placeholder
            options.mask_token_id = 0 if embedding is None else default_mask_token(text_config(target_config),
                                                                                   embedding)
        if options.anchors is None:
            options.anchors = DEFAULT_ANCHORS
        return options

    @classmethod
    def layer_config(cls, options, target_config) -> dict[str, Any]:
        return layer_config(target_config, options.layers_per_head)

    def forward(self, h, input_ids, embed=None):
        """Every position is an anchor (evaluation); training draws some (`training_states`)."""
        B, T = input_ids.shape
        return self.dflash_states(h, input_ids, torch.arange(T, device=h.device).expand(B, T), None, embed)

    def training_states(self, h, input_ids, supervised, attention_mask, embed):
        """`heads.anchors` random blocks per row, redrawn every step (0: a block after every position)."""
        anchors = self.spec.anchors if self.spec.anchors is not None else DEFAULT_ANCHORS
        if not anchors:
            return super().training_states(h, input_ids, supervised, attention_mask, embed)
        positions, valid = sample_anchors(supervised, anchors)
        return self.dflash_states(h, input_ids, positions, attention_mask, embed), positions, valid

    def dflash_states(self, h: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                      attention_mask: torch.Tensor | None, embed: nn.Module | None = None) -> torch.Tensor:
        """The block slots' states [K, B, N, d] for the blocks after positions `anchors` [B, N] (slot k+1 of the block
        after t, head k's state at t, guesses x_{t+2+k}); h the target's features [B, T, feature_size]."""
        ids = input_ids.gather(1, (anchors + 1).clamp_max(input_ids.shape[1] - 1))  # the anchor tokens x_{t+1}
        e = self.embed_tokens(ids, embed).to(h.dtype)
        mask = self.embed_tokens(torch.tensor([self.spec.mask_token_id], device=h.device), embed)[0]
        return self.dflash.anchored_states(h[..., self.spec.hidden_size:], e, mask, anchors, attention_mask,
                                           self.checkpointed)

    def score(self, k: int, states: torch.Tensor) -> torch.Tensor:
        return self.dflash.lm_head(states)

    def drafting(self, embed, score, dtype) -> Drafting:
        return DFlashDrafting(self, embed, score, dtype)


class DFlashDrafting(Drafting):
    """The layers keep the context's keys and values of every committed position (`observe`); a step runs one forward
    over the block of the root and K mask tokens, which gives every depth's distribution at once. Like parallel heads,
    a depth's candidates do not depend on the tokens chosen above them, so static and dynamic trees take each level's
    top-k from that one forward."""

    per_node, needs_history = False, True

    def __init__(self, heads: DFlashHeads, embed, score, dtype):
        super().__init__(heads, embed, score, dtype)
        mask = torch.tensor([heads.spec.mask_token_id], device=next(heads.parameters()).device)
        self._mask_embed = heads.embed_tokens(mask, embed)[0].to(dtype)
        self.reset()

    def reset(self) -> None:
        self._cache = None

    def observe(self, hidden, next_tokens):
        self._cache = self.heads.dflash.extend(hidden[:, self.heads.spec.hidden_size:].to(self.dtype), self._cache)

    def root(self, root, hidden):
        if self._cache is None:
            raise RuntimeError("dflash heads read the committed positions: feed them with observe() "
                               "(SpeculativeGenerator does) before drafting")
        e = self.heads.embed_tokens(root, self.embed)[0].to(self._mask_embed.dtype)
        self._states = self.heads.dflash.draft(e, self._mask_embed, self._cache)  # [K, d]: slot k+1's state
        self._logits = self.score(0, self._states)  # [K, V']
        return None

    def step(self, k, tokens, states):
        return self._logits[k:k + 1], states
