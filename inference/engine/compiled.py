"""The compiled verify: a static KV cache and one compiled target forward per tree size (`compile=True`).

The eager engine grows a `DynamicCache` and runs the model's forward as it is: every verify re-dispatches each
of the model's few hundred small ops from Python, which on a GPU costs more than the arithmetic of a 7-8B
target at batch 1. Here the cache is a transformers `StaticCache` of fixed capacity, and a verify over N tree
nodes runs a function compiled once for a fixed row count B >= N (the next of `BUCKETS`), so its shapes never
change: `torch.compile` fuses it, and on CUDA `mode="reduce-overhead"` records it as a CUDA graph that each step
replays in one launch.

- The tree is padded to B rows: pad rows hold token 0 at the root's position and attend to the prefix and to
  themselves only; no real node attends to them, and their cache entries, written after the real nodes', are
  dropped by the compaction like any rejected node's (`inference.engine.kv.compact_cache`).
- The attention mask covers the whole capacity: [1, 1, B, capacity], built inside the compiled function from
  the prefix length (a 0-d tensor, so a new length is new data, not a new graph) and the tree's ancestors.
- The cache's capacity is reserved per `generate` call (prompt + new tokens + room for a tree), rounded up to
  `CAPACITY_STEP`; a longer request, or a tree wider than that room, allocates a larger cache (keeping what the
  old one held), and the function is compiled again for it.
- The prefill runs eagerly (one forward over the prompt, a shape that differs every call) into the same cache.

Exactly what the eager engine computes, in the same order per row (tested on the CPU against plain greedy
decoding); only the kernels differ, as they do between any two row counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from inference.engine.kernels import undo_onednn_linear
from inference.engine.kv import new_static_cache, set_static_length
from medusa_train.target.model import cache_kwargs
from inference.engine.tree import Tree
from medusa_train.target.model import decoder, final_logits, hidden_with_layers, logit_transform

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # verify row counts compiled for (a tree is padded to the next)
CAPACITY_STEP = 256  # cache capacity is reserved in multiples of this (each new capacity compiles again)


def bucket(n: int) -> int:
    """The compiled row count a tree of n nodes runs at."""
    for b in BUCKETS:
        if b >= n:
            return b
    raise ValueError(f"a tree of {n} nodes is wider than the widest compiled verify ({BUCKETS[-1]} rows): "
                     f"lower tree_budget")


def static_mask(ancestors: torch.Tensor, prefix: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, B, capacity] additive mask of B rows written at positions prefix..prefix+B-1 of a static cache:
    0 where row i may attend (every position before `prefix`, and prefix + j for j in its ancestors, itself
    included), the dtype's minimum elsewhere (stale entries past the rows, and positions never written).
    prefix: a 0-d long tensor."""
    b = ancestors.shape[0]
    rel = torch.arange(capacity, device=ancestors.device) - prefix  # [capacity] column - prefix
    in_tree = (rel >= 0) & (rel < b)
    tree_cols = ancestors.gather(1, rel.clamp(0, b - 1)[None].expand(b, capacity)) & in_tree  # [B, capacity]
    allowed = (rel < 0)[None] | tree_cols
    mask = torch.zeros(b, capacity, dtype=dtype, device=ancestors.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class StaticVerifier:
    """The target's verify forward over a static cache, compiled per bucket (see the module docstring).

    layers: the drafter's `target_layers` (their states follow h in the returned features). mode: the
    `torch.compile` mode; None picks "reduce-overhead" (CUDA graphs) on CUDA and the default elsewhere.
    backend: `torch.compile`'s backend ("inductor"; the tests also use "aot_eager", which traces without code
    generation).
    """

    def __init__(self, model: nn.Module, layers: Sequence[int] = (), mode: str | None = None,
                 backend: str = "inductor"):
        self.model, self.layers = model, tuple(layers)
        undo_onednn_linear(model)  # packed oneDNN linears cannot be compiled (inductor cannot lower them)
        weight = model.get_output_embeddings().weight
        self.device, self.dtype, self.hidden_size = weight.device, weight.dtype, weight.shape[1]
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"
        self.cache = None
        self.capacity = 0
        (self._cache_key,) = cache_kwargs(decoder(model), None)  # decided here, not inside the compiled region
        # the prefix length as a device scalar, set with fill_ (a kernel argument: no host-to-device copy to wait
        # for), so a new length is new data for the compiled function, not a new graph
        self._prefix = torch.zeros((), dtype=torch.long, device=self.device)
        self.transform = logit_transform(model.config)  # read here, never inside the compiled frame
        self._forward = torch.compile(self._verify_rows, dynamic=False, mode=mode, backend=backend)

    def reserve(self, length: int, keep: int = 0) -> None:
        """Make the cache hold at least `length` positions: when it does not, a larger one is allocated, holding
        the first `keep` positions of the old one."""
        if length <= self.capacity:
            return
        old = self.cache
        self.capacity = -(-length // CAPACITY_STEP) * CAPACITY_STEP
        self.cache = new_static_cache(self.model, self.capacity)
        if keep:
            for new_layer, old_layer in zip(self.cache.layers, old.layers):
                new_layer.keys[..., :keep, :] = old_layer.keys[..., :keep, :]
                new_layer.values[..., :keep, :] = old_layer.values[..., :keep, :]

    def _run(self, tokens: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor, prefix: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = static_mask(ancestors, prefix, self.capacity, self.dtype)
        h = hidden_with_layers(self.model, self.layers, input_ids=tokens[None], attention_mask=mask,
                               position_ids=(depth + prefix)[None], use_cache=True,
                               **{self._cache_key: self.cache})[0]  # [B, d or more]
        return h

    def _verify_rows(self, tokens, depth, ancestors, prefix):
        h = self._run(tokens, depth, ancestors, prefix)
        return final_logits(self.model, h[:, :self.hidden_size], self.transform), h

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt ([1, T]) into an emptied cache, eagerly: its features [T, d or more]."""
        t = input_ids.shape[1]
        self.reserve(t + 1)
        set_static_length(self.cache, 0)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        prefix = torch.zeros((), dtype=torch.long, device=input_ids.device)
        return self._run(input_ids[0], torch.arange(t, device=input_ids.device), causal, prefix)

    def verify(self, tree: Tree, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One compiled forward over the tree's nodes written after `prefix_len` committed positions: (logits
        [N, V], features [N, d or more]) of the real nodes. The cache then holds prefix + B entries; the
        compaction keeps the accepted ones."""
        n = tree.size
        b = bucket(n)
        self.reserve(prefix_len + b, keep=prefix_len)  # a no-op unless a wide tree outruns what prefill reserved
        tokens, depth, ancestors = tree.tokens, tree.depth, tree.ancestors
        if b > n:  # pad rows: token 0 at the root's position, seeing the prefix and themselves
            pad = b - n
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            depth = torch.cat([depth, depth.new_zeros(pad)])
            ancestors = torch.eye(b, dtype=torch.bool, device=ancestors.device)
            ancestors[:n, :n] = tree.ancestors
        logits, h = self._forward(tokens, depth, ancestors, self._prefix.fill_(prefix_len))
        # under CUDA graphs the outputs live in the graph's memory, which the next replay overwrites: copy
        # out the real rows (what the step reads, and the state it keeps)
        return logits[:n].clone(), h[:n].clone()
