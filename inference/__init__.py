"""Speculative generation with draft heads: tree drafting, one-forward tree verification, exact greedy
and lossless sampling on any Hugging Face causal LM that takes a 4D attention mask and position ids.

    from inference import SpeculativeGenerator
    gen = SpeculativeGenerator.from_pretrained("runs/x")           # heads dir; target from its config
    out = gen.generate("def fib(n):", max_new_tokens=256)          # out.text, out.token_ids, out.stats

Names are imported lazily, so `python -m inference.generate` does not import its own module twice.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SpeculativeGenerator": "inference.generate", "GenerationOutput": "inference.generate",
    "GenerationStats": "inference.generate", "ContextLengthError": "inference.generate",
    "UnsupportedModelError": "inference.generate",
    "Drafter": "inference.drafters", "DraftContext": "inference.drafters", "TreeDrafter": "inference.drafters",
    "HeadsDrafter": "inference.drafters", "NGramDrafter": "inference.drafters", "BigramDrafter": "inference.drafters",
    "HybridDrafter": "inference.drafters",
    "Tree": "inference.tree", "TreeTopology": "inference.tree", "static_tree_search": "inference.tree",
    "topology_from_paths": "inference.tree",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'inference' has no attribute {name!r}")
