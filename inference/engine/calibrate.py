"""How likely each drafted node is to be accepted, learned online from verification, for cost-aware trees.

On a CPU a verify over n tokens costs more than over one (SmolLM2-135M on 2 cores: 8 tokens 1.3x one token,
16 tokens 1.5x), so each step keeps only the drafted nodes worth their rows (`tree.trim_keep`: the k most
likely nodes, k maximising expected tokens per second of verify). That needs, per node, the probability of
being accepted, and the drafters' own numbers are not it: trained heads are over-confident (on SmolLM2,
nodes the heads gave 0.9-1.0 were right 72% of the time, nodes under 0.1 3%), n-gram lookup gives no
number at all, and a node both propose is likelier than either says.

So the generator keeps a reliability table filled by every verify: p(node accepted | its parent accepted),
counted per (kind, depth, bin), where the kind and bin are
- scored (the drafter's conditional probability q of the node given its parent): bin of q, B equal bins;
- lookup (an n-gram lookup proposed it, the drafter did not): the matched n-gram's length;
- both (the drafter scored it and the lookup proposed it too): bin of q;
- unscored (a drafter that gives no probabilities): one bin per depth;
- confident (a confidence head's chance c that the parent's best child is accepted, dspark's, for that child where the
  lookup did not propose it too): bin of c. Its siblings stay scored: the head speaks for the best child only.
A node's path probability is the product of its ancestors' calibrated conditional probabilities (all <= 1,
so a child never outranks its parent and the kept nodes form a tree). Each cell's estimate starts from a
prior: at depth 1 a fixed guess, deeper the estimate one depth up times the guess's fade with depth, so
what depth 1 learned reaches depths that were never tried (otherwise a depth whose fixed guess is not
worth a row would never be verified, and never learned). Counts decay with a memory of a few hundred
steps towards that prior, so the table follows the prompts at hand and a cell that was trimmed away for a
while is tried again. Only which nodes are verified depends on it, never which token is emitted: the
output stays exactly the target's.

The table has a few hundred cells and a step's tree a dozen nodes, so the bookkeeping runs in NumPy on views of the
tensors (`hits`, `trials`, `prior` stay tensors for callers): as torch ops it was about 60 small calls a step, 0.5 ms
of a 7 ms verify on the small fast target; the arithmetic is the same float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from inference.engine.tree import Tree, best_nodes, subtree

KINDS = ("scored", "lookup", "both", "unscored", "confident")
SCORED, LOOKUP, BOTH, UNSCORED, CONFIDENT = range(len(KINDS))


class AcceptanceCalibrator:
    """Online p(node accepted | parent accepted) per (kind, depth, bin); see the module docstring.

    max_depth: depths beyond it share its row. bins: B bins of the drafter's conditional probability (and
    n-gram lengths 1..B). prior_weight: pseudo-trials of the prior in every cell. memory: counts decay by
    1 - 1/memory per step.
    """

    def __init__(self, max_depth: int = 8, bins: int = 10, prior_weight: float = 2.0, memory: float = 256.0):
        if max_depth < 1 or bins < 1 or prior_weight <= 0 or memory < 1:
            raise ValueError(f"need max_depth >= 1, bins >= 1, prior_weight > 0, memory >= 1; got {max_depth}, "
                             f"{bins}, {prior_weight}, {memory}")
        self.max_depth, self.bins = max_depth, bins
        self.prior_weight, self.decay = prior_weight, 1.0 - 1.0 / memory
        size = len(KINDS) * max_depth * bins
        self.hits = torch.zeros(size, dtype=torch.float64)
        self.trials = torch.zeros(size, dtype=torch.float64)
        self.prior = self._prior()  # [KINDS, D, B]
        self.fade = torch.ones_like(self.prior)  # prior(depth d) / prior(depth d - 1)
        self.fade[:, 1:] = self.prior[:, 1:] / self.prior[:, :-1]
        # NumPy views of the same memory: the per-step arithmetic runs on these
        self._hits, self._trials = self.hits.numpy(), self.trials.numpy()
        self._prior_np, self._fade = self.prior.numpy(), self.fade.numpy()

    def _prior(self) -> torch.Tensor:
        """Before any verify: heads' q discounted to 0.7 q (their measured over-confidence), lookup 0.35-0.6 by
        n-gram length, both combined as independent evidence, all fading with depth; a confidence head's c as it
        is, at every depth (it was trained on the acceptance rate at each)."""
        b, d = self.bins, self.max_depth
        q = (torch.arange(b, dtype=torch.float64) + 0.5) / b  # bin centres
        fade = 0.85 ** torch.arange(d, dtype=torch.float64)[:, None]  # [D, 1]
        scored = (0.7 * q).expand(d, b)
        lookup = torch.tensor([0.35, 0.5] + [0.6] * max(b - 2, 0), dtype=torch.float64)[:b] * fade
        both = 1 - (1 - scored) * (1 - 0.35 * fade)
        unscored = (0.3 * fade).expand(d, b)
        return torch.stack([scored, lookup, both, unscored, q.expand(d, b)]).clamp(1e-3, 1 - 1e-3)

    def keys(self, tree: Tree) -> torch.Tensor:
        """[N] long: the table cell of every node (the root's is never used)."""
        depth = np.clip(tree.depth.cpu().numpy(), 1, self.max_depth) - 1
        lookup = tree.lookup.cpu().numpy() if tree.lookup is not None else np.zeros(tree.size, dtype=np.int64)
        if tree.scores is not None:
            s = tree.scores.detach().float().cpu().numpy()
            logq = s - s[tree.parents.cpu().numpy()]  # the node's conditional log-probability given its parent
            scored = ~np.isnan(logq)
            with np.errstate(over="ignore"):
                q_bin = np.clip((np.exp(np.nan_to_num(logq, nan=0.0)) * self.bins).astype(np.int64), 0,
                                self.bins - 1)
        else:
            scored = np.zeros(tree.size, dtype=bool)
            q_bin = np.zeros(tree.size, dtype=np.int64)
        proposed = lookup > 0
        kind = np.where(scored, np.where(proposed, BOTH, SCORED), np.where(proposed, LOOKUP, UNSCORED))
        cell = np.where(kind == LOOKUP, np.clip(lookup, 1, self.bins) - 1, np.where(kind == UNSCORED, 0, q_bin))
        if tree.confidence is not None and tree.scores is not None:
            c = tree.confidence.detach().float().cpu().numpy()
            parents = tree.parents.cpu().numpy()
            best = np.full(tree.size, -np.inf)  # each parent's best child's log q
            np.maximum.at(best, parents[1:], np.nan_to_num(logq[1:], nan=-np.inf))
            confident = (kind == SCORED) & ~np.isnan(c) & (logq >= best[parents])
            kind = np.where(confident, CONFIDENT, kind)
            c_bin = np.clip((np.nan_to_num(c) * self.bins).astype(np.int64), 0, self.bins - 1)
            cell = np.where(confident, c_bin, cell)
        return torch.from_numpy(((kind * self.max_depth + depth) * self.bins + cell).astype(np.int64))

    def _estimates(self) -> np.ndarray:
        w = self.prior_weight
        hits = self._hits.reshape(self._prior_np.shape)
        trials = self._trials.reshape(self._prior_np.shape)
        p = np.empty_like(self._prior_np)
        for d in range(self.max_depth):
            prior = self._prior_np[:, 0] if d == 0 else np.clip(p[:, d - 1] * self._fade[:, d], 1e-3, 1 - 1e-3)
            p[:, d] = (hits[:, d] + w * prior) / (trials[:, d] + w)
        return p.reshape(-1)

    def estimates(self) -> torch.Tensor:
        """[KINDS * D * B] calibrated p(accepted | parent accepted) of every cell: counts plus prior_weight
        pseudo-trials at the prior (the fixed guess at depth 1, the estimate one depth up, faded, deeper)."""
        return torch.from_numpy(self._estimates())

    def probabilities(self, keys: torch.Tensor) -> torch.Tensor:
        """Calibrated p(accepted | parent accepted) of the given cells."""
        return torch.from_numpy(self._estimates()[np.asarray(keys)])

    def path_logp(self, tree: Tree, keys: torch.Tensor) -> torch.Tensor:
        """[N] (CPU) log-probability that each node is accepted: the sum of its path's calibrated log conditionals."""
        logc = np.log(self._estimates()[keys.numpy()])
        logc[0] = 0.0  # the root is decided
        return torch.from_numpy(tree.ancestors.cpu().numpy() @ logc)  # [N] log of the product along each path

    def trim(self, tree: Tree, costs: Sequence[float], fixed: float = 0.0) -> tuple[Tree, torch.Tensor]:
        """`tree` cut to the nodes worth their verify rows by calibrated path probability (`fixed`: the step's
        seconds besides the verify, its drafting), and the kept nodes' cells (pass both to `update` after the
        verify). Reads the tree on the host: meant for CPUs."""
        keys = self.keys(tree)
        keep, _ = best_nodes(self.path_logp(tree, keys), tree.depth.cpu(), costs, fixed)
        if keep is None:
            return tree, keys
        return subtree(tree, keep.to(tree.tokens.device)), keys[keep]

    def primary_payoff(self, tree: Tree, costs: Sequence[float], fixed: float, primary_seconds: float) -> float:
        """log(expected tokens per second of the best trim of `tree` / that of the best trim of the lookup's nodes
        alone, as if the primary drafter had not drafted): > 0 when the primary's nodes paid for their drafting
        (`primary_seconds`, counted only with them) and their verify rows. `fixed`: the step's other seconds."""
        keys = self.keys(tree)
        logp = self.path_logp(tree, keys)
        depth = tree.depth.cpu()
        _, with_primary = best_nodes(logp, depth, costs, fixed + primary_seconds)
        lookup = tree.lookup > 0 if tree.lookup is not None else torch.zeros_like(tree.tokens, dtype=torch.bool)
        lookup[0] = True  # with the root, the lookup's nodes form a tree (its branches hang from the root)
        alone = replace(subtree(tree, torch.nonzero(lookup).flatten()), scores=None)  # lookup nodes as lookup's
        _, without = best_nodes(self.path_logp(alone, self.keys(alone)), alone.depth.cpu(), costs, fixed)
        return math.log(with_primary / without)

    def update(self, tree: Tree, keys: torch.Tensor, path: torch.Tensor, n: int) -> None:
        """Count one verify: every node whose parent was accepted was tried; path[1:n] were accepted."""
        path, keys = path.cpu().numpy(), np.asarray(keys)
        accepted = np.zeros(tree.size, dtype=bool)
        accepted[path[:n]] = True
        tried = accepted[tree.parents.cpu().numpy()]
        tried[0] = False
        self.count(keys[tried], keys[path[1:n]])

    def count(self, tried: np.ndarray, accepted: np.ndarray) -> None:
        """Count one step's verifies (after decaying the counts once): the cells of the nodes tried (their parent
        accepted), and of those accepted."""
        self._hits *= self.decay
        self._trials *= self.decay
        np.add.at(self._trials, tried, 1.0)
        np.add.at(self._hits, accepted, 1.0)

    def table(self, min_trials: float = 1.0) -> list[dict[str, float | int | str]]:
        """The cells tried at least `min_trials` (decayed) times: kind, depth, bin, trials, calibrated p."""
        p = self.estimates()
        rows = []
        for key in torch.nonzero(self.trials >= min_trials).flatten().tolist():
            kind, rest = divmod(key, self.max_depth * self.bins)
            depth, cell = divmod(rest, self.bins)
            rows.append({"kind": KINDS[kind], "depth": depth + 1, "bin": cell, "trials": float(self.trials[key]),
                         "hits": float(self.hits[key]), "p": float(p[key])})
        return rows

    def summary(self) -> str:
        """One line: acceptance rate (hits / trials, decayed counts) per kind and depth that was tried."""
        hits = self.hits.view_as(self.prior).sum(-1)
        trials = self.trials.view_as(self.prior).sum(-1)
        parts = []
        for k, kind in enumerate(KINDS):
            rates = [f"d{d + 1} {hits[k, d] / trials[k, d]:.2f}/{trials[k, d]:.0f}" for d in range(self.max_depth)
                     if trials[k, d] >= 1]
            if rates:
                parts.append(f"{kind}: " + " ".join(rates))
        return "; ".join(parts) or "nothing verified yet"
