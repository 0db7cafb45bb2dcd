"""Which way of drafting a step uses, chosen from what each way earned on this generator.

The auto budget is chosen once, from timings and the drafter's prior; what a step really earns depends on the text
(a reply that copies its prompt rewards lookup, one the heads know rewards them) and on the machine. So on a CPU
under the auto budget the generator keeps, for each of a few ways of running a step ("arms"), the tokens a step
appended and the seconds it took, as running means, and runs the arm with the most tokens per second:

    both     the drafter as built (for the default: the heads' tree with lookup grafted on)
    primary  the heads alone (a HybridDrafter's primary drafter; no lookup)
    lookup   n-gram lookup alone (no heads drafted)
    plain    no drafting: the root through the target's ordinary forward (drafters that keep no history)

What a step earns depends on what the drafter sees before it drafts: a lookup that matches the context's last
3-gram earns more than one with no match. So the means are kept per context, the drafter's `step_context` (for
drafters with lookup, the length of the n-gram it matched: 0, 1, 2, 3+). In each context every arm is tried
`FIRST_TRIES` times first; after that, every `PROBE_EVERY`-th step runs the arm tried least recently instead of the
best, so an arm that got better is seen again. A step's seconds are its wall time, drafting, verify and bookkeeping
all counted, so the choice weighs what each arm costs on this machine, and the default can lose to one of its parts
only by the probes' share of the steps. Only which nodes are verified changes: the output is the target's whichever
arm runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class _Means:
    """Per arm: running means of a step's tokens and seconds, tries, and the step it last ran."""

    def __init__(self, arms: Sequence[str]) -> None:
        self.tokens = dict.fromkeys(arms, 0.0)
        self.seconds = dict.fromkeys(arms, 0.0)
        self.tries = dict.fromkeys(arms, 0)
        self.last_used = dict.fromkeys(arms, -1)
        self.steps = 0


class StepChoice:
    FIRST_TRIES = 2
    PROBE_EVERY = 12
    # an arm's means: plain means over its first 1 / (1 - MEMORY) steps, then running means that weigh the newest step
    # by 1 - MEMORY (a step's tokens vary from 1 to the tree's depth: a shorter memory let a few unlucky steps of the
    # heads drop below plain decoding's steady 1 token and hand it steps it does not earn)
    MEMORY = 0.95

    def __init__(self, arms: Sequence[str]) -> None:
        if not arms:
            raise ValueError("StepChoice needs at least one arm")
        self.arms = list(arms)
        self.contexts: dict[int, _Means] = {}
        self.clock = time.perf_counter  # what a step's seconds are read from (a test may give it a fake one)

    def _means(self, context: int) -> _Means:
        if context not in self.contexts:
            self.contexts[context] = _Means(self.arms)
        return self.contexts[context]

    def rate(self, arm: str, context: int = 0) -> float:
        """Tokens per second the arm has earned in this context (0 before it ran)."""
        m = self._means(context)
        return m.tokens[arm] / m.seconds[arm] if m.seconds[arm] > 0 else 0.0

    def best(self, context: int = 0) -> str:
        return max(self.arms, key=lambda a: self.rate(a, context))

    def choose(self, context: int = 0) -> str:
        m = self._means(context)
        m.steps += 1
        untried = [a for a in self.arms if m.tries[a] < self.FIRST_TRIES]
        if untried:
            arm = untried[0]
        elif len(self.arms) > 1 and m.steps % self.PROBE_EVERY == 0:
            best = self.best(context)
            arm = min((a for a in self.arms if a != best), key=lambda a: m.last_used[a])
        else:
            arm = self.best(context)
        m.last_used[arm] = m.steps
        return arm

    def record(self, arm: str, tokens: int, seconds: float, context: int = 0) -> None:
        """What a step of `arm` appended and took."""
        m = self._means(context)
        m.tries[arm] += 1
        w = max(1 - self.MEMORY, 1 / m.tries[arm])  # the newest step's weight
        m.tokens[arm] += w * (tokens - m.tokens[arm])
        m.seconds[arm] += w * (seconds - m.seconds[arm])

    def tried(self) -> bool:
        return any(any(m.tries.values()) for m in self.contexts.values())

    def summary(self) -> str:
        return "; ".join(f"context {c}: " + ", ".join(f"{a} {self.rate(a, c):.1f} tok/s x {m.tries[a]}"
                                                        for a in self.arms)
                         for c, m in sorted(self.contexts.items()))
