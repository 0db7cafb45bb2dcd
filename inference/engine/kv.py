"""The one module that touches the KV cache.

The engine uses a plain `transformers.DynamicCache` (full-attention layers, tensors
`[B, kv_heads, T, head_dim]`). After a verify forward the cache holds the committed prefix followed by
every tree node; `compact_cache` moves the accepted path's entries right after the prefix and drops the
rest, so the cache again equals the cache of plain decoding over the committed tokens.
These calls change between transformers versions; keep them here.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer


def new_cache() -> DynamicCache:
    """An empty cache of full-attention layers (no sliding-window eviction: the engine checks the window
    is never exceeded, because the tree mask is passed to the model as is)."""
    return DynamicCache()


def new_static_cache(model: nn.Module, capacity: int) -> StaticCache:
    """A preallocated cache of `capacity` positions per layer (`inference.engine.compiled`): its tensors never move, so
    compiled forwards and CUDA graphs write into them in place. Allocated now, on the model's device and dtype,
    not at the first write."""
    from medusa_train.target.model import text_config

    config = text_config(model.config)
    cache = StaticCache(config=config, max_cache_len=capacity)
    # full-attention layers throughout, as `new_cache` has: the engine keeps every sequence inside the sliding
    # window (`context_limit`), where a window layer would only be a different code path for the same math
    cache.layers = [StaticLayer(max_cache_len=capacity) for _ in cache.layers]
    weight = model.get_output_embeddings().weight
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    cache.early_initialization(1, kv_heads, head_dim, weight.dtype, weight.device)
    return cache


def is_static(cache) -> bool:
    return isinstance(cache, StaticCache)


def set_static_length(cache: StaticCache, length: int) -> None:
    """Where the next write into a static cache goes: each layer's own counter (a device scalar, set with fill_,
    which is no host sync). Entries past it stay in memory, masked out of every later forward."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held (the committed prefix length between steps)."""
    return cache.get_seq_length()


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [B, kv_heads, T, head_dim] (read-only use: tests and checks)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def crop_cache(cache: DynamicCache | StaticCache, length: int) -> None:
    """Drop every entry at position >= length."""
    if is_static(cache):
        set_static_length(cache, length)
        return
    extra = cache_length(cache) - length
    if extra > 0:  # crop(0) would be a no-op anyway, but crop(-0) == crop(0) reads as a length on old versions
        cache.crop(-extra)


def compact_cache(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Keep the accepted tree nodes' entries, in order, right after the prefix; drop the other nodes.

    keep: [n] long, indices of the accepted nodes within the tree (ascending, keep[0] = 0: the root).
    Entries for tree node i sit at position prefix_len + i.
    """
    n = keep.shape[0]
    src = keep + prefix_len  # [n]
    for layer in cache.layers:
        # index_select copies first, so the overlapping in-place write below is safe; since keep[j] >= j
        # this only moves entries towards the prefix.
        layer.keys[..., prefix_len:prefix_len + n, :] = layer.keys.index_select(-2, src)
        layer.values[..., prefix_len:prefix_len + n, :] = layer.values.index_select(-2, src)
    crop_cache(cache, prefix_len + n)
