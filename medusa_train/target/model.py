"""The frozen target: load it once, then read its final hidden state h_t for a batch.

Only `h` [B, T, d] leaves this module. The target's logits (the soft labels) are recomputed per chunk
of positions in `losses.py` as `lm_head(h_chunk)`, so [B, T, V] teacher logits never exist at once.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..base.errors import ConfigError

if TYPE_CHECKING:
    from ..config import TargetConfig

FINGERPRINT_ATOL = 2e-3  # cosines move ~1e-5 between fp32/bf16 copies; another model's move ~1/sqrt(d)
# glibc serves a CPU allocation over 32 MiB with a fresh mmap whose pages fault on first touch: an
# elementwise pass over such a tensor ran ~3x slower per element than over one that reuses the heap
# (measured on 2 Xeon cores: exp over a [1024, 8192] fp32 tensor, exactly 32 MiB, 8.3 ms; over [1000, 8192],
# 2.8 ms). On a CPU a chunk of vocab-sized rows is capped so that its fp32 tensors stay under half of that.
CPU_CHUNK_BYTES = 16 << 20


class TargetLoadError(ConfigError):
    """The target model or its tokenizer cannot be loaded (missing, offline, or not a causal LM)."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device(device: torch.device | str | None = None) -> torch.device:
    """`device`, or by default CUDA when available, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`target.dtype` -> torch dtype. `auto`: bfloat16 on a GPU that supports it, else float32."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
        return _DTYPES[name]
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _load_error(cfg: TargetConfig, what: str, e: Exception) -> TargetLoadError:
    text = str(e).strip()
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or any(w in text.lower() for w in ("offline", "connect"))
    fix = (f"the machine cannot reach the hub: download it first (`hf download {cfg.model}`) or set "
           "target.model to a local directory") if offline else \
        "check the name, or set target.model to a local directory holding config.json and weights"
    first = text.splitlines()[0] if text else type(e).__name__
    return TargetLoadError(f"target.model: cannot load the {what} of {cfg.model!r} ({first}); {fix}")


def check_hub_reachable(name: str, key: str = "target.model", filename: str | None = None) -> None:
    """Fail at once, in one line, for a hub name that is neither a local directory nor in the Hugging Face cache
    (`filename`, default config.json, is what is looked for there) when the hub cannot be reached: transformers would
    retry for about 90 s before saying so. Reads HF_ENDPOINT; behind a proxy (HTTPS_PROXY, ALL_PROXY) it is the
    proxy that must answer; does nothing with HF_HUB_OFFLINE=1 (transformers then fails at once itself)."""
    import socket
    from urllib.parse import urlparse

    if Path(os.path.expanduser(name)).exists() or os.environ.get("HF_HUB_OFFLINE") == "1" or name.count("/") > 1:
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, filename or "config.json"), str):
            return
    except Exception:  # noqa: BLE001 - not a repo id: the load says what is wrong with it
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    proxy = next((os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if url.scheme == "https" and os.environ.get(k)), None)
    if proxy and "://" not in proxy:
        proxy = f"http://{proxy}"
    first_hop = urlparse(proxy) if proxy else url
    try:
        port = first_hop.port or (443 if first_hop.scheme == "https" else 80)
        socket.create_connection((first_hop.hostname, port), timeout=5).close()
    except OSError as e:
        via = f" through the proxy {first_hop.hostname}" if proxy else ""
        raise TargetLoadError(f"{key}={name!r} is not a local directory nor in the Hugging Face cache, and the hub "
                              f"({endpoint}) cannot be reached from this machine{via} "
                              f"({e.strerror or type(e).__name__}): download it where there is a network "
                              f"(`hf download {name}`) and copy the cache, or set {key} to a local directory") from None


def _common_kwargs(cfg: TargetConfig) -> dict:
    kw: dict = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    return kw


# ---------------------------------------------------------------------------------------------------
# The target's fingerprint: what heads record of the target they were trained for


def _probe_directions(d: int, n: int) -> torch.Tensor:
    """n fixed pseudo-random unit directions in R^d, identical on every machine and torch version."""
    j = torch.arange(d, dtype=torch.float64)
    rows = [torch.sin(j * (0.618034 + 0.1 * i) + 1.7 * i) * torch.cos(j * 0.0137 * (i + 1)) for i in range(n)]
    dirs = torch.stack(rows)
    return dirs / dirs.norm(dim=1, keepdim=True)


def _signature(weight: torch.Tensor, n_rows: int = 16) -> list[float]:
    vocab, d = weight.shape
    idx = torch.linspace(0, vocab - 1, n_rows).round().long().to(weight.device)
    rows = weight.detach()[idx].to("cpu", torch.float64)
    rows = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    cos = (rows * _probe_directions(d, n_rows)).sum(dim=1)  # row i against direction i
    return [round(float(c), 6) for c in cos]


@torch.no_grad()
def output_signature(target: nn.Module, n: int = 8) -> list[float]:
    """What the target computes, not only what it stores: cosines of its final hidden states on a fixed 16-token input
    with fixed directions (an adapter merged into its layers moves them; its embedding and LM head often not)."""
    weight = target.get_output_embeddings().weight
    vocab, d = weight.shape
    ids = ((torch.arange(16) * 7919 + 13) % vocab).to(weight.device)[None]
    base = target.get_base_model() if hasattr(target, "get_base_model") else target
    h = decoder(base)(input_ids=ids).last_hidden_state[0, -n:].to("cpu", torch.float64)
    h = h / h.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return [round(float(c), 6) for c in (h * _probe_directions(d, n)).sum(dim=1)]


def weights_fingerprint(embedding: torch.Tensor, lm_head: torch.Tensor) -> dict[str, Any]:
    """The part of `target_fingerprint` read off the embedding and LM head weights alone."""
    return {"hidden_size": int(embedding.shape[1]), "vocab_size": int(lm_head.shape[0]),
            "embed_signature": _signature(embedding), "lm_head_signature": _signature(lm_head)}


def target_fingerprint(target: nn.Module) -> dict[str, Any]:
    """hidden size, vocab size and a dtype/device-independent signature of the embedding and LM head; for a target
    with a peft adapter merged in (`medusa_train.target.model.merge_adapter`), the adapter and the output signatures of
    the base and the adapted model, so that the bare base can be told apart."""
    emb = target.get_input_embeddings().weight
    out = target.get_output_embeddings().weight
    fp = {
        "hidden_size": int(emb.shape[1]),
        "vocab_size": int(out.shape[0]),
        "embed_signature": _signature(emb),
        "lm_head_signature": _signature(out),
    }
    if getattr(target, "medusa_adapter", None):
        fp["adapter"] = dict(target.medusa_adapter)
    return fp


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


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer (cheap: used first, so data errors surface before the model loads)."""
    from transformers import AutoTokenizer

    check_hub_reachable(cfg.model, filename=cfg.gguf_file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, **_common_kwargs(cfg))
    except (OSError, ValueError) as e:
        raise _load_error(cfg, "tokenizer", e) from None
    if cfg.chat_template:  # for targets shipped without one (e.g. Vicuna)
        path = Path(os.path.expanduser(cfg.chat_template))
        tokenizer.chat_template = path.read_text() if path.is_file() else cfg.chat_template
    if tokenizer.pad_token_id is None:  # collate needs a pad id; padded positions are masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(cfg: TargetConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """The target causal LM, frozen: eval mode, requires_grad False, on `device`.

    `dtype` defaults to `resolve_dtype(cfg.dtype, device)`. A GGUF target (`cfg.gguf_file`) is
    dequantized by transformers on load. Raises TargetLoadError with the fix when it cannot be loaded
    (e.g. a hub name on a machine without network and without a local copy).
    """
    from transformers import AutoModelForCausalLM

    check_hub_reachable(cfg.model, filename=cfg.gguf_file)
    kw = _common_kwargs(cfg) | _build_kwargs(cfg, dtype or resolve_dtype(cfg.dtype, device))
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.model, **kw)
    except (OSError, ValueError) as e:
        raise _load_error(cfg, "model", e) from None
    if model.get_output_embeddings() is None:
        raise TargetLoadError(f"target.model: {cfg.model!r} has no LM head; draft heads need a causal LM")
    if cfg.adapter:
        model = merge_adapter(model, cfg.adapter, cfg.model)
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def _build_kwargs(cfg: TargetConfig, dtype: torch.dtype) -> dict:
    """How the target's modules are built, loaded (`load_model`) or empty (`model_skeleton`): alike."""
    return {"dtype": dtype} | ({"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {})


def model_skeleton(cfg: TargetConfig, dtype: torch.dtype) -> nn.Module:
    """The target's modules with no weights (every parameter on the meta device; the buffers its construction
    computes, real), frozen: what a process builds before it reads its share of a sharded target from the files, or
    receives it from the main process (`sharding.shard_target`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_hub_reachable(cfg.model, filename=cfg.gguf_file)
    try:
        config = AutoConfig.from_pretrained(cfg.model, **_common_kwargs(cfg))
    except (OSError, ValueError) as e:
        raise _load_error(cfg, "model", e) from None
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # buffers computed as construction computes them (rotary's)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code,
                                                 **_build_kwargs(cfg, dtype))
    model.eval()
    model.requires_grad_(False)
    return model


def merge_adapter(model: nn.Module, adapter: str | os.PathLike, base_name: str = "") -> nn.Module:
    """`model` with the peft adapter at `adapter` merged into its weights (a plain transformers model again, as fast
    as the base). TargetLoadError in one line when the adapter was made for another base model."""
    from peft import PeftModel

    try:
        with peft_quietly():
            peft_model = PeftModel.from_pretrained(model, os.path.expanduser(str(adapter)))
    except (RuntimeError, ValueError, KeyError) as e:
        first = " ".join(str(e).split())[:160]
        raise TargetLoadError(f"target.adapter={adapter} does not fit the target {base_name or 'model'} ({first}): "
                              "it was made for another base model; pass the base it was trained on") from None
    with peft_model.disable_adapter():
        base = output_signature(peft_model)
    merged = peft_model.merge_and_unload()
    # what the heads' fingerprint records, so that heads made for base + adapter know the bare base when they see it
    where = Path(os.path.expanduser(str(adapter)))
    path = str(where.resolve()) if where.exists() else str(adapter)
    merged.medusa_adapter = {"path": path, "base_signature": base, "adapted_signature": output_signature(merged)}
    return merged


@contextmanager
def peft_quietly() -> Iterator[None]:
    """peft 0.21 asks transformers >= 5.24 `is_gradient_checkpointing`, which warns that it is deprecated, on every
    adapter it wraps a model with: a warning about a call of theirs that users can do nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def recorded_adapter(fingerprint: dict) -> str | None:
    """The adapter a heads' fingerprint says their target had merged in (None: the bare model)."""
    return (fingerprint.get("adapter") or {}).get("path")


def merge_recorded_adapter(model: nn.Module, fingerprint: dict, base_name: str = "") -> nn.Module:
    """`model` as the heads with this fingerprint were trained on it: with their recorded adapter merged in, if any."""
    adapter = recorded_adapter(fingerprint)
    return merge_adapter(model, adapter, base_name) if adapter else model


def load_target(cfg: TargetConfig, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> tuple[nn.Module, object]:
    """(model, tokenizer): the frozen target (see `load_model`) and its tokenizer."""
    return load_model(cfg, device, dtype), load_tokenizer(cfg)


def eos_ids(model: nn.Module, tokenizer=None) -> list[int]:
    """The ids that end generation, as `model.generate` stops: its generation config's EOS (an id or a list),
    else the tokenizer's EOS token."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def stop_ids(model: nn.Module, tokenizer) -> list[int]:
    """Every id that ends a generated turn: `eos_ids` and the tokenizer's own EOS token."""
    stops = set(eos_ids(model, tokenizer))
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    return sorted(stops)


def pad_id(tokenizer) -> int:
    """The id that pads a batch: the tokenizer's pad token, else its EOS token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@functools.cache
def _cache_keyword(forward_owner: type) -> str:
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: nn.Module, cache) -> dict[str, Any]:
    """The keyword argument that hands a key/value `cache` to `model`'s forward: `cache` where the model takes it
    (transformers 5.24 renamed it and removes `past_key_values` in 5.40), `past_key_values` on older versions (the
    GPU machines' 5.17). Decided once per model class, by its signature."""
    return {_cache_keyword(type(model)): cache}


def text_config(config):
    """The text model's config (a multimodal config's text part; any other config as it is)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# layer kinds that keep a recurrent state (convolution, linear attention, state-space), not per-token keys and values
_RECURRENT_KINDS = ("conv", "linear", "mamba", "recurrent", "ssm", "rwkv", "hybrid", "delta")


def unsupported_reason(config) -> str | None:
    """Why the engine cannot verify a tree on a model with this config, read from the config alone (None: no reason
    found here; the engine's self-check at load still runs). One clause, for a one-line refusal that names the
    model type. Training checks it before loading anything, so heads are never trained for a target the engine
    would refuse."""
    text = text_config(config)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported (the heads draft for a causal LM's decoder)"
    model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "")
    attn = getattr(text, "attn_config", None)
    alibi = getattr(text, "alibi", False) or getattr(attn, "alibi", False) or (
        isinstance(attn, dict) and attn.get("alibi")) or model_type == "bloom"
    if alibi:
        return ("its ALiBi position bias is built inside the model from a 2D padding mask, so the 4D tree attention "
                "mask the engine verifies with cannot carry it (tree positions would get the wrong bias)")
    kinds = list(getattr(text, "layer_types", None) or []) + list(getattr(text, "layers_block_type", None) or [])
    recurrent = sorted({str(k) for k in kinds if any(r in str(k).lower() for r in _RECURRENT_KINDS)})
    pattern = getattr(text, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and "M" in pattern:
        recurrent.append("mamba")
    if recurrent:
        return (f"its {', '.join(recurrent)} layers keep a recurrent state, not per-token keys and values, which "
                "cannot be rolled back to the accepted path of a verified tree")
    return None


@dataclass(frozen=True)
class LogitTransform:
    """What a model's own forward does to `lm_head(h)` before it returns logits, read from its config: Cohere
    multiplies by `logit_scale`, Granite divides by `logits_scaling`, Gemma-2/3 cap with `final_logit_softcapping`
    (cap * tanh(z / cap)). Applied with the same operations in the same dtype as the model, so the engine's argmax
    (ties included) is the model's; the teacher, the heads' scorer and the engine's sampling all go through it."""

    multiply: float = 1.0
    divide: float = 1.0
    softcap: float = 0.0

    @property
    def identity(self) -> bool:
        return self.multiply == 1.0 and self.divide == 1.0 and not self.softcap

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.multiply != 1.0:
            z = z * self.multiply
        if self.divide != 1.0:
            z = z / self.divide
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def derivative(self, out: torch.Tensor) -> torch.Tensor | float:
        """d out / d z, from the transformed logits `out` (for an analytic backward)."""
        d = self.multiply / self.divide
        return d * (1 - (out / self.softcap) ** 2) if self.softcap else d


def logit_transform(config) -> LogitTransform:
    """The final-logit transform of a model with this config (the identity for most)."""
    text = text_config(config)
    scale = getattr(text, "logit_scale", None)
    scaling = getattr(text, "logits_scaling", None)
    cap = getattr(text, "final_logit_softcapping", None)
    return LogitTransform(multiply=float(scale) if scale else 1.0, divide=float(scaling) if scaling else 1.0,
                          softcap=float(cap) if cap else 0.0)


_TRANSFORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its LogitTransform, read once


def final_logits(model: nn.Module, h: torch.Tensor, transform: LogitTransform | None = None) -> torch.Tensor:
    """The logits `model` itself returns for final hidden states h [..., d]: its LM head, then its transform (read
    from its config once per model: this runs every verify step). Compiled code passes `transform`, read before
    compiling: a traced lookup in the weak-keyed cache would be guarded on that cache's size, which the garbage
    collector changes (torch.compile then fails the guard on the frame it just built)."""
    if transform is None:
        transform = _TRANSFORMS.get(model)
        if transform is None:
            transform = _TRANSFORMS[model] = logit_transform(model.config)
    logits = model.get_output_embeddings()(h)
    return logits if transform.identity else transform(logits)


def decoder(model: nn.Module) -> nn.Module:
    """The causal LM's decoder, whose output is h (`last_hidden_state`): its `base_model`, or where a model's
    `base_model_prefix` names no attribute of its own (Llama-4's text model says "language_model" and keeps it in
    `model`), the child that holds it."""
    base = model.base_model
    if base is model:
        for name in ("model", "transformer", "language_model", "decoder"):
            child = getattr(model, name, None)
            if isinstance(child, nn.Module):
                return child
    return base


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's stack of decoder layers (the base model's ModuleList with one entry per hidden layer)."""
    config = text_config(model.config)
    n = getattr(config, "num_hidden_layers", None)
    # the shallowest ModuleList of that length (OPT keeps it in model.decoder.layers, most in model.layers)
    found = [(name.count("."), not name.endswith("layers"), name, m) for name, m in decoder(model).named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == n]
    if found:
        return min(found, key=lambda f: f[:3])[3]
    raise ValueError(f"{getattr(config, 'model_type', type(model).__name__)}: no stack of {n} decoder layers found "
                     "in its base model, so its intermediate states cannot be read (heads.kind=eagle3 needs them)")


@contextmanager
def capture_layers(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[list[torch.Tensor]]:
    """While open, every forward of `model` appends the states at `layer_ids` to the yielded list, in that order.
    Layer id i is the input of decoder layer i (0: the embeddings' output; L, the layer count: the last layer's
    output before the final norm), as vLLM and speculators count EAGLE-3's auxiliary layers; it equals
    `output_hidden_states[i]` without keeping every layer's states alive."""
    layers = decoder_layers(model)
    got: dict[int, torch.Tensor] = {}
    out: list[torch.Tensor] = []

    def keep(i: int, x) -> None:
        got[i] = x[0] if isinstance(x, tuple) else x
        if len(got) == len(set(layer_ids)):
            out.extend(got[j] for j in layer_ids)
            got.clear()

    bad = [i for i in layer_ids if not 0 <= i <= len(layers)]
    if bad:
        raise ValueError(f"layer id {bad[0]} is out of range for a target with {len(layers)} layers (0..{len(layers)})")
    handles = []
    for i in sorted(set(layer_ids)):
        if i == 0:
            handles.append(layers[0].register_forward_pre_hook(
                lambda m, args, kwargs: keep(0, args[0] if args else kwargs["hidden_states"]), with_kwargs=True))
        else:
            handles.append(layers[i - 1].register_forward_hook(lambda m, args, output, i=i: keep(i, output)))
    try:
        yield out
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def target_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  layers: Sequence[int] = ()) -> torch.Tensor:
    """h [B, T, d]: the target's final post-norm hidden state, what its LM head consumes; with `layers`, the
    states at those layers concatenated after it: [B, T, (1 + len(layers)) d] (`capture_layers`).

    Read from the decoder's own output (`model.base_model(...).last_hidden_state`), so no model code is
    copied or patched; the decoder applies its final norm before returning it for every HF causal LM.
    """
    return hidden_with_layers(model, layers, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


def hidden_with_layers(model: nn.Module, layers: Sequence[int], **forward_kwargs) -> torch.Tensor:
    """`model.base_model(**forward_kwargs).last_hidden_state`, followed on the last dimension by the states at
    `layers` (`capture_layers`) when there are any: the one forward behind training's `target_hidden` and the
    engine's `inference.engine.verify.target_forward`."""
    if not layers:
        return decoder(model)(**forward_kwargs).last_hidden_state
    with capture_layers(model, layers) as states:
        h = decoder(model)(**forward_kwargs).last_hidden_state
    return torch.cat([h, *states], dim=-1)


def chunk_positions(chunk_size: int, batch: int, vocab: int, device: torch.device) -> int:
    """Positions along T per chunk: about `chunk_size` positions over the batch, capped on a CPU so that a
    [rows, vocab] fp32 tensor stays under CPU_CHUNK_BYTES."""
    rows = chunk_size if device.type != "cpu" else min(chunk_size, CPU_CHUNK_BYTES // (4 * vocab))
    return max(1, rows // batch)


def greedy_tokens(lm_head: nn.Module, h: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """The target's greedy token at every position of h [..., T, d] -> [..., T], chunked over positions."""
    flat = h.reshape(-1, h.shape[-1]).to(lm_head.weight.dtype)
    rows = chunk_positions(chunk_size, 1, lm_head.weight.shape[0], flat.device)
    with torch.no_grad():  # argmax in the logits' own dtype: a cast to fp32 would not change it
        out = [lm_head(flat[a:a + rows]).argmax(-1) for a in range(0, flat.shape[0], rows)]
    return torch.cat(out).view(h.shape[:-1])
