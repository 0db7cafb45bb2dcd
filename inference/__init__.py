"""Speculative generation with draft heads: tree drafting, one-forward tree verification, exact greedy
and lossless sampling on any Hugging Face causal LM that takes a 4D attention mask and position ids.

    from inference import SpeculativeGenerator
    gen = SpeculativeGenerator.from_pretrained("runs/x")           # heads dir; target from its config
    out = gen.generate("def fib(n):", max_new_tokens=256)          # out.text, out.token_ids, out.stats

The engine (what one generation touches) is `inference.engine`; beside it are the command lines that use it
(`python -m inference.generate`) and the instruments that measure it (`inference.bench`, `inference.oracle`,
`inference.profile_step`). Names are imported lazily, so a command line loads only what it uses.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "inference.engine.generator": ("SpeculativeGenerator", "GenerationOutput", "GenerationStats"),
    "inference.engine.support": ("ContextLengthError", "UnsupportedModelError"),
    "inference.engine.drafters": ("Drafter", "DraftContext", "TreeDrafter", "HeadsDrafter", "NGramDrafter",
                                  "HybridDrafter"),
    "inference.engine.bigram": ("BigramDrafter",),
    "inference.engine.tree": ("Tree", "TreeTopology", "static_tree_search", "topology_from_paths"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'inference' has no attribute {name!r}")
