"""CPU matmul kernels for a frozen float32 target at inference: the one place that chooses them.

On a CPU, PyTorch runs a float32 `nn.Linear` through MKL: a GEMV for one row and a GEMM for more. For the
small row counts of speculative decoding (2-16 tree nodes) that GEMM is slow: on 2 cores of an AMD EPYC
(Zen 5), SmolLM2-135M's decoder linears took 40 ms for one row, 59 ms for 2 and 8 rows and 78 ms for 16;
oneDNN's float32 matmul (the same library PyTorch uses for bfloat16) took 26, 24, 28 and 43 ms (weights
cold in cache, as in a real forward). So a tree verify costs little more than a one-token forward, as on
a GPU, and plain decoding gets faster too.

`use_onednn_linear(model)` routes every float32 CPU `nn.Linear` of a model through oneDNN. It is an
inference-time kernel choice, not a change of model code: the math is the same float32 matmul, rounded in
another order (differences ~1e-6, like the GEMV/GEMM difference itself). Apply it to the model that every
method shares (the benchmark does), so plain decoding is measured with the same kernels as speculation.
Inputs that need gradients, other dtypes and other devices keep `F.linear`.

Weights are also kept pre-packed in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
what torch.compile's CPU backend does for frozen linears), so no call re-lays them out. On the same machine
a SmolLM2-135M forward's linear layers then took 23-27 ms for 1-9 rows where the plain oneDNN call took
31-41 ms: a one-token forward gets faster, a tree verify more so. The packed copy is an extra, opaque tensor
per layer (as much memory again as the weights); it is rebuilt when the weight changes in place and is never
part of the state dict. `use_onednn_linear(model, pack=False)` skips it.
"""

from __future__ import annotations

import functools
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward


@functools.cache
def _onednn_op():
    try:
        return torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


def onednn_linear_available() -> bool:
    return _onednn_op() is not None


# Row count the packed layout is chosen for: 2, 8 and 16 measured alike for 1-16 rows (1 keeps the plain layout).
PACK_ROWS = 8
# nn.Linear -> (the weight it was packed from, that weight's version, packed weight); weak, so copies and freed
# models pack afresh. Holding the weight itself (not its address) means a replaced weight is never mistaken
# for the old one.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _pack_op():
    try:
        return torch.ops.mkldnn._reorder_linear_weight if onednn_linear_available() else None
    except (AttributeError, RuntimeError):
        return None


def _packed_weight(module: nn.Linear) -> torch.Tensor:
    """The module's weight in oneDNN's blocked layout, packed again whenever the weight was replaced or changed
    in place (writes through `.data` bypass the version counter: call `use_onednn_linear` again after those)."""
    weight = module.weight
    entry = _PACKED.get(module)
    if entry is None or entry[0] is not weight or entry[1] != weight._version:
        entry = (weight, weight._version, _pack_op()(weight.detach(), PACK_ROWS))
        _PACKED[module] = entry
    return entry[2]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` on oneDNN (weights as stored) where `use_onednn_linear` would use it."""
    if (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and onednn_linear_available()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return _onednn_op()(x, weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)


def _onednn_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu" and w.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return _onednn_op()(x, _packed_weight(self), self.bias, "none", [None], "")
    return F.linear(x, w, self.bias)


def use_onednn_linear(model: nn.Module, pack: bool = True) -> int:
    """Route the model's float32 CPU `nn.Linear` layers through oneDNN's matmul (in place; idempotent),
    with pre-packed weights unless `pack=False` or this PyTorch cannot pack them.
    Returns how many layers now use it (0 when oneDNN is unavailable or no layer qualifies)."""
    if not onednn_linear_available():
        return 0
    forward = _packed_forward if pack and _pack_op() is not None else _onednn_forward
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.forward = types.MethodType(forward, module)
            _PACKED.pop(module, None)  # a second call repacks (e.g. after writes through `.data`)
            if forward is _packed_forward:
                _packed_weight(module)  # pack now, not in the first timed forward
            n += 1
    return n


def undo_onednn_linear(model: nn.Module) -> int:
    """Give the model's linear layers their own forward back (what `use_onednn_linear` replaced): torch.compile's
    inductor cannot lower the packed oneDNN op, and generates its own kernels anyway. Returns how many changed."""
    n = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and "forward" in vars(module):
            del module.forward
            _PACKED.pop(module, None)
            n += 1
    return n


# (in_features, out_features, has bias, rows) -> whether packed oneDNN beat MKL on this machine, timed once a process
_FASTER_ONEDNN: dict[tuple[int, int, bool, int], bool] = {}


def _onednn_is_faster(layer: nn.Linear, rows: int, calls: int = 40) -> bool:
    """Time `layer` on `rows` rows both ways (MKL's F.linear, packed oneDNN), best of three rounds each."""
    key = (layer.in_features, layer.out_features, layer.bias is not None, rows)
    if key not in _FASTER_ONEDNN:
        import time

        probe = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        x = torch.randn(rows, layer.in_features)

        def best(forward) -> float:
            rounds = []
            for _ in range(3):
                forward(x)
                t0 = time.perf_counter()
                for _ in range(calls):
                    forward(x)
                rounds.append(time.perf_counter() - t0)
            return min(rounds)

        with torch.no_grad():
            mkl = best(probe)
            use_onednn_linear(probe)
            _FASTER_ONEDNN[key] = best(probe) < mkl
    return _FASTER_ONEDNN[key]


def use_fastest_linear(model: nn.Module, rows: int) -> int:
    """For small modules called on a few rows at a time (a drafter's heads): each float32 CPU `nn.Linear` runs on
    whichever of MKL and packed oneDNN this machine runs faster for its shape at `rows` rows, timed once per shape
    and process (a few milliseconds). The winner is the machine's: on 2 cores of an AMD EPYC oneDNN drafted 2x faster,
    on 2 cores of an Intel Xeon with AMX, MKL did (a 384 x 2048 projection of 3 rows: 66 against 112 us). Returns how
    many layers run on oneDNN."""
    if not onednn_linear_available():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            if _onednn_is_faster(module, rows):
                n += use_onednn_linear(module)
            elif "forward" in vars(module):
                del module.forward
                _PACKED.pop(module, None)
    return n


def uses_onednn_linear(model: nn.Module) -> bool:
    return any(getattr(m.forward, "__func__", None) in (_onednn_forward, _packed_forward) for m in model.modules()
               if isinstance(m, nn.Linear))


# ---------------------------------------------------------------------------------------------------
# Attention of a tree verify on a CPU
#
# transformers' `sdpa` attention repeats a grouped-query model's keys and values to every query head
# (`repeat_kv`: a copy of the whole KV cache, per layer, per forward) whenever a mask is passed and more than
# one query row attends, which is every tree verify: its mask is a custom 4D one. On CUDA that keeps the fast
# kernels (they take no mask with grouped heads); on a CPU PyTorch's own kernel reads grouped heads in place
# (`enable_gqa=True`), so the copy is pure overhead: on SmolLM2-135M (9 query / 3 KV heads, 2 cores) it was
# 4-5 ms of a 45-55 ms verify of 2-9 tokens, growing with the prefix. Same kernel, same float32 math: the
# logits came out bitwise equal.

TREE_SDPA = "medusa_tree_sdpa"


def _tree_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or module.training):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_tree_sdpa() -> bool:
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(TREE_SDPA, _tree_sdpa)
        return True
    except (ImportError, AttributeError):
        return False


class tree_attention:
    """`with tree_attention(model):` runs the model's forwards with grouped-query attention read in place on
    a CPU (see above). A no-op unless the model uses transformers' `sdpa` attention and has one config (setting
    a composite config's attention would overwrite its sub-configs' own choices); restores it on exit."""

    def __init__(self, model: nn.Module):
        self.config = getattr(model, "config", None)
        self.active = (self.config is not None and getattr(self.config, "_attn_implementation", None) == "sdpa"
                       and not getattr(self.config, "sub_configs", None) and _register_tree_sdpa())

    def __enter__(self) -> None:
        if self.active:
            self.config._attn_implementation = TREE_SDPA

    def __exit__(self, *exc) -> None:
        if self.active:
            self.config._attn_implementation = "sdpa"
