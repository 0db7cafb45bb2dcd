"""Draft trees: topology, the tree attention mask, position ids, static tree search, dynamic selection.

A tree holds N nodes in topological order (every parent before its children, so `parents[i] < i`), and
within a depth in order of preference. Node 0 is the root: the target's next token, already decided; a
node at depth d proposes token x_{t+1+d}. The verify forward sees node i at position `prefix_len +
depth[i]`, attending to the committed prefix and to its own ancestors (itself included).

Static trees are described, as in Medusa, by *rank paths*: the path `(0, 2)` is the node reached by
taking the top-1 candidate at depth 1 and then the top-3 candidate (rank 2) of its own proposals at
depth 2. The root is the empty path `()`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

Path = tuple[int, ...]

# p(target token == r-th candidate of head k | the path so far is right), used when the heads directory
# has no acceptance.json: roughly what a freshly trained 1-layer head on a small model reaches.
DEFAULT_TOP1 = 0.6
DEFAULT_HEAD_DECAY = 0.8
DEFAULT_RANK_DECAY = 0.3


@dataclass
class Tree:
    """One step's draft tree (all tensors on the target's device).

    tokens: [N] long, token id of each node (node 0 is the root).
    parents: [N] long, parent index (the root points to itself, 0).
    depth: [N] long, 0 for the root.
    ancestors: [N, N] bool, ancestors[i, j] = node j is node i or one of its ancestors.
    max_depth: host int, the deepest node's depth.
    scores: [N] float or None, the drafter's cumulative log-probability of each node's path (root 0), where
    the drafter scores its candidates; NaN for nodes another source added (n-gram lookup grafted on).
    lookup: [N] long or None, for nodes an n-gram lookup proposed the length of the n-gram it matched (0 for
    the others); `inference.engine.calibrate` learns how often each kind of node is accepted.
    confidence: [N] float or None, a confidence head's chance that the node is accepted given its parent (dspark);
    NaN for the root and for nodes another source added.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    max_depth: int
    scores: torch.Tensor | None = None
    lookup: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


@dataclass
class Level:
    """The nodes of one depth of a static topology, grouped by the parent that proposes them.

    parents: [M] the distinct parent nodes (depth d-1) that have children at depth d.
    nodes: [C] the child nodes at depth d; slot: [C] index into `parents`; rank: [C] candidate rank.
    Nodes are numbered depth by depth, so a level's nodes are the range [start, start + C), and indices local to
    the level above (`inner_parents`: `parents` there; `inner_node_parents`: each node's parent there) and into the
    parents' candidates flattened ([M * num_ranks]: `flat`) let drafting gather with a few index_selects and no
    writes (`TreeDrafter.draft_static`). `all_parents`: every node of the level above has children here, in order.
    """

    parents: torch.Tensor
    nodes: torch.Tensor
    slot: torch.Tensor
    rank: torch.Tensor
    num_ranks: int
    start: int = 0
    inner_parents: torch.Tensor | None = None
    inner_node_parents: torch.Tensor | None = None
    flat: torch.Tensor | None = None
    all_parents: bool = False


@dataclass
class TreeTopology:
    """A static tree shape, built once from rank paths and reused every step."""

    paths: list[Path]
    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    levels: list[Level]

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return len(self.levels)

    def with_tokens(self, tokens: torch.Tensor, scores: torch.Tensor | None = None) -> Tree:
        return Tree(tokens, self.parents, self.depth, self.ancestors, self.max_depth, scores)


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N, N] bool, row i marks node i and all its ancestors. `parents[0]` must be 0 (the root)."""
    n = parents.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    anc = eye
    for _ in range(max_depth):  # each pass climbs one more level
        anc = eye | anc[parents]
    return anc


def tree_attention_mask(ancestors: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N, prefix_len + N] additive mask: 0 where a node may attend (prefix, ancestors, itself),
    the dtype's minimum elsewhere."""
    n = ancestors.shape[0]
    neg = torch.finfo(dtype).min
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=ancestors.device)
    mask[:, prefix_len:].masked_fill_(~ancestors, neg)
    return mask[None, None]


def tree_position_ids(depth: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[1, N] position of every node: prefix_len + depth."""
    return (depth + prefix_len)[None]


def complete_paths(paths: Sequence[Sequence[int]]) -> list[Path]:
    """Validate rank paths, add missing prefixes and the root, and sort them into tree order
    (by depth, then by rank path)."""
    out: set[Path] = {()}
    for p in paths:
        path = tuple(p)
        if not all(isinstance(r, int) and r >= 0 for r in path):
            raise ValueError(f"tree paths are tuples of candidate ranks >= 0 (e.g. [(0,), (1,), (0, 0)]), got {p!r}")
        for d in range(1, len(path) + 1):
            out.add(path[:d])
    return sorted(out, key=lambda p: (len(p), p))


def topology_from_paths(paths: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> TreeTopology:
    """Build the static tree (parents, depths, ancestors, per-depth levels) for a list of rank paths."""
    ordered = complete_paths(paths)
    index = {p: i for i, p in enumerate(ordered)}
    parents = [0] + [index[p[:-1]] for p in ordered[1:]]
    depth = [len(p) for p in ordered]
    max_depth = max(depth)
    levels = []
    above = [0]  # the nodes of the level above, in order
    for d in range(1, max_depth + 1):
        nodes = [i for i, p in enumerate(ordered) if len(p) == d]
        level_parents = sorted({parents[i] for i in nodes})
        slot_of = {p: s for s, p in enumerate(level_parents)}
        ranks = [ordered[i][-1] for i in nodes]
        slots = [slot_of[parents[i]] for i in nodes]
        num_ranks = max(ranks) + 1
        local = {node: j for j, node in enumerate(above)}
        levels.append(Level(
            parents=torch.tensor(level_parents, device=device),
            nodes=torch.tensor(nodes, device=device),
            slot=torch.tensor(slots, device=device),
            rank=torch.tensor(ranks, device=device),
            num_ranks=num_ranks,
            start=nodes[0],
            inner_parents=torch.tensor([local[p] for p in level_parents], device=device),
            inner_node_parents=torch.tensor([local[parents[i]] for i in nodes], device=device),
            flat=torch.tensor([s * num_ranks + r for s, r in zip(slots, ranks)], device=device),
            all_parents=level_parents == above,
        ))
        above = nodes
    parents_t = torch.tensor(parents, device=device)
    return TreeTopology(ordered, parents_t, torch.tensor(depth, device=device),
                        ancestor_matrix(parents_t, max_depth), levels)


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, max_depth: int,
                      scores: torch.Tensor | None = None, lookup: torch.Tensor | None = None,
                      confidence: torch.Tensor | None = None) -> Tree:
    """A tree from explicit per-node arrays (nodes must be in topological order)."""
    return Tree(tokens, parents, depth, ancestor_matrix(parents, max_depth), max_depth, scores, lookup, confidence)


def _rank_key(scores: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[N-1] ranking key of the non-root nodes: the path log-probability with a tiny depth penalty, so a
    parent ranks strictly above its children even when log q == 0 (the best nodes then form a tree)."""
    return scores[1:].float() - 1e-4 * depth[1:].float()


def _subtree(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, scores: torch.Tensor | None,
             keep: torch.Tensor, max_depth: int, lookup: torch.Tensor | None = None,
             ancestors: torch.Tensor | None = None, confidence: torch.Tensor | None = None) -> Tree:
    """The tree of the nodes in `keep` ([K] ascending, keep[0] = 0, closed under ancestors), renumbered;
    max_depth may be an upper bound of the kept nodes' depth. `ancestors` (the whole tree's) is cut down rather
    than rebuilt: kept nodes' ancestors are kept nodes."""
    new_index = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    new_index[keep] = torch.arange(keep.shape[0], device=tokens.device)
    parents_kept = new_index[parents[keep]]
    ancestors = ancestor_matrix(parents_kept, max_depth) if ancestors is None else ancestors[keep][:, keep]
    return Tree(tokens[keep], parents_kept, depth[keep], ancestors, max_depth,
                None if scores is None else scores[keep].float(), None if lookup is None else lookup[keep],
                None if confidence is None else confidence[keep])


def trim_keep(path_logp: torch.Tensor, depth: torch.Tensor, costs: Sequence[float], fixed: float = 0.0
              ) -> torch.Tensor | None:
    """The nodes worth their verify rows: the root and the k most probable nodes, k maximising expected
    tokens per second of a step, (1 + sum of their path probabilities) / (costs[k + 1] + fixed), where path_logp
    [N] is each node's log-probability of being accepted (root 0; never above its parent's), costs[n] the
    verify time of n tokens and `fixed` the step's other seconds (its drafting). Returns the kept indices ([k + 1]
    ascending) or None when every node stays. Reads k on the host: meant for CPUs."""
    return best_nodes(path_logp, depth, costs, fixed)[0]


def best_nodes(path_logp: torch.Tensor, depth: torch.Tensor, costs: Sequence[float], fixed: float = 0.0
               ) -> tuple[torch.Tensor | None, float]:
    """`trim_keep`'s choice and its expected tokens per second (on the host, in NumPy: a dozen nodes)."""
    n = path_logp.shape[0]
    if n <= 1:
        return None, 1.0 / (costs[1] + fixed)
    limit = min(n, len(costs) - 1)  # nodes the costs cover
    logp = path_logp.detach().cpu().numpy().astype(np.float64)
    key = _rank_key(path_logp.detach().cpu(), depth.cpu()).numpy()
    order = np.argsort(-key, kind="stable")[:limit - 1] + 1  # best nodes first
    gain = 1 + np.concatenate([[0.0], np.cumsum(np.exp(logp[order].astype(np.float32)), dtype=np.float32)])
    rate = gain / (np.asarray(costs[1:limit + 1], dtype=np.float32) + np.float32(fixed))
    k = int(np.argmax(rate))  # first maximum: the smaller tree on ties
    if k == n - 1:
        return None, float(rate[k])
    return torch.from_numpy(np.sort(np.concatenate([[0], order[:k]])).astype(np.int64)), float(rate[k])


def subtree(tree: Tree, keep: torch.Tensor) -> Tree:
    """The tree of the nodes in `keep` ([K] ascending, keep[0] = 0, closed under ancestors), renumbered."""
    return _subtree(tree.tokens, tree.parents, tree.depth, tree.scores, keep, tree.max_depth, tree.lookup,
                    tree.ancestors, tree.confidence)


def graft_branches(tree: Tree, branches: Sequence[Sequence[int]], max_new: int, share: bool = True,
                   match_lengths: Sequence[int] | None = None) -> Tree:
    """`tree` with token chains (host ints) hung under its root, at most `max_new` new nodes in all.

    share=True: each branch walks down from the root through the tree's children holding its tokens and adds
    only the rest; nodes are then ordered by depth (stable: the tree's own nodes first within a depth). This
    reads the tree on the host. share=False: the branches are appended after the tree's nodes as they are
    (sharing prefixes only among themselves), with no host read, so a GPU step keeps its single sync; a
    branch that repeats tree nodes costs verify rows that are nearly free there, and verification handles
    the repeated siblings (the generator's `Platform.host_reads` decides). Either way parents precede children.
    match_lengths ([len(branches)], default 1 each): the n-gram length behind each branch, recorded in the
    result's `lookup` for every node on the branch (new or shared); new nodes get a NaN score and confidence.
    """
    if match_lengths is None:
        match_lengths = [1] * len(branches)
    if share:
        tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
        marks = [0] * len(tokens) if tree.lookup is None else tree.lookup.tolist()
    else:
        tokens, parents, depth, marks = [0], [0], [0], [0]  # the root only; new nodes are offset below
    child: dict[tuple[int, int], int] = {}
    for i in range(len(tokens) - 1, 0, -1):  # the first of equal siblings wins (the preferred one)
        child[(parents[i], tokens[i])] = i
    added = 0
    for branch, m in zip(branches, match_lengths):
        node = 0
        for tok in branch:
            nxt = child.get((node, int(tok)))
            if nxt is None:
                if added >= max_new:
                    break
                nxt = child[(node, int(tok))] = len(tokens)
                tokens.append(int(tok))
                parents.append(node)
                depth.append(depth[node] + 1)
                marks.append(0)
                added += 1
            node = nxt
            marks[node] = max(marks[node], int(m))
    if not added:
        return tree
    device = tree.tokens.device
    n_old = tree.size if share else 1
    unknown = torch.full((len(tokens) - n_old,), float("nan"), device=device)
    scores = None if tree.scores is None else torch.cat([tree.scores.float(), unknown])
    confidence = None if tree.confidence is None else torch.cat([tree.confidence.float(), unknown])
    if not share:
        offset = tree.size - 1  # new node k (1-based here) becomes tree.size + k - 1
        new_parents = [p + offset if p else 0 for p in parents[1:]]
        old_marks = tree.lookup if tree.lookup is not None else torch.zeros_like(tree.tokens)
        return tree_from_parents(torch.cat([tree.tokens, torch.tensor(tokens[1:], device=device)]),
                                 torch.cat([tree.parents, torch.tensor(new_parents, device=device)]),
                                 torch.cat([tree.depth, torch.tensor(depth[1:], device=device)]),
                                 max(tree.max_depth, max(depth)), scores,
                                 torch.cat([old_marks, torch.tensor(marks[1:], device=device)]), confidence)
    order = sorted(range(len(tokens)), key=lambda i: depth[i])
    where = {old: new for new, old in enumerate(order)}
    index = torch.tensor(order, device=device)
    return tree_from_parents(torch.tensor([tokens[i] for i in order], device=device),
                             torch.tensor([where[parents[i]] for i in order], device=device),
                             torch.tensor([depth[i] for i in order], device=device), max(depth),
                             None if scores is None else scores[index],
                             torch.tensor([marks[i] for i in order], device=device),
                             None if confidence is None else confidence[index])


# ---------------------------------------------------------------------------------------------------
# Static tree search (Medusa): grow the tree greedily by expected accepted length under a node budget


def default_topk_accuracy(num_heads: int, num_ranks: int = 10) -> list[list[float]]:
    """A prior for p(target token == head k's r-th candidate | path right) when none was measured."""
    return [[DEFAULT_TOP1 * DEFAULT_HEAD_DECAY**k * DEFAULT_RANK_DECAY**r for r in range(num_ranks)]
            for k in range(num_heads)]


def static_tree_search(topk_accuracy: Sequence[Sequence[float]], budget: int) -> list[Path]:
    """The `budget` draft nodes (root excluded) that maximise the expected accepted length.

    A node with rank path (r_1..r_d) is accepted with probability prod_k acc[k][r_k] (head k's
    candidates are right independently of rank given the path so far is right). That product only
    shrinks along a path, so taking nodes best-first keeps the set closed under prefixes, and the
    greedy choice is optimal for this objective.
    """
    return [path for path, _ in _best_first_nodes(topk_accuracy, budget)]


def expected_tau_curve(topk_accuracy: Sequence[Sequence[float]], max_budget: int) -> list[float]:
    """Expected tau of the best static tree for every budget 0..max_budget (one search)."""
    curve = [1.0]
    for _, prob in _best_first_nodes(topk_accuracy, max_budget):
        curve.append(curve[-1] + prob)
    return curve + [curve[-1]] * (max_budget + 1 - len(curve))  # ran out of nodes: flat


def _best_first_nodes(topk_accuracy: Sequence[Sequence[float]], budget: int) -> list[tuple[Path, float]]:
    if budget < 0:
        raise ValueError(f"tree budget must be >= 0 draft nodes, got {budget}")
    acc = [list(row) for row in topk_accuracy]
    chosen: list[tuple[Path, float]] = []
    heap: list[tuple[float, Path]] = []

    def push_children(path: Path, value: float) -> None:
        k = len(path)
        if k < len(acc):
            for r, a in enumerate(acc[k]):
                heapq.heappush(heap, (-value * a, path + (r,)))

    push_children((), 1.0)
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append((path, -neg))
        push_children(path, -neg)
    return chosen


def expected_tau(paths: Sequence[Sequence[int]], topk_accuracy: Sequence[Sequence[float]]) -> float:
    """Expected tokens per step of a static tree: 1 (the bonus) + sum over nodes of p(node accepted)."""
    total = 1.0
    for path in complete_paths(paths)[1:]:
        prob = 1.0
        for k, r in enumerate(path):
            row = topk_accuracy[k] if k < len(topk_accuracy) else []
            prob *= row[r] if r < len(row) else 0.0
        total += prob
    return total


# ---------------------------------------------------------------------------------------------------
# Dynamic tree (EAGLE-2): keep the best nodes by cumulative draft log-probability


def select_dynamic_tree(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, scores: torch.Tensor,
                        budget: int, max_depth: int) -> Tree:
    """Keep the root and the `budget` best candidates of an expanded pool.

    tokens, parents, depth, scores: [P] over the pool in topological order, node 0 the root; scores are
    cumulative draft log-probabilities (never larger than the parent's), so the best nodes form a tree.
    A tiny depth penalty makes a parent rank strictly above its children even when log q == 0.
    """
    budget = min(budget, tokens.shape[0] - 1)
    key = _rank_key(scores, depth)
    picked = torch.topk(key, budget).indices + 1 if budget > 0 else key.new_zeros(0, dtype=torch.long)
    keep = torch.cat([picked.new_zeros(1), torch.sort(picked).values])  # [budget + 1], topological order
    return _subtree(tokens, parents, depth, scores, keep, max_depth)
