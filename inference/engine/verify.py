"""Verify a draft tree with one target forward, then accept a path.

Three acceptance rules, all vectorised over the tree so the only host sync of a step is reading the
result (`Acceptance.to_host`):

- greedy (`exact`, temperature 0): a node is right if its token is the target's argmax after its parent;
  keep the deepest node whose whole path is right; the bonus token is the argmax after it.
- lossless (`exact`, temperature > 0): recursive rejection sampling over sibling candidates. Candidates
  are deterministic (top-k of the drafter), so trying child c under the residual target distribution p
  accepts it with probability p(c); on rejection p(c) is zeroed and p renormalised. With all children
  rejected the bonus is sampled from the residual. The output distribution is exactly the target's.
- typical (Medusa): a node is right if p(token) > min(threshold, alpha * exp(-H(p))) under its parent's
  distribution. Faster, but LOSSY: the output no longer follows the target's distribution.

Notation: p[i] is the target's (temperature / top-p warped) distribution for the token after node i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from inference.engine.kernels import tree_attention
from inference.engine.kv import cache_length
from medusa_train.target.model import cache_kwargs
from inference.engine.tree import Tree, tree_attention_mask, tree_position_ids
from medusa_train.target.model import decoder, final_logits, hidden_with_layers

TYPICAL_THRESHOLD = 0.09  # Medusa's posterior_threshold (epsilon)
TYPICAL_ALPHA = 0.3  # Medusa's posterior_alpha (delta)


def target_forward(model: nn.Module, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, layers: Sequence[int] = ()) -> torch.Tensor:
    """The target's final post-norm hidden states h: [1, T, d], appending T entries to `cache`; with `layers` (a
    drafter's `target_layers`), the states at those layers follow h: [1, T, (1 + len(layers)) d]."""
    return hidden_with_layers(model, layers, input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=True, **cache_kwargs(decoder(model), cache))


def verify_tree(model: nn.Module, cache, tree: Tree, layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over every tree node: (logits [N, V], h [N, d], or with `layers` the features
    [N, (1 + len(layers)) d], h first).

    The cache holds exactly the committed prefix; the tree's entries are appended after it.
    """
    prefix_len = cache_length(cache)
    dtype = model.get_output_embeddings().weight.dtype
    mask = tree_attention_mask(tree.ancestors, prefix_len, dtype)  # [1, 1, N, prefix_len + N]
    position_ids = tree_position_ids(tree.depth, prefix_len)  # [1, N]
    with tree_attention(model):  # grouped-query heads read in place on a CPU, not copied per layer
        h = target_forward(model, tree.tokens[None], cache, mask, position_ids, layers)[0]  # [N, d or more]
    d = model.get_output_embeddings().weight.shape[1]
    return final_logits(model, h[:, :d] if layers else h), h


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Softmax of logits / temperature in float32, restricted to the top-p nucleus and renormalised
    (the same nucleus rule as transformers' TopPLogitsWarper: drop the tokens whose ascending cumulative
    probability is <= 1 - top_p, always keeping the most likely token). [..., V]"""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(p, dim=-1)  # ascending
        drop_sorted = sorted_p.cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        p = p.masked_fill(drop, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample_token(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from each row of p [..., V] without a host sync (argmax of p / Exp(1) noise)."""
    noise = torch.empty_like(p).exponential_(generator=generator)
    return torch.argmax(p / noise, dim=-1)


@dataclass
class Acceptance:
    """The accepted path of one step, on device.

    path: [D + 1] node indices, the first `n` being root..best in order (the rest is padding).
    n: [] number of accepted nodes, root included (>= 1). best: [] the deepest accepted node.
    bonus: [] the target's own next token after `best` (the next tree's root).
    """

    path: torch.Tensor
    n: torch.Tensor
    best: torch.Tensor
    bonus: torch.Tensor

    def to_host(self, tree: Tree) -> tuple[int, list[int]]:
        """The step's one host sync: (n, [accepted draft tokens after the root..., bonus])."""
        packed = torch.cat([self.n.view(1), tree.tokens[self.path[1:]], self.bonus.view(1)]).tolist()
        n = packed[0]
        return n, packed[1:n] + [packed[-1]]


def deepest_path(tree: Tree, right: torch.Tensor, bonus_of: torch.Tensor | None = None) -> Acceptance:
    """The deepest node whose path from the root is all `right` ([N] bool, root counted right).
    Ties go to the lower index (the drafter's preferred node). bonus_of: [N] token per node, or None
    to fill the bonus in later."""
    n_nodes = tree.size
    reached = ~(tree.ancestors & ~right[None, :]).any(-1)  # [N]
    best = torch.argmax(torch.where(reached, tree.depth, -1))  # first maximum
    idx = torch.arange(n_nodes, device=right.device)
    order = torch.sort(torch.where(tree.ancestors[best], idx, n_nodes + idx)).values  # path first, in depth order
    path = order[: tree.max_depth + 1].clamp_max(n_nodes - 1)
    bonus = bonus_of[best] if bonus_of is not None else best
    return Acceptance(path=path, n=tree.depth[best] + 1, best=best, bonus=bonus)


def accept_greedy(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Longest path of nodes equal to the target's argmax, plus the argmax after it."""
    g = logits.argmax(-1)  # [N] the target's next token after each node
    right = tree.tokens == g[tree.parents]
    right[0] = True
    return deepest_path(tree, right, g)


def _earlier_siblings(tree: Tree) -> torch.Tensor:
    """[N, N] bool: [i, j] = j is a sibling of i tried before it (j < i, same parent, neither the root)."""
    n = tree.size
    idx = torch.arange(n, device=tree.tokens.device)
    same_parent = tree.parents[:, None] == tree.parents[None, :]
    return same_parent & (idx[None, :] < idx[:, None]) & (idx[None, :] > 0)


def accept_lossless(tree: Tree, p: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
    """Recursive rejection sampling over deterministic sibling candidates (lossless).

    At a node with residual target distribution p_res, child c_i is accepted with probability
    p_res(c_i) = p(c_i) / (1 - sum of p over the distinct earlier siblings); equivalently child i is
    taken if its own uniform u_i < that ratio and no earlier sibling was taken. A child repeating an
    earlier sibling's token has p_res = 0. The bonus is drawn from p at the last accepted node with its
    children's tokens zeroed (all of them were rejected; a leaf zeroes nothing).
    """
    n = tree.size
    nonroot = torch.arange(n, device=p.device) > 0
    pc = p[tree.parents, tree.tokens]  # [N] p(token of i | path to its parent)
    earlier = _earlier_siblings(tree)  # [N, N]
    dup = (earlier & (tree.tokens[:, None] == tree.tokens[None, :])).any(-1)  # [N]
    mass_before = (earlier & ~dup[None, :]).to(pc.dtype) @ pc  # [N] residual mass already rejected
    ratio = torch.where(dup, 0.0, pc / (1 - mass_before).clamp_min(1e-12))
    u = torch.rand(n, generator=generator, device=p.device)
    passes = (u < ratio) & nonroot
    taken = passes & ~(earlier & passes[None, :]).any(-1)
    taken[0] = True
    acc = deepest_path(tree, taken)
    # residual at the last accepted node: its (all rejected) children's tokens removed
    children = (tree.parents == acc.best) & nonroot  # [N]
    removed = torch.zeros(p.shape[-1], device=p.device, dtype=p.dtype).index_add_(0, tree.tokens,
                                                                                 children.to(p.dtype)) > 0
    residual = p[acc.best].masked_fill(removed, 0.0)
    total = residual.sum()
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p[acc.best])  # guard rounding
    acc.bonus = sample_token(residual, generator)
    return acc


def accept_typical(tree: Tree, p: torch.Tensor, generator: torch.Generator | None,
                   threshold: float = TYPICAL_THRESHOLD, alpha: float = TYPICAL_ALPHA) -> Acceptance:
    """Medusa's typical acceptance (LOSSY): node i is right if p_parent(token_i) > min(threshold,
    alpha * exp(-entropy(p_parent))); the bonus is sampled from p at the deepest right node."""
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [N]
    limit = torch.clamp(alpha * torch.exp(-entropy), max=threshold)  # [N]
    right = p[tree.parents, tree.tokens] > limit[tree.parents]
    right[0] = True
    acc = deepest_path(tree, right)
    acc.bonus = sample_token(p[acc.best], generator)
    return acc
