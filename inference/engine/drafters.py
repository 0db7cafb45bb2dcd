"""Drafters: propose a tree of candidate continuations after the decided root token.

One small interface, `Drafter.draft(ctx) -> Tree`, with three implementations here (and `BigramDrafter`, the
draft-free baseline, in `inference.engine.bigram`):

- `HeadsDrafter`: trained draft heads of any kind; the kind's `Drafting` (its module in `medusa_train.kinds`) gives
  each level's distributions: chained heads run head k once on the batch of a level's nodes (each reads its parent's
  state and token), parallel and dflash heads score every level at once; heads that read the committed context
  (eagle3, dflash, context encoders) keep their own cache of it (`observe`).
- `NGramDrafter`: prompt lookup; match the last n tokens of the context earlier in the context and
  propose what followed (several matches give several branches).
- `HybridDrafter`: another drafter's tree (the heads') with the n-gram lookup's continuation grafted
  on, verified together.

Tree shapes: `static` (a fixed shape from static tree search over per-rank acceptance rates, or an
explicit list of rank paths) and `dynamic` (EAGLE-2: expand by cumulative draft log-probability, keep
the best nodes under the budget). The budget counts draft nodes; the root comes on top.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inference.engine.kernels import use_fastest_linear
from inference.engine.tree import (Tree, TreeTopology, default_topk_accuracy, expected_tau_curve, graft_branches,
                                   select_dynamic_tree, static_tree_search, topology_from_paths, tree_from_parents)
from medusa_train.target.model import logit_transform

TreeSpec = str | Sequence[Sequence[int]]  # "static" | "dynamic" | explicit rank paths


DRAFT_ROWS = 3  # rows a head's linear layers see per call in a CPU-sized tree (1-4 nodes a level): their kernel is
# timed at this count (`use_fastest_linear`)


@dataclass
class DraftContext:
    """What a drafter sees at the start of a step.

    root: [1] long on the target's device, the decided next token (tree depth 0).
    hidden: [d] the target's final hidden state h_t at the last committed position (root's predecessor).
    tokens: the whole sequence on the host, prompt + generated, root included.
    tree: "static" | "dynamic" | explicit rank paths. budget: max draft nodes (root excluded).
    trimmed: the generator will cut the tree to the nodes worth their verify rows by their calibrated
    probability of acceptance (`inference.engine.calibrate`; a CPU with the auto budget), so a drafter that combines
    sources may propose more than `budget` nodes and let that choose.
    """

    root: torch.Tensor
    hidden: torch.Tensor
    tokens: list[int]
    tree: TreeSpec
    budget: int
    trimmed: bool = False
    host_reads: bool = True
    """Whether the drafter may read the tree on the host (`inference.engine.budget.Platform`: on a CPU, not on a GPU,
    where the step keeps its single sync)."""


class Drafter:
    """Interface. `max_depth` bounds the tree depth (for context-length checks); `topk_accuracy` is the
    prior for static tree search and the auto budget: [depth][rank] acceptance probabilities."""

    max_depth: int = 0
    max_candidates: int = 1 << 30  # most candidates ranked per node (static trees use ranks below this)
    needs_history: bool = False  # True: the generator calls `observe` with every committed position
    target_layers: tuple[int, ...] = ()  # target layers whose states `observe` receives after h (eagle3)

    def draft(self, ctx: DraftContext) -> Tree:
        raise NotImplementedError

    def topk_accuracy(self) -> list[list[float]]:
        return default_topk_accuracy(self.max_depth)

    def expected_tau(self, max_budget: int) -> list[float]:
        """Expected tokens per step of the best static tree for every budget 0..max_budget."""
        return expected_tau_curve([row[:self.max_candidates] for row in self.topk_accuracy()], max_budget)

    def reset(self) -> None:
        """Called at the start of every `generate` (drafters with per-sequence state clear it here)."""

    def step_context(self, tokens: list[int]) -> int:
        """What the generator's per-step choice (`inference.engine.choice`) conditions on before a step: 0 here;
        drafters with lookup give the length of the n-gram they match (0-3)."""
        return 0

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Only for drafters with `needs_history`: n newly committed positions, in order; hidden [n, d] is
        h at each (followed by the states at `target_layers`, if any: [n, (1 + len(target_layers)) d]),
        next_tokens [n] (on the target's device) the token that follows each (the last one is the next root).
        Called after the prefill with the whole prompt, then after every step."""


def _validate_tree(tree: TreeSpec) -> None:
    if isinstance(tree, str):
        if tree not in ("static", "dynamic"):
            raise ValueError(f"tree must be 'auto', 'static', 'dynamic' or a list of rank paths, got {tree!r}")


class TreeDrafter(Drafter):
    """Drafters that score top-k candidates per node (`propose`), so they can fill static and dynamic
    trees with the same code. Subclasses implement `propose` and `root_state`."""

    dynamic_topk: int = 8  # EAGLE-2: at most this many children per expanded node / nodes expanded per depth

    def __init__(self) -> None:
        self._topologies: dict[Any, TreeTopology] = {}

    def root_state(self, ctx: DraftContext) -> torch.Tensor | None:
        """Per-node drafter state of the root ([1, d]), or None for stateless drafters."""
        return None

    def propose(self, k: int, tokens: torch.Tensor, states: torch.Tensor | None, num: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Candidates for the children of M nodes at depth k.

        tokens: [M] the nodes' tokens; states: [M, d] their states (or None). Returns (candidate token
        ids [M, num] best first, their draft log-probabilities [M, num], the children's state [M, d] or
        None)."""
        raise NotImplementedError

    def topology(self, tree: TreeSpec, budget: int, device: torch.device) -> TreeTopology:
        key = (tree if isinstance(tree, str) else tuple(map(tuple, tree)), budget, str(device))
        if key not in self._topologies:
            if tree == "static":
                acc = [row[:self.max_candidates] for row in self.topk_accuracy()]
                paths = static_tree_search(acc, budget)
            else:
                paths = tree
                worst = max((r for p in paths for r in p), default=0)
                if worst >= self.max_candidates:
                    raise ValueError(f"tree path asks for candidate rank {worst}, but this drafter ranks at most "
                                     f"{self.max_candidates} candidates per node: use ranks < {self.max_candidates}")
            self._topologies[key] = topology_from_paths(paths, device)
        return self._topologies[key]

    def draft(self, ctx: DraftContext) -> Tree:
        _validate_tree(ctx.tree)
        if ctx.tree == "dynamic":
            tree = self.draft_dynamic(ctx)
        else:
            tree = self.draft_static(self.topology(ctx.tree, ctx.budget, ctx.root.device), ctx)
        if ctx.trimmed:  # the calibrated trim reads a confidence head's numbers where the drafter has one
            confidence = self.node_confidence(tree)
            if confidence is not None:
                tree = replace(tree, confidence=confidence)
        return tree

    def node_confidence(self, tree: Tree) -> torch.Tensor | None:
        """[N] each node's chance of acceptance given its parent's, from a confidence head (NaN at the root), or None
        for drafters without one."""
        return None

    def draft_static(self, topo: TreeTopology, ctx: DraftContext) -> Tree:
        """Fill a fixed shape: node (r_1..r_d) takes the r_d-th candidate proposed after its parent."""
        if topo.max_depth > self.max_depth:
            raise ValueError(f"tree is {topo.max_depth} deep but this drafter proposes at most {self.max_depth} "
                             f"levels: shorten the tree paths")
        # level by level, gathering from the level above (nodes are numbered depth by depth): the tree's tokens and
        # cumulative draft log-probabilities are the levels' concatenation, and no step writes into a node array
        level_tokens, level_scores = [ctx.root], [torch.zeros(1, device=ctx.root.device)]
        states = self.root_state(ctx)  # [nodes of the level above, d] or None
        for k, level in enumerate(topo.levels):
            above_tokens, above_states = level_tokens[-1], states
            if not level.all_parents:
                above_tokens = above_tokens.index_select(0, level.inner_parents)
                above_states = None if states is None else states.index_select(0, level.inner_parents)
            cand, logq, child_state = self.propose(k, above_tokens, above_states, level.num_ranks)  # [M, num_ranks]
            level_tokens.append(cand.reshape(-1).index_select(0, level.flat))
            level_scores.append(level_scores[-1].index_select(0, level.inner_node_parents)
                                + logq.reshape(-1).index_select(0, level.flat).float())
            states = None if child_state is None else child_state.index_select(0, level.slot)
        return topo.with_tokens(torch.cat(level_tokens), torch.cat(level_scores))

    def draft_dynamic(self, ctx: DraftContext) -> Tree:
        """EAGLE-2: expand the `dynamic_topk` best frontier nodes per depth by their top-k children, scored
        by cumulative draft log-probability; keep the best `budget` nodes of the pool."""
        # expansion width ~ sqrt(budget): every expanded node costs a head row (an LM-head matmul), and a
        # pool much wider than the budget is mostly thrown away
        width = max(1, min(self.dynamic_topk, math.ceil(math.sqrt(ctx.budget)) + 1, ctx.budget, self.max_candidates))
        device = ctx.root.device
        s0 = self.root_state(ctx)
        pool_tokens, pool_parents = [ctx.root], [torch.zeros(1, dtype=torch.long, device=device)]
        pool_depth, pool_scores = [torch.zeros(1, dtype=torch.long, device=device)], [torch.zeros(1, device=device)]
        frontier = torch.zeros(1, dtype=torch.long, device=device)  # pool indices of the nodes to expand
        f_tokens, f_states, f_scores = ctx.root, s0, torch.zeros(1, device=device)
        offset = 1
        for k in range(self.max_depth if ctx.budget > 0 else 0):
            cand, logq, child_state = self.propose(k, f_tokens, f_states, width)  # [M, w]
            m = cand.shape[0]
            scores = (f_scores[:, None] + logq.float()).flatten()  # [M * w]
            pool_tokens.append(cand.flatten())
            pool_parents.append(frontier.repeat_interleave(width))
            pool_depth.append(torch.full((m * width,), k + 1, dtype=torch.long, device=device))
            pool_scores.append(scores)
            best = torch.topk(scores, min(width, m * width)).indices  # next frontier: best children overall
            frontier = best + offset
            f_tokens, f_scores = cand.flatten()[best], scores[best]
            f_states = None if child_state is None else child_state.repeat_interleave(width, 0)[best]
            offset += m * width
        return select_dynamic_tree(torch.cat(pool_tokens), torch.cat(pool_parents), torch.cat(pool_depth),
                                   torch.cat(pool_scores), ctx.budget, len(pool_tokens) - 1)


# ---------------------------------------------------------------------------------------------------
# Heads


class HeadsDrafter(TreeDrafter):
    """Draft with trained heads of any kind (`medusa_train.kinds`) on the target's own embedding / LM head: the heads'
    `Drafting` gives each tree level's distributions, this class turns them into candidates and trees.

    topk_accuracy: [head][rank] acceptance rates measured by the trainer (`acceptance.json`); None uses
    a default prior. It shapes static trees and the auto budget.
    """

    def __init__(self, heads: nn.Module, target: nn.Module, topk_accuracy: list[list[float]] | None = None):
        super().__init__()
        weight = target.get_output_embeddings().weight
        self.heads = heads.to(device=weight.device, dtype=weight.dtype).eval()
        use_fastest_linear(self.heads, DRAFT_ROWS)  # float32 on a CPU: MKL or oneDNN, whichever drafts faster here
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        # the target's own final-logit transform (a scale, a soft cap): the draft distribution q is then on the
        # target's footing, which is what lossless sampling compares it with
        self.transform = logit_transform(target.config)
        self.max_depth = heads.spec.num_heads
        self.max_candidates = heads.spec.scored_vocab
        self._topk_accuracy = topk_accuracy
        # heads scoring a reduced draft vocabulary with the target's LM head: gather those rows once into a
        # layer of their own (the same product `heads.logits` computes), so the fast kernel packs them too
        self._draft_lm: nn.Linear | None = None
        if heads.spec.draft_vocab_size and not heads.owns_lm_head:
            rows = heads.scoring_weight(0, self.lm_head).detach().contiguous()
            self._draft_lm = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
            self._draft_lm.weight = nn.Parameter(rows, requires_grad=False)
            use_fastest_linear(self._draft_lm, DRAFT_ROWS)
        self._drafting = self.heads.drafting(self.embed, self.head_logits, weight.dtype)
        self.chained = self._drafting.per_node  # a level's candidates depend on each node (else one row a level)
        self.needs_history = self._drafting.needs_history
        self.target_layers = tuple(self.heads.target_layers)

    @classmethod
    def from_pretrained(cls, heads_dir: str | os.PathLike, target: nn.Module) -> HeadsDrafter:
        """Load heads (refused with HeadsMismatchError if trained for another target) and, if present,
        the trainer's `acceptance.json`."""
        from medusa_train.kinds.heads import DraftHeads

        heads = DraftHeads.from_pretrained(heads_dir, target=target)
        return cls(heads, target, load_topk_accuracy(heads_dir))

    def topk_accuracy(self) -> list[list[float]]:
        return self._topk_accuracy or default_topk_accuracy(self.max_depth)

    def head_logits(self, k: int, s: torch.Tensor) -> torch.Tensor:
        """Head k's logits over the scored vocabulary for states s [M, d]: [M, V_draft]. Heads with an LM head of their
        own score themselves; the others take the target's (its draft vocabulary's rows) on the fastest kernel."""
        if self._draft_lm is not None:
            return self._draft_lm(s)
        if self.heads.owns_lm_head:
            return self.heads.score(k, s)
        return self.lm_head(s)  # = heads.logits, on the target's (fast) kernel

    def reset(self) -> None:
        self._drafting.reset()

    def node_confidence(self, tree: Tree) -> torch.Tensor | None:
        return self._drafting.confidence(tree.tokens, tree.parents, tree.depth)

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self._drafting.observe(hidden, next_tokens)

    def root_state(self, ctx: DraftContext) -> torch.Tensor | None:
        return self._drafting.root(ctx.root, ctx.hidden)

    def propose(self, k, tokens, states, num):
        logits, child = self._drafting.step(k, tokens, states)  # [M, V_draft], or [1, V_draft] for every node
        cand, logq = self.candidates(logits.float(), num)
        m = tokens.shape[0]
        return cand.expand(m, -1), logq.expand(m, -1), child

    def candidates(self, logits: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `num` best of each row of logits [M, V_draft]: (target ids, their log-probabilities), best first."""
        if not self.transform.identity:
            logits = self.transform(logits)
        # one fused log-softmax, then the top of it: its values are the candidates' log-probabilities (cheaper than
        # a logsumexp beside the top-k: on a CPU that reduction ran as a dozen small ops, a quarter of drafting)
        top = torch.topk(torch.log_softmax(logits, dim=-1), num, dim=-1)
        return self.heads.to_target_ids(top.indices), top.values


def load_topk_accuracy(heads_dir: str | os.PathLike) -> list[list[float]] | None:
    """`acceptance.json`'s topk_accuracy ([head][rank]) if the trainer wrote one, else None."""
    path = Path(heads_dir) / "acceptance.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    acc = raw.get("topk_accuracy")
    if not (isinstance(acc, list) and acc and all(isinstance(row, list) and row for row in acc)):
        raise ValueError(f"{path}: expected {{'topk_accuracy': [[p(rank 1), ...] per head], ...}}; "
                         f"delete the file to use the default tree prior")
    return [[float(x) for x in row] for row in acc]


# ---------------------------------------------------------------------------------------------------
# N-gram prompt lookup


class NGramDrafter(Drafter):
    """Prompt lookup: find the last `n` tokens (n = max_ngram..min_ngram) earlier in the context and
    propose the tokens that followed, up to `max_depth` of them. Up to `branches` distinct continuations
    (most recent match first) are merged into a tree of at most `budget` draft nodes; the tree's shape
    comes from the matches, so the `tree` setting is ignored."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_depth: int = 5, branches: int = 2,
                 max_context: int = 4096):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.max_depth = max_ngram, min_ngram, max_depth
        self.branches, self.max_context = branches, max_context

    def topk_accuracy(self) -> list[list[float]]:
        return [[0.5 * 0.9**k, 0.1 * 0.9**k] for k in range(self.max_depth)]  # a rough prior for the budget

    _last: tuple | None = None  # (key, result) of the last `matches` call: a step asks twice (context, draft)

    def reset(self) -> None:
        self._last = None

    def step_context(self, tokens: list[int]) -> int:
        return min(self.matches(tokens, self.max_depth)[1], 3)

    def matches(self, tokens: list[int], depth: int) -> tuple[list[list[int]], int]:
        """Distinct continuations of the most recent matches of the context's last n-gram (longest n first),
        and that n (0: no match)."""
        key = (id(tokens), len(tokens), depth, tuple(tokens[-self.max_ngram:]))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = (key, self._match(tokens, depth))
        return self._last[1]

    def _match(self, tokens: list[int], depth: int) -> tuple[list[list[int]], int]:
        ctx = tokens[-self.max_context:]
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # most recent first, never the tail itself
                if ctx[start:start + n] == tail:
                    cont = ctx[start + n:start + n + depth]
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) >= self.branches:
                            return found, n
            if found:
                return found, n
        return found, 0

    def continuations(self, tokens: list[int], depth: int) -> list[list[int]]:
        return self.matches(tokens, depth)[0]

    def draft(self, ctx: DraftContext) -> Tree:
        root = tree_from_parents(ctx.root[:1], torch.zeros(1, dtype=torch.long, device=ctx.root.device),
                                 torch.zeros(1, dtype=torch.long, device=ctx.root.device), 0)
        conts, n = self.matches(ctx.tokens, self.max_depth)
        return graft_branches(root, conts, ctx.budget, match_lengths=[n] * len(conts))


class HybridDrafter(Drafter):
    """A drafter's tree with n-gram lookup grafted on: one verify checks both.

    Lookup wins where the reply copies the context (quotes, code, lists, rewrites); trained heads win
    elsewhere; neither costs much next to the verify. Each step, the lookup's continuations (if the
    context's last n-gram occurs earlier) take up to `lookup_nodes` of the budget, and never more than half
    of it (rounded up; on SmolLM2 a budget of 4 split 2-3 for the lookup beat 4 and 1), the primary drafter
    drafts with the rest, and the continuations are hung under the root sharing the nodes the primary tree
    already has (a continuation the heads also proposed costs nothing extra). With no match the primary
    drafter gets the whole budget. When the generator trims the tree (`DraftContext.trimmed`), the primary
    drafts its whole budget and the lookup adds up to `lookup_nodes` on top: the calibrated trim then keeps
    whichever nodes are likeliest, so a reliable match displaces unlikely heads' nodes and vice versa. The
    tree shape, tree prior and context history are the primary's.
    `share_nodes` merges the continuation into the primary tree's own nodes, which reads the tree on the host;
    None (the default) leaves it to `DraftContext.host_reads`: merged on a CPU, appended as is on a GPU, where the
    step keeps its one host sync.
    """

    share_nodes: bool | None = None
    mode: str = "both"
    """What `draft` proposes: "both" (the above), "primary" (the primary alone, no lookup) or "lookup" (the lookup
    alone); set per step by the generator's `StepChoice` (`inference.engine.choice`)."""

    def __init__(self, primary: Drafter, lookup: NGramDrafter | None = None, lookup_nodes: int = 4):
        if not isinstance(lookup_nodes, int) or lookup_nodes < 0:
            raise ValueError(f"lookup_nodes must be an int >= 0 (draft nodes per step the lookup may take), "
                             f"got {lookup_nodes!r}")
        self.primary = primary
        self.lookup = lookup if lookup is not None else NGramDrafter(max_depth=max(lookup_nodes, 1), branches=1)
        self.lookup_nodes = lookup_nodes
        self.max_depth = max(primary.max_depth, self.lookup.max_depth)
        self.max_candidates = primary.max_candidates
        self.needs_history = primary.needs_history
        self.target_layers = primary.target_layers
        # what the primary's nodes earned, per n-gram match length (none, 1, 2, 3+): see `credit`; kept across
        # `generate` calls, like the generator's calibrator
        self.payoff, self.skipped = [0.0] * 4, [0] * 4
        self.match, self.drafted_primary, self.primary_seconds = 0, True, 0.0  # the last step's

    def topk_accuracy(self) -> list[list[float]]:
        return self.primary.topk_accuracy()

    def expected_tau(self, max_budget: int) -> list[float]:
        return self.primary.expected_tau(max_budget)

    def reset(self) -> None:
        self.primary.reset()
        self.lookup.reset()

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.primary.observe(hidden, next_tokens)

    def step_context(self, tokens: list[int]) -> int:
        return self.lookup.step_context(tokens)

    def draft(self, ctx: DraftContext) -> Tree:
        # at most half, unless the generator trims: the heads keep the rest
        share = self.lookup_nodes if ctx.trimmed else min(self.lookup_nodes, (ctx.budget + 1) // 2)
        if self.mode == "primary":
            share = 0
        elif self.mode == "lookup":  # the lookup alone: as deep as it matches, within the budget
            share = min(self.lookup.max_depth * self.lookup.branches, max(ctx.budget, 1))
        branches: list[list[int]] = []
        used, n = 0, 0
        if share > 0:
            conts, n = self.lookup.matches(ctx.tokens, self.lookup.max_depth)
            for cont in conts:
                cont = cont[:share - used]
                if not cont:
                    break
                branches.append(cont)
                used += len(cont)
        self.match = min(n, 3)
        if self.mode == "both":
            self.drafted_primary = not ctx.trimmed or self._primary_pays()
        else:
            self.drafted_primary = self.mode == "primary"
        if self.drafted_primary:
            t0 = time.perf_counter()
            tree = self.primary.draft(ctx if ctx.trimmed else replace(ctx, budget=ctx.budget - used))
            self.primary_seconds = time.perf_counter() - t0  # a CPU's (trimmed steps): no device to wait for
        else:
            zero = torch.zeros(1, dtype=torch.long, device=ctx.root.device)
            tree, self.primary_seconds = tree_from_parents(ctx.root[:1], zero, zero, 0), 0.0
        share = ctx.host_reads if self.share_nodes is None else self.share_nodes
        return graft_branches(tree, branches, used, share, [n] * len(branches))

    # -- skipping the primary where its nodes do not pay (trimmed steps: a CPU with the auto budget) ----------
    #
    # After each trimmed step the generator credits the primary with `AcceptanceCalibrator.primary_payoff`: the
    # log of the expected tokens per second of the step's best trim over that of the lookup's nodes alone, the
    # primary's drafting time counted against it. Its running mean is kept per n-gram match length (none, 1, 2,
    # 3+), since the lookup's strength decides what the primary adds; where the mean is below 0 the primary is
    # not drafted, except every `PROBE_EVERY`-th such step, which measures it again. Only which nodes are
    # verified changes: the output stays the target's.

    PROBE_EVERY = 8
    PAYOFF_MEMORY = 0.8  # weight of the running mean against the newest step's payoff

    def _primary_pays(self) -> bool:
        if self.payoff[self.match] >= 0 or self.skipped[self.match] + 1 >= self.PROBE_EVERY:
            self.skipped[self.match] = 0
            return True
        self.skipped[self.match] += 1
        return False

    def credit(self, payoff: float) -> None:
        """The primary's payoff on the step just drafted (see above)."""
        m = self.match
        self.payoff[m] = self.PAYOFF_MEMORY * self.payoff[m] + (1 - self.PAYOFF_MEMORY) * payoff

