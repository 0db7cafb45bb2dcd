"""Speculative generation with draft heads: tree drafting, one-forward tree verification, exact greedy
and lossless sampling on any Hugging Face causal LM that takes a 4D attention mask and position ids."""

from inference.drafters import BigramDrafter, DraftContext, Drafter, HeadsDrafter, NGramDrafter, TreeDrafter
from inference.generate import (ContextLengthError, GenerationOutput, GenerationStats, SpeculativeGenerator,
                                UnsupportedModelError)
from inference.tree import Tree, TreeTopology, static_tree_search, topology_from_paths

__all__ = [
    "BigramDrafter", "ContextLengthError", "DraftContext", "Drafter", "GenerationOutput", "GenerationStats",
    "HeadsDrafter", "NGramDrafter", "SpeculativeGenerator", "Tree", "TreeDrafter", "TreeTopology",
    "UnsupportedModelError", "static_tree_search", "topology_from_paths",
]
