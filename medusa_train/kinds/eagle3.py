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
speculators 0.9's, so `--format speculators` only renames the vocabulary maps and writes the norm flags. In our head
numbering step k is head k+1.

Training (`ttt_states`) runs the K steps over whole sequences, each step reading the previous step's own states,
with the attention pattern inference sees ("training-time test"). Inference keeps D's keys and values of the
committed positions (`extend`); a tree node at depth k runs step k (`tree_step`) and attends to that cache and to
its own ancestors' entries, which it carries along with its state.

Transformers' own Llama modules are used for the layer, norms and rotary, imported when heads are built (so that reading
a recipe, which knows every kind's keys, does not import transformers' model code).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import ConfigError, ExportError
from ..target.model import target_fingerprint
from .attention import attention
from .heads import Drafting, Export, ExportSource, HeadsSpec, TargetLayersOptions, key_value, register
from .speculators import (SpeculatorHeads, apply_rotary, init_draft, llama_layer_config, speculators_common,
                          speculators_source_tensors, speculators_tensors, vocab_maps_to_draft_ids)

Cache = tuple[torch.Tensor, torch.Tensor]  # keys, values of committed positions: each [kv_heads, P, head_dim]

NORMS = ("norm_before_fc", "norm_before_residual", "norm_output")
"""speculators' optional norms (EAGLE-3.1's), as vLLM reads them from the config: `norm_before_fc` normalises the
concatenated aux states before `fc` (`input_norm`); `norm_before_residual` makes hidden_norm(s) the layer's residual;
`norm_output` feeds norm(s^k) (what the LM head scores) to step k+1 instead of s^k."""
# heads.norms: auto: the two both engines serve (SGLang has no norm_before_residual); docs/results.md, "Our EAGLE-3
# trainer against speculators'", measures them against none and all three
DEFAULT_NORMS = ("norm_before_fc", "norm_output")


@dataclass
class Eagle3Options(TargetLayersOptions):
    norms: list[str] | Literal["auto"] = "auto"
    """eagle3 only: the optional norms of speculators' trainer (EAGLE-3.1's) the draft layer has, any of
    `norm_before_fc` (one RMSNorm over the concatenated aux states before fc), `norm_before_residual` (the layer's
    residual is its normalised input state) and `norm_output` (each step passes on the normalised state its LM head
    scores); [] for none. vLLM serves all three; SGLang 0.5 has no norm_before_residual. `auto`: norm_before_fc and
    norm_output (they accept more than none, as much as all three, and both engines serve them); with heads.init_from,
    the warm-started heads' own."""


def llama_config(layer: dict[str, Any]) -> Any:
    """The draft layer's transformers LlamaConfig from its saved diff dict."""
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in layer.items() if k not in ("model_type", "transformers_version")})


class Eagle3Layer(nn.Module):
    """The first (and only) draft decoder layer: q/k/v read [input_layernorm(e); hidden_norm(s)] (2d wide) and the
    residual is s (hidden_norm(s) with `norm_before_residual`). The attention is written here (the training and tree
    patterns are not causal); the projections, norms and MLP are Llama's own modules, made in the order its decoder
    layer makes them, so the state dict has speculators' names."""

    def __init__(self, config: Any, norm_before_residual: bool = False):
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        super().__init__()
        self.self_attn = LlamaAttention(config, 0)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
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
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The layer's output from the attention's output a [B, H, T, hd] and the state s [B, T, d] it read."""
        B, H, T, hd = a.shape
        residual = self.hidden_norm(s) if self.norm_before_residual else s
        x = residual + self.self_attn.o_proj(a.transpose(1, 2).reshape(B, T, H * hd))
        return x + self.mlp(self.post_attention_layernorm(x))


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
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

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

    def ttt_states(self, aux: torch.Tensor, embeds: torch.Tensor, steps: int, run=lambda fn, *a: fn(*a)
                   ) -> torch.Tensor:
        """norm(s^k_t) for k = 0..steps-1: [steps, B, T, d] from aux [B, T, A*d] (the target's layers at every
        position) and embeds [B, T, d] (embed(x_t)). Step k at t reads embed(x_{t+1+k}) (zero past the end: mask
        those positions) and attends causally to step 0 and to steps 1..k at t alone."""
        B, T, d = embeds.shape
        s = self.fuse(aux)
        idx = torch.arange(T, device=s.device)
        earlier: list[torch.Tensor] = []  # every step's keys and values so far, [B, Hkv, T, hd] each
        out = []
        for k in range(steps):
            e = F.pad(embeds[:, k + 1:], (0, 0, 0, k + 1))  # embed(x_{t+1+k})
            s, scored, kk, vv = run(self.ttt_step, e, s, idx + 1 + k, *earlier)
            earlier += [kk, vv]
            out.append(scored)
        return torch.stack(out)

    def ttt_step(self, e: torch.Tensor, s: torch.Tensor, positions: torch.Tensor, *earlier: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
        """One step of `ttt_states`: (its state, what the LM head reads of it, its keys, its values) from the
        embeddings e and states s [B, T, d] it reads at rotary `positions` [T], and the earlier steps' keys and values
        (k0, v0, k1, v1, ...: each [B, Hkv, T, hd]; none at step 0). Step 0's keys are seen causally, the later steps'
        (this one's included) by their own position alone."""
        layer = self.layer
        q, k, v = layer.project(e, s, *self.rotary(s, positions))
        steps = [*zip(earlier[::2], earlier[1::2]), (k, v)]
        own = [(kk[:, :, :, None], vv[:, :, :, None]) for kk, vv in steps[1:]]
        a = attention(q, *steps[0], layer.self_attn.scaling, extras=own)
        s = self.output(layer.finish(a, s))
        return s, self.scoring_input(s), k, v

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


# ---------------------------------------------------------------------------------------------------
# The kind


def speculators_config(heads: Eagle3Heads, verifier: str, architectures: list[str]) -> dict[str, Any]:
    """config.json as speculators 0.9 writes an Eagle3SpeculatorConfig (the norm flags explicit: vLLM assumes
    norm_before_residual=true when the key is missing)."""
    spec = heads.spec
    layer = dict(spec.layer_config)
    layer.setdefault("model_type", "llama")
    return {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": spec.scored_vocab,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layers),
        "embed_requires_grad": False,
        "fc_norm": False,
        **norm_flags(spec, NORMS),
        **speculators_common(spec, "eagle3", verifier, architectures, layer),
    }


def norm_flags(spec, names: tuple[str, ...]) -> dict[str, bool]:
    """The config flags for the eagle3 norms `names` a format reads, each written explicitly (true: trained with it):
    a missing flag would be the engine's default, not what the heads compute."""
    return {name: name in spec.norms for name in names}



def speculators_files(heads: Eagle3Heads, source: ExportSource) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """speculators' Eagle3 layout (`speculators_model_type: eagle3`): vLLM serves it with
    `--speculative-config '{"method": "eagle3", "model": OUT, ...}'`, SGLang with `--speculative-algorithm EAGLE3`."""
    return speculators_config(heads, source.verifier, source.architectures()), speculators_source_tensors(heads, source)


def eagle3_release(heads: Eagle3Heads, state: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) in the original EAGLE-3 layout, from the speculators tensors of the same heads (without
    the embedding: SGLang shares the target's)."""
    config = {k: v for k, v in heads.spec.layer_config.items() if k != "transformers_version"}
    config |= {"model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"],
               "draft_vocab_size": heads.spec.scored_vocab,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in heads.spec.aux_layers]},
               **norm_flags(heads.spec, ("norm_before_fc", "norm_output")), "torch_dtype": "float32"}
    renamed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    return config, renamed



def eagle3_files(heads: Eagle3Heads, source: ExportSource) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The original EAGLE-3 release's layout (no embedding, no verifier: nothing read from the target), which SGLang
    loads with `--speculative-algorithm EAGLE3`."""
    return eagle3_release(heads, speculators_tensors(heads, None))


def _sglang_norms(spec: HeadsSpec) -> str | None:
    if "norm_before_residual" in spec.norms:  # SGLang's layer has no such norm
        return ("the eagle3 format holds heads trained without norm_before_residual in heads.norms (SGLang's draft "
                "layer has no such norm)")
    return None


@register
class Eagle3Heads(SpeculatorHeads):
    kind = "eagle3"
    recomputes = True
    Options = Eagle3Options
    exports = {"speculators": Export("vLLM and SGLang", speculators_files),
               "eagle3": Export("SGLang", eagle3_files, refuse=_sglang_norms)}

    def __init__(self, spec: HeadsSpec):
        super().__init__(spec)
        if not spec.aux_layers or not spec.layer_config:
            raise ValueError("eagle3 heads need aux_layers and layer_config in their config.json")
        self.eagle3 = Eagle3Draft(spec.layer_config, len(spec.aux_layers), spec.scored_vocab, tuple(spec.norms))

    @property
    def draft_model(self) -> Eagle3Draft:
        return self.eagle3

    @classmethod
    def check_options(cls, options: Eagle3Options) -> None:
        super().check_options(options)
        norms = cls.resolve_norms(options.norms)
        if [n for n in norms if n not in NORMS] or len(set(norms)) != len(norms):
            raise ConfigError(f"heads.norms must be distinct names among {', '.join(NORMS)} (or auto), got "
                              f"{options.norms}")

    @staticmethod
    def resolve_norms(norms: list[str] | str) -> list[str]:
        """heads.norms with `auto` resolved (DEFAULT_NORMS), in NORMS order when known."""
        norms = list(DEFAULT_NORMS) if norms == "auto" else list(norms)
        return sorted(norms, key=lambda n: NORMS.index(n) if n in NORMS else len(NORMS))

    @classmethod
    def resolve(cls, options, target_config, embedding=None, tokenizer=None):
        options = super().resolve(options, target_config)
        options.norms = cls.resolve_norms(options.norms)
        return options

    @classmethod
    def saved_options(cls, saved: dict[str, Any]) -> Eagle3Options:
        return Eagle3Options(**({"norms": []} | saved))  # heads saved before the norms existed have none

    @classmethod
    def layer_config(cls, options, target_config) -> dict[str, Any]:
        return llama_layer_config(target_config)

    @classmethod
    def distinctions(cls, spec: HeadsSpec) -> list[str]:
        """The norms too, when there are any (formats differ in the norms they hold)."""
        own = [f"heads.norms={key_value(spec.norms)}"] if spec.norms else []
        return super().distinctions(spec) + own

    def forward(self, h, input_ids, embed=None):
        """h: the features [B, T, (1 + A) d]; the chain reads the aux layers. Returns what the LM head scores,
        norm(s^k)."""
        e = self.embed_tokens(input_ids, embed).to(h.dtype)
        return self.eagle3.ttt_states(h[..., self.spec.hidden_size:], e, self.spec.num_heads, self.checkpointed)

    def score(self, k: int, states: torch.Tensor) -> torch.Tensor:
        return self.eagle3.lm_head(self.eagle3.scoring_input(states))

    def drafting(self, embed, score, dtype) -> Drafting:
        return Eagle3Drafting(self, embed, score, dtype)


class Eagle3Drafting(Drafting):
    """The decoder layer keeps keys and values of every committed position (`observe` runs step 0 over them, and its
    output at the last one scores the root's children); a node at depth k >= 1 runs step k, attending to that cache and
    to its ancestors. A node's state is its parent's output followed by the keys and values of its path (depths
    1..k-1), so static and dynamic trees carry them as they carry any state: [M, d + (K - 1) x 2 x kv_width]."""

    per_node, needs_history = True, True

    def __init__(self, heads: Eagle3Heads, embed, score, dtype):
        super().__init__(heads, embed, score, dtype)
        layer = heads.eagle3.layer
        self._kv_shape = (2, layer.num_kv_heads, layer.head_dim)
        self.reset()

    def reset(self) -> None:
        self._cache, self._s = None, None

    def observe(self, hidden, next_tokens):
        e = self.heads.embed_tokens(next_tokens, self.embed).to(self.dtype)
        aux = hidden[:, self.heads.spec.hidden_size:].to(self.dtype)
        self._s, self._cache = self.heads.eagle3.extend(aux, e, self._cache)

    def root(self, root, hidden):
        if self._s is None:
            raise RuntimeError("eagle3 heads read the committed positions: feed them with observe() "
                               "(SpeculativeGenerator does) before drafting")
        path = self._s.new_zeros(1, (self.heads.spec.num_heads - 1) * math.prod(self._kv_shape))
        return torch.cat([self._s, path], dim=-1)

    def step(self, k, tokens, states):
        d, K = self.heads.spec.hidden_size, self.heads.spec.num_heads
        if k == 0:  # the root's step 0 ran in observe: its output is the state its children read
            s, child = states[:, :d], states
        else:
            m = states.shape[0]
            path = states[:, d:].view(m, K - 1, *self._kv_shape)
            e = self.heads.embed_tokens(tokens, self.embed).to(states.dtype)
            s, key, value = self.heads.eagle3.tree_step(e, states[:, :d], path[:, :k - 1, 0], path[:, :k - 1, 1],
                                                        self._cache, self._cache[0].shape[1] + k)
            path = path.clone()
            path[:, k - 1, 0], path[:, k - 1, 1] = key, value
            child = torch.cat([s, path.flatten(1)], dim=-1)
        return self.score(k, s), child


def import_speculators(checkpoint: str | os.PathLike, target: nn.Module, target_name: str = "") -> Eagle3Heads:
    """eagle3 heads for `target` from a drafter in speculators' Eagle3 layout (what `speculators train` saves and
    `--format speculators` writes): the export read backwards, so our engine drafts with an EAGLE-3 drafter trained
    elsewhere. ExportError for what our layer cannot be (more than one decoder layer, per-layer `fc_norm`, a trained
    embedding). Attention is full where theirs may use a sliding window (2048 by default): the same below that."""
    from safetensors.torch import load_file

    path = Path(checkpoint)
    files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not files:
        raise ExportError(f"{checkpoint} is not a speculators checkpoint: expected config.json and *.safetensors")
    config = json.loads((path / "config.json").read_text())
    kind = config.get("speculators_model_type")
    if kind is None:
        raise ExportError(f"{checkpoint} is not a speculators checkpoint: its config.json names no "
                          "speculators_model_type")
    if kind != "eagle3":
        raise ExportError(f"{checkpoint} holds a {kind!r} speculator: only eagle3 drafters import")
    layer = {k: v for k, v in config["transformer_layer_config"].items()
             if k not in ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers")}
    why = [what for what, bad in (("more than one decoder layer", layer.get("num_hidden_layers", 1) != 1),
                                  ("fc_norm", config.get("fc_norm")),
                                  ("a trained embedding", config.get("embed_requires_grad"))) if bad]
    if why:
        raise ExportError(f"{checkpoint} has {why[0]}, which our eagle3 layer does not: it cannot be imported")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state |= load_file(str(f))
    options = Eagle3Options(aux_layers=list(config["eagle_aux_hidden_state_layer_ids"]),
                            norms=[n for n in NORMS if config.get(n)])
    d = target.get_input_embeddings().weight.shape[1]
    vocab = target.get_output_embeddings().weight.shape[0]
    draft_ids = vocab_maps_to_draft_ids(state, vocab)
    state.pop("embed_tokens.weight", None)
    methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
    spec = HeadsSpec(kind="eagle3", num_heads=int(methods[0].get("speculative_tokens", 3)), hidden_size=d,
                     vocab_size=vocab, draft_vocab_size=0 if draft_ids is None else len(draft_ids), layer_config=layer,
                     target_name=target_name, target_fingerprint=target_fingerprint(target), options=options)
    heads = Eagle3Heads(spec)
    missing, unexpected = heads.eagle3.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ExportError(f"{checkpoint}: tensors do not match an eagle3 layer of its config (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]})")
    if draft_ids is not None:
        heads.draft_ids.copy_(draft_ids)
    return heads


