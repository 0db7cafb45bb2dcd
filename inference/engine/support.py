"""Which targets the engine can run, and how long a sequence it may build on them.

`check_supported` refuses what cannot verify a tree (from the config, before any forward); `check_tree_attention`
proves the rest on a small tree at load (its logits equal plain forwards along each branch); `context_limit` is
the longest sequence a generation may reach.
"""

from __future__ import annotations

import torch
from torch import nn

from inference.engine.kv import new_cache
from inference.engine.tree import tree_from_parents
from inference.engine.verify import target_forward, verify_tree
from medusa_train.target.model import decoder, final_logits, text_config, unsupported_reason


class UnsupportedModelError(ValueError):
    """The target cannot verify a tree through its ordinary forward (names the model_type and why)."""


class ContextLengthError(ValueError):
    """The prompt plus the requested new tokens do not fit the target's context."""



def check_supported(model: nn.Module) -> None:
    """Refuse targets that cannot verify a tree with a 4D mask, position ids and a croppable cache."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    if getattr(model, "get_output_embeddings", None) is None or model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{model_type}: the target needs an LM head; load it with "
                                    f"AutoModelForCausalLM")
    reason = unsupported_reason(config) if config is not None else None
    if reason:
        raise UnsupportedModelError(f"{model_type}: {reason}")
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(f"{model_type}: its recurrent state cannot be rolled back to an accepted "
                                    f"tree path, so tree verification would be wrong")
    attn = getattr(config, "_attn_implementation", None) or ""
    if attn.startswith("flash_attention") or attn.startswith("paged"):
        raise UnsupportedModelError(f"{model_type}: attn_implementation={attn!r} cannot take a custom 4D tree "
                                    f"mask; load the target with attn_implementation='sdpa' (or 'eager')")


def context_limit(model: nn.Module) -> int | None:
    """Longest sequence the engine may build: max_position_embeddings, and the sliding window / attention
    chunk if any layer uses one (the tree mask is passed as is, so windows are never applied)."""
    text = text_config(model.config)
    limits = []
    max_pos = getattr(text, "max_position_embeddings", None)
    if max_pos:
        limits.append(int(max_pos))
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        if "sliding_attention" in layer_types and getattr(text, "sliding_window", None):
            limits.append(int(text.sliding_window))
        if "chunked_attention" in layer_types and getattr(text, "attention_chunk_size", None):
            limits.append(int(text.attention_chunk_size))
    elif getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        limits.append(int(text.sliding_window))
    return min(limits) if limits else None


def check_tree_attention(model: nn.Module) -> None:
    """Self-check at load: logits of a small tree forward equal, node for node, the model's own logits
    of plain forwards along each branch (catches forwards that ignore the 4D mask or position ids, and
    output layers that post-process logits)."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    weight = model.get_output_embeddings().weight
    vocab, device = weight.shape[0], weight.device
    prompt = (torch.arange(6, device=device) * 7 + 3) % vocab
    r, a, b, c = ((torch.arange(4, device=device) * 11 + 5) % vocab).tolist()
    tree = tree_from_parents(torch.tensor([r, a, b, c], device=device), torch.tensor([0, 0, 0, 1], device=device),
                             torch.tensor([0, 1, 1, 2], device=device), 2)
    try:
        with torch.inference_mode():
            cache = new_cache()
            target_forward(model, prompt[None], cache)
            stateful = [type(layer).__name__ for layer in getattr(cache, "layers", [])
                        if not hasattr(layer, "keys") or "Linear" in type(layer).__name__]
            if stateful:
                raise UnsupportedModelError(f"{model_type}: its cache holds {stateful[0]} layers (a recurrent state, "
                                            "not per-token keys and values), which cannot be rolled back to the "
                                            "accepted path of a verified tree")
            got, _ = verify_tree(model, cache, tree)  # [4, V]
            branch_1 = torch.cat([prompt, torch.tensor([r, a, c], device=device)])[None]
            branch_2 = torch.cat([prompt, torch.tensor([r, b], device=device)])[None]
            want_1 = model(input_ids=branch_1).logits[0, -3:]  # nodes 0, 1, 3
            want_2 = model(input_ids=branch_2).logits[0, -1:]  # node 2
    except UnsupportedModelError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the model's own code raises on a tree, one line, not a traceback
        raise UnsupportedModelError(
            f"{model_type}: its forward fails on a tree (a 4D attention mask with position ids): "
            f"{type(e).__name__}: {' '.join(str(e).split())[:160]}; this architecture is not supported") from None
    want = torch.cat([want_1[:2], want_2, want_1[2:]]).float()
    tol = 1e-3 if weight.dtype in (torch.float32, torch.float64) else 5e-2
    err = (got.float() - want).abs().max().item()
    if not err <= tol * (1 + want.abs().max().item()):
        # which cause: the final logits of a plain forward, recomputed from its hidden states, tell them apart
        try:
            with torch.inference_mode():
                ids = torch.cat([prompt, torch.tensor([r], device=device)])[None]
                own = model(input_ids=ids).logits[0, -1].float()
                ours = final_logits(model, decoder(model)(input_ids=ids).last_hidden_state[0, -1]).float()
            off = (own - ours).abs().max().item()
            post_processed = not off <= tol * (1 + own.abs().max().item())
        except Exception:  # noqa: BLE001 - its decoder's output is not what a causal LM's is: that is the cause
            off, post_processed = float("nan"), True
        cause = (f"its logits are not its output layer (and the transform its config declares) applied to its "
                 f"final hidden states: the forward post-processes them (off by {off:.3g})" if post_processed else
                 f"its forward does not honour a custom 4D attention mask and position ids (tree logits off by "
                 f"{err:.3g})")
        raise UnsupportedModelError(f"{model_type}: tree verification self-check failed: {cause}; this architecture "
                                    "is not supported")
