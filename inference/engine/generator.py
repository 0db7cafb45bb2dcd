"""The decode loop: `SpeculativeGenerator`, the top of the engine's ladder.

One step, as a ladder of small functions: `prefill` (prompt -> cache, h_t, root) -> `speculative_step`
(draft a tree -> `verify_tree` -> accept a path -> `compact_cache`) -> `generate` (steps until EOS or
`max_new_tokens`, streaming and stats). The root of each tree is the target's own token, decided at the
previous step (or at prefill), and is emitted as soon as it is decided. Its command line is `inference.generate`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

import inference.engine.budget as budget_timing
from inference.engine.budget import Platform
from inference.engine.calibrate import AcceptanceCalibrator
from inference.engine.choice import StepChoice
from inference.engine.compiled import StaticVerifier
from inference.engine.drafters import DraftContext, Drafter, HeadsDrafter, HybridDrafter, TreeSpec
from inference.engine.kernels import use_onednn_linear
from inference.engine.kv import compact_cache, new_cache
from inference.engine.support import (ContextLengthError, UnsupportedModelError, check_supported,  # noqa: F401
                                      check_tree_attention, context_limit)
from inference.engine.tree import Tree
from inference.engine.verify import (accept_greedy, accept_lossless, accept_typical, sample_token, target_forward,
                                     target_probs, verify_tree)
from medusa_train.data.chat import render_prompt
from medusa_train.target.model import eos_ids, final_logits

Acceptance = Literal["exact", "typical"]


PHASES = ("draft", "trim", "verify", "accept", "update", "compact", "observe")  # of `speculative_step`


class PhaseClock:
    """Times the phases of `speculative_step` from inside it (`inference.profile_step`); the step passes none when
    generating. On CUDA each lap synchronises first, so a phase's time is its kernels', not their launch's."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.rows = 0  # tree nodes verified, roots included
        self._t = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._t = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] += now - self._t
        self._t = now


def _no_lap(phase: str) -> None:
    pass


def _is_int(x: Any) -> bool:
    """An integer, not a bool (True would otherwise count as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    """A real number, not a bool; NaN passes here and fails the range checks."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class GenerationStats:
    """new_tokens: emitted tokens; steps: verify forwards; target_forwards: steps + the prefill;
    tau: new tokens per target forward (plain decoding: 1.0); accept_lengths: tokens appended per step
    (accepted drafts + the bonus token); verified_nodes: tree nodes verified over all steps (roots included)."""

    new_tokens: int = 0
    steps: int = 0
    target_forwards: int = 0
    tau: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    verified_nodes: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    tree: str = ""
    tree_budget: int = 0
    arms: dict[str, int] = field(default_factory=dict)
    """Steps run per arm of the per-step choice (`inference.engine.choice`; a CPU with the auto budget)."""

    def line(self) -> str:
        return (f"new_tokens={self.new_tokens} steps={self.steps} tau={self.tau:.2f} "
                f"tokens/s={self.tokens_per_s:.1f} tree={self.tree} budget={self.tree_budget}")


@dataclass
class GenerationOutput:
    text: str
    token_ids: torch.Tensor  # [new_tokens] the new tokens only, on the CPU
    stats: GenerationStats


@dataclass
class DecodeState:
    """Between steps: the cache holds the committed prefix; `root` ([1]) is decided but not yet in the
    cache; `hidden` ([d]) is h_t at the last committed position; `tokens` is everything, root included."""

    cache: Any
    root: torch.Tensor
    hidden: torch.Tensor
    tokens: list[int]


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    acceptance: Acceptance = "exact"
    generator: torch.Generator | None = None


# ---------------------------------------------------------------------------------------------------
# The generator


class SpeculativeGenerator:
    """Generate with a frozen target and a drafter; greedy output equals the target's own greedy output.

    `SpeculativeGenerator(target, tokenizer, drafter)` builds one from parts (any `Drafter`);
    `SpeculativeGenerator.from_pretrained(heads_dir)` loads trained heads and their target.
    """

    def __init__(self, target: nn.Module, tokenizer=None, drafter: Drafter | None = None, self_check: bool = True,
                 compile: bool | str = False):
        if drafter is None:
            raise ValueError("pass a drafter: HeadsDrafter, NGramDrafter or BigramDrafter")
        check_supported(target)
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.device = target.get_output_embeddings().weight.device
        self.hidden_size = target.get_output_embeddings().weight.shape[1]
        self.platform = Platform.for_device(self.device)  # CPU-versus-GPU choices, made once here
        self._verify_costs: list[float] | None = None  # interpolated per token count
        self._draft_costs: list[float] | None = None  # seconds to draft a static tree of b nodes, per b
        self._auto_budget: int | None = None
        # how often each kind of drafted node is accepted, learned from every verify of this generator (kept
        # across `generate` calls); it decides which nodes of a CPU step are worth their verify rows
        self.calibrator = AcceptanceCalibrator(max_depth=max(1, drafter.max_depth))
        self.drift = budget_timing.Drift()  # observed verify time against the timed cost, per CPU step
        if self_check:
            check_tree_attention(target)
        # compile: a static KV cache and a verify forward compiled per tree size (CUDA graphs on CUDA); True uses
        # torch.compile's default backend (inductor), a string names another
        if compile not in (False, None) and not isinstance(compile, (bool, str)):
            raise ValueError(f"compile must be True, False or a torch.compile backend name, got {compile!r}")
        self.static = None
        if compile:
            self.static = StaticVerifier(target, drafter.target_layers,
                                         backend=compile if isinstance(compile, str) else "inductor")
        # which way each CPU step under the auto budget drafts, from the tokens per second each way has earned
        arms = ["both", "primary", "lookup"] if isinstance(drafter, HybridDrafter) else ["both"]
        if not drafter.needs_history and self.static is None:  # a plain step feeds the drafter no history
            arms.append("plain")
        self.choice = StepChoice(arms)

    @classmethod
    def from_pretrained(cls, heads_dir: str | os.PathLike, target: str | os.PathLike | nn.Module | None = None,
                        device: torch.device | str | None = None, dtype: torch.dtype | str | None = None,
                        tokenizer=None, lookup_nodes: int = 4, compile: bool | str = False) -> SpeculativeGenerator:
        """Load heads from `heads_dir` and the target: None = the model named in the heads' config, a path
        or hub name, or an already loaded model. Heads trained for another target are refused
        (HeadsMismatchError). `device` defaults to CUDA when available, `dtype` to bfloat16 on a GPU that
        supports it, else float32; a float32 CPU target runs its linear layers on oneDNN
        (`inference.engine.kernels`). `lookup_nodes` grafts n-gram prompt lookup onto the heads' tree
        (`HybridDrafter`): up to that many of each step's draft nodes, and at most half of them, follow an
        earlier match of the context (0: the heads alone). Heads trained for a target with a peft adapter
        (`target.adapter`) load it with that adapter merged in, and refuse a loaded model without it.
        `compile=True` verifies through a static KV cache with the target's forward compiled per tree size
        (`inference.engine.compiled`; CUDA graphs on CUDA): the first call at each size compiles (seconds to minutes),
        later ones run with no Python between the kernels."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from medusa_train.kinds.heads import load_spec
        from medusa_train.target.model import (check_hub_reachable, default_device, merge_recorded_adapter,
                                         resolve_dtype)

        spec = load_spec(heads_dir)  # FileNotFoundError first if it is not a heads directory
        if isinstance(target, nn.Module):
            model = target
            name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        else:
            name = str(target) if target is not None else spec.target_name
            if not name:
                raise ValueError(f"{heads_dir}/config.json names no target model: pass target=PATH")
            check_hub_reachable(name, "target")
            dev = default_device(device)
            if not isinstance(dtype, torch.dtype):
                dtype = resolve_dtype(dtype or "auto", dev)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
            model = merge_recorded_adapter(model, spec.target_fingerprint, name).to(dev)
            if not compile:  # float32 on a CPU: oneDNN's matmul, faster at every row count (inductor makes its own)
                use_onednn_linear(model)
        if tokenizer is None and name:
            tokenizer = AutoTokenizer.from_pretrained(name)
        drafter: Drafter = HeadsDrafter.from_pretrained(heads_dir, model)
        if lookup_nodes:
            drafter = HybridDrafter(drafter, lookup_nodes=lookup_nodes)
        return cls(model.eval(), tokenizer, drafter, compile=compile)

    # -- input handling -------------------------------------------------------------------------------

    def encode(self, prompt: str | torch.Tensor | Sequence[int], chat: bool = False) -> torch.Tensor:
        """Prompt -> input_ids [1, T] on the target's device. Strings are tokenized as is (the tokenizer's
        own special tokens, e.g. BOS, included); chat=True wraps them in the chat template first."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: build the generator with one, or pass input_ids")
            ids = render_prompt(self.tokenizer, prompt) if chat else self.tokenizer(prompt)["input_ids"]
            input_ids = torch.tensor(ids, dtype=torch.long)[None]
        elif isinstance(prompt, (list, tuple)) and any(isinstance(p, str) for p in prompt):
            raise ValueError(f"generate takes one prompt at a time, got a list of {len(prompt)} strings: call "
                             "generate once per prompt")
        else:
            given = torch.as_tensor(prompt)
            if given.is_floating_point() or given.is_complex() or given.dtype == torch.bool:
                raise ValueError(f"prompt token ids must be integers, got a tensor of {given.dtype}: pass "
                                 "input_ids as a long tensor (or a list of ints), or the text itself")
            input_ids = given.to(torch.long)
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [1, T], got shape {tuple(input_ids.shape)}")
            if input_ids.shape[0] != 1:
                raise ValueError(f"batch generation is not supported yet: got {input_ids.shape[0]} prompts "
                                 f"(input_ids {tuple(input_ids.shape)}); call generate once per prompt")
        if input_ids.shape[1] == 0:
            raise ValueError("the prompt is empty: pass at least one token")
        vocab = self.target.get_output_embeddings().weight.shape[0]
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab}) (the target's vocabulary)")
        return input_ids.to(self.device)

    def eos_ids(self, eos_token_id: int | Sequence[int] | None) -> set[int]:
        """The stop tokens: the argument, else those `model.generate` stops at (`medusa_train.target.model.eos_ids`)."""
        if eos_token_id is None:
            return set(eos_ids(self.target, self.tokenizer))
        return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}

    # -- the ladder -----------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor, sampling: Sampling, max_new_tokens: int = 0,
                drafting: bool = True) -> DecodeState:
        """Run the prompt, decide the first new token (the first tree's root). `max_new_tokens` sizes a static
        cache (`compile=True`; it grows, compiling again, if a step outruns it). `drafting=False` (a call that
        drafts nothing): no layers captured for the drafter, no history fed to it."""
        if self.static is not None:
            self.static.reserve(input_ids.shape[1] + max_new_tokens + 2 * (self.drafter.max_depth + 1))
            hs = self.static.prefill(input_ids)  # [T, d or more]
            cache = self.static.cache
        else:
            cache = new_cache()
            layers = self.drafter.target_layers if drafting else ()
            hs = target_forward(self.target, input_ids, cache, layers=layers)[0]  # [T, d or more]
        h = hs[-1, :self.hidden_size]  # h at the prompt's last position
        logits = final_logits(self.target, h)  # [V]
        root = self.next_token(logits, sampling).view(1)
        if drafting and self.drafter.needs_history:  # position j is followed by x_{j+1}; the last one by the root
            self.drafter.observe(hs, torch.cat([input_ids[0, 1:], root]))
        return DecodeState(cache, root, h, input_ids[0].tolist() + root.tolist())

    def next_token(self, logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        if sampling.temperature == 0:
            return logits.argmax(-1)
        return sample_token(target_probs(logits, sampling.temperature, sampling.top_p), sampling.generator)

    def accept(self, tree: Tree, logits: torch.Tensor, sampling: Sampling):
        if sampling.temperature == 0:
            return accept_greedy(tree, logits)
        p = target_probs(logits, sampling.temperature, sampling.top_p)  # [N, V]
        if sampling.acceptance == "typical":
            return accept_typical(tree, p, sampling.generator)
        return accept_lossless(tree, p, sampling.generator)

    def speculative_step(self, state: DecodeState, tree: TreeSpec, budget: int, sampling: Sampling,
                         costs: Sequence[float] | None = None, stats: GenerationStats | None = None,
                         clock: PhaseClock | None = None) -> list[int]:
        """Draft, verify, accept, compact. Returns the appended tokens (accepted drafts + the bonus).
        `costs` (verify seconds per token count) drops the drafted nodes not worth their rows, by their
        calibrated probability of acceptance (`self.calibrator`, which learns from this step's verify).
        `clock` (profiling only) times each of `PHASES` from inside the step."""
        lap = clock.lap if clock is not None else _no_lap
        if clock is not None:
            clock.start()
        t0 = time.perf_counter()
        draft = self.drafter.draft(DraftContext(state.root, state.hidden, state.tokens, tree, budget,
                                                trimmed=costs is not None, host_reads=self.platform.host_reads))
        lap("draft")
        keys = None
        if costs is not None:  # a CPU (`Platform.host_trim`): the host's clock times the drafting, no sync needed
            drafting = time.perf_counter() - t0
            if isinstance(self.drafter, HybridDrafter) and self.drafter.mode == "both" and self.drafter.drafted_primary:
                primary = self.drafter.primary_seconds
                self.drafter.credit(self.calibrator.primary_payoff(draft, costs, drafting - primary, primary))
            draft, keys = self.calibrator.trim(draft, costs, fixed=drafting)
        lap("trim")
        if stats is not None:
            stats.verified_nodes += draft.size
        t_verify = time.perf_counter()
        prefix_len = len(state.tokens) - 1  # the cache holds every token but the root
        if self.static is not None:
            logits, h = self.static.verify(draft, prefix_len)
            state.cache = self.static.cache  # a new one if the verify had to grow it
        else:
            # [N, V], [N, d or more]
            logits, h = verify_tree(self.target, state.cache, draft, self.drafter.target_layers)
        lap("verify")
        acc = self.accept(draft, logits, sampling)
        n, new = acc.to_host(draft)  # the step's one host sync
        if costs is not None and prefix_len <= budget_timing.DRIFT_PREFIX:  # a CPU: this verify against its timing
            self.drift.observe(time.perf_counter() - t_verify, costs[min(draft.size, len(costs) - 1)])
        lap("accept")
        if keys is not None:
            self.calibrator.update(draft, keys, acc.path, n)
        lap("update")
        compact_cache(state.cache, prefix_len, acc.path[:n])
        state.root, state.hidden = acc.bonus.view(1), h[acc.best, :self.hidden_size]
        lap("compact")
        if self.drafter.needs_history:  # the accepted nodes, each followed by the next one (the last: bonus)
            self.drafter.observe(h[acc.path[:n]], torch.cat([draft.tokens[acc.path[1:n]], state.root]))
        state.tokens.extend(new)
        lap("observe")
        if clock is not None:
            clock.rows += draft.size
        return new

    def chosen_step(self, state: DecodeState, tree: TreeSpec, budget: int, sampling: Sampling,
                    costs: Sequence[float], stats: GenerationStats) -> list[int]:
        """One step of the arm `self.choice` picks (`inference.engine.choice`), timed on the host's clock (a CPU's
        step has no device to wait for) and credited to it."""
        context = self.drafter.step_context(state.tokens)
        arm = self.choice.choose(context)
        t = self.choice.clock()
        if arm == "plain":
            new = self.plain_step(state, sampling, costs, stats)
        elif isinstance(self.drafter, HybridDrafter):
            self.drafter.mode = arm
            try:
                new = self.speculative_step(state, tree, budget, sampling, costs, stats)
            finally:
                self.drafter.mode = "both"
        else:
            new = self.speculative_step(state, tree, budget, sampling, costs, stats)
        self.choice.record(arm, len(new), self.choice.clock() - t, context)
        stats.arms[arm] = stats.arms.get(arm, 0) + 1
        return new

    def plain_step(self, state: DecodeState, sampling: Sampling, costs: Sequence[float] | None = None,
                   stats: GenerationStats | None = None) -> list[int]:
        """A step that drafts nothing, run as plain decoding runs it: the root through the target's ordinary causal
        forward (no tree mask, no position ids, no layers captured, no drafter called); its logits decide the next
        root. Returns [that token]. `costs` (a CPU with the auto budget): its time, a verify of one row, is checked
        against the timing of one row (`self.drift`)."""
        t = time.perf_counter()
        h = target_forward(self.target, state.root[None], state.cache)[0, -1]  # [d]
        state.root, state.hidden = self.next_token(final_logits(self.target, h), sampling).view(1), h
        new = state.root.tolist()  # the step's one host read
        state.tokens.extend(new)
        if costs is not None and len(state.tokens) <= budget_timing.DRIFT_PREFIX:  # is the timing still right?
            self.drift.observe(time.perf_counter() - t, costs[1])
        if stats is not None:
            stats.verified_nodes += 1
        return new

    def generate(self, prompt: str | torch.Tensor | Sequence[int], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
                 acceptance: Acceptance = "exact", tree: Literal["auto", "static", "dynamic"] | TreeSpec = "auto",
                 tree_budget: Literal["auto"] | int = "auto", streamer=None, seed: int | None = None,
                 chat: bool = False) -> GenerationOutput:
        """Generate up to `max_new_tokens` new tokens (stopping right after an EOS token).

        temperature 0 is greedy and reproduces the target's greedy output exactly (whatever `acceptance`
        says). With temperature > 0, `acceptance="exact"` samples exactly from the target's (temperature,
        top_p) distribution; `"typical"` is Medusa's typical acceptance: more tokens per step, but lossy. `tree`: "auto"
        (= "static"), "static" (shape from static tree search), "dynamic" (EAGLE-2 style), or a list of
        rank paths; `tree_budget`: draft nodes per step (root excluded) or "auto" (tuned on this machine; on a
        CPU each step then also drops the drafts whose calibrated probability of acceptance is not worth
        their verify rows, `inference.engine.calibrate`, so a step with no likely draft verifies its root alone).
        `streamer` follows the transformers protocol (`put` the prompt, then new tokens; `end`).
        """
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not _is_number(temperature) or not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if seed is not None and not _is_int(seed):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {acceptance!r}")
        tree = "static" if tree == "auto" else tree
        if isinstance(tree, str) and tree not in ("static", "dynamic"):
            raise ValueError(f"tree must be 'auto', 'static', 'dynamic' or a list of rank paths, got {tree!r}")
        budget, costs = self.step_budget(tree, tree_budget)
        input_ids = self.encode(prompt, chat)
        self.check_context(input_ids.shape[1], max_new_tokens)
        eos = self.eos_ids(eos_token_id)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        sampling = Sampling(temperature, top_p, acceptance, generator)
        stats = GenerationStats(tree=tree if isinstance(tree, str) else "paths", tree_budget=budget)
        out: list[int] = []

        def emit(tokens: list[int]) -> bool:
            """Append up to the limit / first EOS; True when generation is done."""
            done = False
            taken = []
            for tok in tokens:
                taken.append(tok)
                if tok in eos or len(out) + len(taken) >= max_new_tokens:
                    done = True
                    break
            out.extend(taken)
            if streamer is not None and taken:
                streamer.put(torch.tensor(taken))
            return done

        self.drafter.reset()
        start = time.perf_counter()
        if streamer is not None:
            streamer.put(input_ids.cpu())
        with torch.inference_mode():
            if max_new_tokens > 0:
                # a budget of 0 drafts nothing: plain decoding, at plain decoding's cost (the compiled path keeps
                # its own padded verify)
                plain = budget == 0 and isinstance(tree, str) and self.static is None
                state = self.prefill(input_ids, sampling, max_new_tokens, drafting=not plain)
                stats.target_forwards = 1
                done = emit(state.tokens[-1:])
                while not done:
                    if plain:
                        new = self.plain_step(state, sampling, costs, stats)
                    elif costs is None:
                        new = self.speculative_step(state, tree, budget, sampling, costs, stats)
                    else:  # a CPU with the auto budget: the arm that has earned the most tokens per second
                        new = self.chosen_step(state, tree, budget, sampling, costs, stats)
                    stats.steps += 1
                    stats.accept_lengths.append(len(new))
                    done = emit(new)
        if streamer is not None:
            streamer.end()
        stats.seconds = time.perf_counter() - start
        drifted = self.drift.drifted()
        # the machine is not what it was when timed: time again at the next call, once per target (every generator
        # on it shares the timings)
        if drifted is not None and budget_timing.may_retime(self.timing_owner):
            print(f"verify steps ran at {drifted:.2f}x their timed cost: timing again at the next call",
                  file=sys.stderr, flush=True)
            self.remeasure_verify_seconds()
        stats.target_forwards = stats.steps + (1 if max_new_tokens > 0 else 0)
        stats.new_tokens = len(out)
        stats.tau = len(out) / max(stats.target_forwards, 1)
        stats.tokens_per_s = len(out) / max(stats.seconds, 1e-9)
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else ""
        return GenerationOutput(text, torch.tensor(out, dtype=torch.long), stats)

    # -- limits and tuning ----------------------------------------------------------------------------

    def step_budget(self, tree: TreeSpec, tree_budget: Literal["auto"] | int) -> tuple[int, list[float] | None]:
        """(draft nodes per step, verify costs for the calibrated trim or None) for a `tree_budget`: "auto"
        is the tuned budget, trimmed per step on a CPU; an int is used as is and never trimmed."""
        if tree_budget == "auto":
            costs = self.verify_costs() if self.platform.host_trim and isinstance(tree, str) else None
            return self.auto_tree_budget(), costs
        if _is_int(tree_budget) and tree_budget >= 0:
            return tree_budget, None
        raise ValueError(f"tree_budget must be 'auto' or an int >= 0 (draft nodes per step), got {tree_budget!r}")

    def check_context(self, prompt_len: int, max_new_tokens: int) -> None:
        """Error before generating when prompt + new tokens + tree depth exceed the target's context."""
        limit = context_limit(self.target)
        need = prompt_len + max_new_tokens + self.drafter.max_depth
        if limit is not None and max_new_tokens > 0 and need > limit:
            raise ContextLengthError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + tree depth "
                f"({self.drafter.max_depth}) = {need} exceeds the target's context of {limit} tokens; "
                f"shorten the prompt or lower max_new_tokens to {max(limit - prompt_len - self.drafter.max_depth, 0)}")

    def verify_seconds(self) -> dict[int, float]:
        """Seconds per target forward of L tree rows after a prefix, for a few L (`inference.engine.budget`: measured
        once per target and shared by every generator on it; `remeasure_verify_seconds` measures again). A
        compiled generator times its own compiled verify, at the row counts it compiles."""
        return budget_timing.verify_seconds(self.target, self.platform, context_limit(self.target), self.static)

    @property
    def timing_owner(self):
        """What the verify timings belong to: the compiled verifier when there is one, else the target."""
        return self.static if self.static is not None else self.target

    def drafter_timing_key(self) -> str:
        """This drafter's key in the timings file (on top of the target's verify key)."""
        verify_key = budget_timing.verify_key(self.target, self.platform, context_limit(self.target), self.static)
        return budget_timing.drafter_key(verify_key, self.drafter)

    def remeasure_verify_seconds(self) -> None:
        """Forget the verify timings of this target (e.g. after changing its kernels or the machine's load)
        and the auto budget derived from them, and this drafter's drafting timings; the next `generate` measures
        again."""
        budget_timing.write_timings(self.drafter_timing_key(), None)
        budget_timing.forget_verify_seconds(self.timing_owner)
        self._verify_costs, self._draft_costs, self._auto_budget = None, None, None

    def verify_costs(self) -> list[float]:
        """costs[n]: seconds of a verify forward over n tokens, n = 0..the longest measured (costs[0] = 0),
        interpolated between the measured lengths (computed once per generator)."""
        if self._verify_costs is None:
            self._verify_costs = budget_timing.verify_costs(self.verify_seconds(), padded=self.static is not None)
        return self._verify_costs

    def draft_costs(self) -> list[float]:
        """draft[b]: seconds this generator's drafter takes to draft a static tree of b nodes, b = 0..the
        longest verify timed, measured once per drafter shape, target shape and machine and kept in the timings file
        (`inference.engine.budget.draft_seconds`, `drafter_key`) from a real
        prefill of a synthetic prompt (so drafters with history have it), at every budget the verify timings
        cover and interpolated between them."""
        if self._draft_costs is None:
            costs = self.verify_costs()
            key = self.drafter_timing_key()
            kept = budget_timing.read_timings(key)
            if isinstance(kept, list) and len(kept) == len(costs) - 1:
                self._draft_costs = [float(t) for t in kept]
                return self._draft_costs
            vocab = self.target.get_output_embeddings().weight.shape[0]
            prompt = ((torch.arange(budget_timing.PREFIX, device=self.device) * 31 + 7) % vocab)[None]
            self.drafter.reset()
            with torch.inference_mode():
                state = self.prefill(prompt, Sampling(), max_new_tokens=len(costs))

            def ctx(b: int) -> DraftContext:
                return DraftContext(state.root, state.hidden, state.tokens, "static", b,
                                    trimmed=self.platform.host_trim, host_reads=self.platform.host_reads)

            budgets = [n - 1 for n in self.platform.lengths if n - 1 < len(costs) - 1]
            self._draft_costs = budget_timing.draft_seconds(self.drafter, ctx, budgets, self.platform)
            self._draft_costs += [self._draft_costs[-1]] * (len(costs) - 1 - len(self._draft_costs))
            self.drafter.reset()
            budget_timing.write_timings(key, self._draft_costs)
        return self._draft_costs

    def auto_tree_budget(self) -> int:
        """The draft-node budget maximising expected tokens per second of a step on this machine: expected tau
        (the drafter's static tree prior) over the verify of the tree's rows (interpolated between the measured
        lengths) plus drafting it (`draft_costs`). Computed once per generator."""
        if self._auto_budget is None:
            costs = self.verify_costs()
            self._auto_budget = budget_timing.best_budget(self.drafter.expected_tau(len(costs) - 2), costs,
                                                          self.draft_costs())
        return self._auto_budget
