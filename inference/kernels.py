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
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _onednn_op():
    try:
        return torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


def onednn_linear_available() -> bool:
    return _onednn_op() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for a weight that is not an `nn.Linear` (e.g. gathered LM-head rows), on oneDNN where
    `use_onednn_linear` would use it."""
    if (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and onednn_linear_available()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return _onednn_op()(x, weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)


def _onednn_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def use_onednn_linear(model: nn.Module) -> int:
    """Route the model's float32 CPU `nn.Linear` layers through oneDNN's matmul (in place; idempotent).
    Returns how many layers now use it (0 when oneDNN is unavailable or no layer qualifies)."""
    if not onednn_linear_available():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.forward = types.MethodType(_onednn_forward, module)
            n += 1
    return n


def uses_onednn_linear(model: nn.Module) -> bool:
    return any(getattr(m.forward, "__func__", None) is _onednn_forward for m in model.modules()
               if isinstance(m, nn.Linear))
