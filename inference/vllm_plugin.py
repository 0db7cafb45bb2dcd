"""Chained and parallel (Medusa-1) heads served by vLLM's V1 engine, through a vLLM plugin.

    pip install --no-deps .                 # this checkout, into vLLM's venv: its `vllm.general_plugins` entry point
    vllm serve TARGET --speculative-config '{"method": "medusa_train", "model": HEADS_DIR, "num_speculative_tokens": 4}'
    # or LLM(model=TARGET, speculative_config={"method": "medusa_train", "model": HEADS_DIR, ...})

HEADS_DIR is the directory `train.py` wrote (no export needed). vLLM has no method for heads that read the target's
hidden state (0.33 removed `medusa`), and its `custom_class` proposer is handed token ids only. vLLM loads this
module's `register` in each of its processes (front end, engine core, workers); it makes three changes there:

1. front end: `EngineArgs.create_speculative_config` takes `"method": "medusa_train"`: it checks the heads against
   the target (a refusal is one line naming why and what to do), then hands vLLM `method: custom_class` with `model` the
   heads directory made absolute, so vLLM builds no draft model and disables what custom proposers cannot take
   (async scheduling, the V2 model runner);
2. workers: `create_custom_proposer` builds `HeadsProposer` when that `model` is a heads directory (vLLM's own path
   otherwise: a dotted class name);
3. workers: `GPUModelRunner.propose_draft_token_ids` (the CPU runner inherits it) hands `HeadsProposer` each request's
   target hidden state at its last verified position and the token sampled there, where the custom_class branch would
   hand token ids only. Which row: the logits rows are a request's scheduled drafts + 1, in the batch's order; a request
   that sampled n tokens (n-1 drafts accepted, then the target's own) ends at row n-1 of its own rows, the same row
   vLLM's 0.32 Medusa proposer picked. That state is after the target's final norm, what its LM head reads: the h_t
   the heads were trained on.

Then every request's chain runs batched, in the target's dtype: s_0 = h_t; chained heads step with each head's own
block and the embedding of the token before it, parallel heads all read h_t; each draft is the argmax over the scored
vocabulary (the draft vocabulary mapped back to target ids), with its probability. The heads' own modules compute it
(`medusa_train.kinds`, which imports torch and safetensors only), so vLLM drafts what our engine drafts.

What each request drafts is our engine's default (`inference.vllm_drafts`): the heads' chain or the n-gram lookup's,
whichever its calibrated chances say gives more, cut to the tokens that pay for their verify rows at this batch size
on this machine, down to none; the heads run only on steps where running them earns more tokens a second. Two keys of
the speculative config change it: `"lookup": false` (the heads alone) and `"lengths": "fixed"` (every request drafts
num_speculative_tokens). `tests/test_vllm.py` replays both ways: with both keys set, vLLM's chains replayed with our
drafter give vLLM's accept counts; by default, the drafts the plugin made give them, each a prefix of the heads' chain
or of the lookup's.

Served: chained heads (both blocks, with or without a draft vocabulary, own embedding or LM heads) and parallel heads.
Refused in one line: other kinds (eagle3 and dflash are served by vLLM's own methods, after `--format speculators`),
heads with a context encoder (`heads.context_layers` > 0: they read every committed position, which vLLM's prefix
cache skips), heads for another target, more speculative tokens than heads.
Tensor parallelism: with more than one rank the LM head is sharded, so the heads score through the target's own
`compute_logits` (a gather on every rank, as vLLM's Medusa did), and the weight signature check is left out.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from inference.vllm_drafts import LENGTHS, DraftPlanner, lookup
from inference.vllm_dspark import (VLLM_METHOD, _sample_sequential, as_dflash, context_only, sampled_lists,
                                   schedule_of, v1_runs)

METHOD = "medusa_train"
# what the runner patch reads of vLLM's `propose_draft_token_ids` (the same in 0.32 and 0.33)
RUNNER_ARGS = ("scheduler_output", "sampled_token_ids", "sample_hidden_states", "spec_decode_metadata")
SETTINGS = {"lookup": True, "lengths": "auto"}  # our keys in the speculative config, and their defaults

logger = logging.getLogger(__name__)


def heads_refusal(directory: str | os.PathLike, hidden_size: int, vocab_size: int,
                  num_speculative_tokens: int | None) -> tuple[str | None, Any]:
    """(why the heads in `directory` cannot be served on a target of this hidden and vocabulary size with this many
    speculative tokens, as one line; None when they can, and their spec)."""
    import medusa_train.kinds  # noqa: F401 - registers every kind, so that their configs read
    from medusa_train.kinds.heads import kind_class, load_spec

    where = f"speculative_config model {directory}"
    try:
        spec = load_spec(directory)
    except (FileNotFoundError, ValueError) as e:
        return f"{where}: {e}", None
    if not kind_class(spec.kind).served_by_plugin:
        return (f"{where} holds {spec.kind} heads, which vLLM serves with its own method: export them "
                f"(python -m medusa_train.export {directory} OUT --format speculators) and serve OUT with "
                f"\"method\": \"{spec.kind}\""), spec
    if spec.context_layers:
        return (f"{where}: these {spec.kind} heads have a context encoder (heads.context_layers="
                f"{spec.context_layers}), which reads every committed position and vLLM's prefix cache skips some; "
                "train servable heads with heads.context_layers=0"), spec
    trained_for = f" (trained for {spec.target_name})" if spec.target_name else ""
    if (spec.hidden_size, spec.vocab_size) != (hidden_size, vocab_size):
        return (f"{where}: the heads were trained for a target of hidden size {spec.hidden_size} and vocabulary "
                f"{spec.vocab_size}{trained_for}, and this target has {hidden_size} and {vocab_size}: serve the "
                "target they were trained for"), spec
    if num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= spec.num_heads:
        return (f"{where}: num_speculative_tokens is {num_speculative_tokens}, and these heads draft 1 to "
                f"{spec.num_heads} tokens (one a head): set it in that range"), spec
    return None, spec


def settings_of(model: str) -> tuple[str, dict[str, Any]]:
    """(the heads directory, our settings) of the `model` string `_translate` hands vLLM: `DIR?lookup=1&lengths=auto`
    (the settings travel in it to every process vLLM starts, as nothing else of ours does)."""
    directory, mark, query = str(model).rpartition("?")
    if not mark:
        return str(model), dict(SETTINGS)
    pairs = dict(part.partition("=")[::2] for part in query.split("&"))
    return directory, {"lookup": pairs.get("lookup", "1") == "1", "lengths": pairs.get("lengths", "auto")}


def _translate(speculative_config: dict[str, Any], model_config: Any) -> dict[str, Any]:
    """`{"method": "medusa_train", "model": HEADS_DIR, ...}` as vLLM's custom_class method takes it (ValueError, one
    line, for heads it cannot serve or a setting it does not know)."""
    ours = {key: speculative_config[key] for key in SETTINGS if key in speculative_config}
    speculative_config = {key: v for key, v in speculative_config.items() if key not in SETTINGS}
    directory = speculative_config.get("model")
    if not directory:
        raise ValueError(f'speculative_config method "{METHOD}" needs "model": the heads directory train.py wrote')
    if not isinstance(ours.get("lookup", True), bool):
        raise ValueError(f'speculative_config "lookup" is {ours["lookup"]!r}: set it to true (heads and n-gram '
                         "lookup, the default) or false (the heads alone)")
    if ours.get("lengths", "auto") not in LENGTHS:
        raise ValueError(f'speculative_config "lengths" is {ours["lengths"]!r}: set it to "auto" (each request '
                         'drafts what pays, the default) or "fixed" (num_speculative_tokens for every request)')
    k = speculative_config.get("num_speculative_tokens")
    why, spec = heads_refusal(directory, model_config.get_hidden_size(), model_config.get_vocab_size(), k)
    if why:
        raise ValueError(why)
    ours = SETTINGS | ours
    model = f"{Path(directory).resolve()}?lookup={int(ours['lookup'])}&lengths={ours['lengths']}"
    return speculative_config | {"method": "custom_class", "model": model, "num_speculative_tokens": k or spec.num_heads}


class HeadsProposer:
    """vLLM's proposer for our chained and parallel heads (built by vLLM's custom_class path, fed by the runner patch):
    `load_model(target)` loads the heads onto the target's device in its dtype and checks they were trained for it;
    `draft(h, tokens, n)` runs every request's chain at once."""

    def __init__(self, vllm_config: Any):
        spec_config = vllm_config.speculative_config
        self.directory, settings = settings_of(spec_config.model)
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.planner = DraftPlanner(self.num_speculative_tokens, settings["lookup"], settings["lengths"])
        # the heads' chains as they are (a tensor, no host read): lookup off and fixed lengths
        self.chains_only = not settings["lookup"] and settings["lengths"] == "fixed"
        self.steps = 0
        self.dtype = vllm_config.model_config.dtype
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.tensor_parallel = vllm_config.parallel_config.tensor_parallel_size > 1
        self.heads = None

    def load_model(self, target: torch.nn.Module) -> None:
        from medusa_train.kinds.heads import DraftHeads, check_fingerprint

        device = next(target.parameters()).device
        self.heads = DraftHeads.from_pretrained(self.directory, device=device, dtype=self.dtype).eval()
        # what vLLM's own forward embeds with (a Gemma's scale included, as transformers' embedding module has it)
        self._embed = getattr(target, "embed_input_ids", None) or target.get_input_embeddings()
        self._compute_logits = target.compute_logits
        self._weight = None
        embedding = getattr(getattr(getattr(target, "model", None), "embed_tokens", None), "weight", None)
        lm_head = getattr(getattr(target, "lm_head", None), "weight", None)
        if self.tensor_parallel or embedding is None or lm_head is None:
            logger.info("medusa_train: the heads score through the target's compute_logits (no weight check)")
            return
        # vLLM pads both to a multiple of 64 rows: the target's rows are the first vocab_size
        embedding, lm_head = embedding[:self.vocab_size], lm_head[:self.vocab_size]
        # the weights vLLM loaded, read as the transformers model whose fingerprint the heads keep (an adapter's
        # record left out: vLLM serves the merged model, and its weights are what is compared)
        weights = SimpleNamespace(get_input_embeddings=lambda: SimpleNamespace(weight=embedding),
                                  get_output_embeddings=lambda: SimpleNamespace(weight=lm_head))
        expected = {k: v for k, v in self.heads.spec.target_fingerprint.items() if k != "adapter"}
        check_fingerprint(expected, weights, self.heads.spec.target_name)
        if not self.heads.owns_lm_head:  # the scored rows, gathered once
            ids = self.heads.draft_ids
            self._weight = (lm_head[ids] if self.heads.spec.draft_vocab_size else lm_head).to(self.dtype)

    def _logits(self, k: int, states: torch.Tensor) -> torch.Tensor:
        heads = self.heads
        if heads.owns_lm_head:
            return heads.score(k, states)
        if self._weight is not None:
            return F.linear(states, self._weight)
        logits = self._compute_logits(states)[:, :self.vocab_size]
        return logits[:, heads.draft_ids] if heads.spec.draft_vocab_size else logits

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, last: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n drafts [R, n], each one's probability under its head [R, n]) for R requests from the target's state at
        each one's last verified position [R, d] and the token sampled there [R]."""
        heads = self.heads
        s = heads.start(hidden.to(self.dtype))
        drafts, probs = [], []
        token = last
        for k in range(n):
            if heads.chained:
                s_k = s = heads.step(k, s, token, self._embed)  # head k+1 reads s_k and the token before its own
            else:
                s_k = heads.step(k, s, None)  # parallel heads all read h_t
            p, best = self._logits(k, s_k).float().softmax(-1).max(-1)
            token = heads.to_target_ids(best)
            drafts.append(token)
            probs.append(p)
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1)

    def plan(self, runner: Any, scheduler_output: Any, sampled: list[list[int]], hidden: torch.Tensor,
             per_request: list[int] | None, n: int) -> list[list[int]] | torch.Tensor:
        """This step's drafts, one a request in the batch's order: the planner's (`inference.vllm_drafts`), or the
        heads' chains as a tensor [R, n] when lookup is off and lengths fixed."""
        live, rows, last = rows_to_draft(sampled, per_request)
        device = hidden.device

        def drafted() -> tuple[torch.Tensor, torch.Tensor]:  # the heads' chains of the live requests
            return self.draft(hidden[torch.tensor(rows, device=device)], torch.tensor(last, device=device), n)

        if self.chains_only:
            out = torch.zeros(len(sampled), n, dtype=torch.long, device=device)
            if live:
                out[torch.tensor(live, device=device)] = drafted()[0]
            return out
        batch = runner.input_batch
        req_ids = batch.req_ids
        planner = self.planner
        planner.start_step(req_ids, sampled, scheduler_output)
        ends = batch.num_tokens_no_spec
        room = [max(0, min(n, self.max_model_len - 1 - int(ends[i]))) for i in live]
        heads = found = None
        if live and planner.runs_heads:
            drafts, probs = drafted()
            heads = drafts.cpu().numpy(), probs.cpu().numpy()
        if live and planner.use_lookup:
            found = [lookup(batch.token_ids_cpu[i, :ends[i]], n) for i in live]
        self.steps += 1
        if self.steps % 1000 == 0:
            logger.info("medusa_train drafts: %s", planner.summary())
        return planner.plan(req_ids, live, heads, found, room)

    def propose(self, *args: Any, **kwargs: Any):
        raise RuntimeError("medusa_train heads need the target's hidden states, which vLLM's custom_class call does "
                           "not pass: the medusa_train plugin's runner patch is not in place (is medusa-train "
                           "installed in this venv, and VLLM_PLUGINS unset or naming medusa_train?)")


def rows_to_draft(sampled_token_ids: list[list[int]], num_draft_tokens: list[int] | None
                  ) -> tuple[list[int], list[int], list[int]]:
    """(the requests that sampled tokens this step, each one's logits row at its last sampled token, that token).
    A request's logits rows are its scheduled drafts + 1, in the batch's order; one that sampled n tokens ends at its
    own row n-1. `num_draft_tokens` None: no request had drafts, one row each."""
    live, rows, last = [], [], []
    offset = 0
    for i, tokens in enumerate(sampled_token_ids):
        if tokens:  # none: a prefill chunk short of the prompt's end, or a request discarded this step
            live.append(i)
            rows.append(offset + len(tokens) - 1)
            last.append(tokens[-1])
        offset += (num_draft_tokens[i] if num_draft_tokens is not None else 0) + 1
    return live, rows, last


def _propose_with_hidden_states(original):
    """`GPUModelRunner.propose_draft_token_ids`, handing a `HeadsProposer` the target's hidden states."""
    signature = inspect.signature(original)
    missing = [a for a in RUNNER_ARGS if a not in signature.parameters]
    if missing:
        raise RuntimeError(f"this vLLM's GPUModelRunner.propose_draft_token_ids takes no {', '.join(missing)}: the "
                           "medusa_train plugin supports vLLM 0.32 and 0.33")

    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, HeadsProposer):
            schedule = schedule_of(self)
            if schedule is None:
                return original(self, *args, **kwargs)
            a = signature.bind(self, *args, **kwargs).arguments
            sampled = sampled_lists(self, a["sampled_token_ids"])
            drafter.dspark_skip = not schedule.start(self, a["scheduler_output"], sampled)  # the block, or context only
            drafts = original(self, *args, **kwargs)
            return schedule.plan(self, a["scheduler_output"], sampled, drafts, drafter.dspark_confidence,
                                 pending=isinstance(a["sampled_token_ids"], torch.Tensor))
        a = signature.bind(self, *args, **kwargs).arguments
        sampled, hidden = a["sampled_token_ids"], a["sample_hidden_states"]
        n = getattr(a["scheduler_output"], "num_spec_tokens_to_schedule", 0) or drafter.num_speculative_tokens
        n = min(n, drafter.num_speculative_tokens)
        metadata = a["spec_decode_metadata"]
        per_request = None if metadata is None or hidden.shape[0] == len(sampled) else metadata.num_draft_tokens
        return drafter.plan(self, a["scheduler_output"], sampled, hidden, per_request, n)

    propose_draft_token_ids._medusa_train = True
    return propose_draft_token_ids


def _create_proposer(original):
    @functools.wraps(original)
    def create_custom_proposer(vllm_config):
        model = vllm_config.speculative_config.model
        if model and Path(settings_of(model)[0], "config.json").is_file():
            return HeadsProposer(vllm_config)
        return original(vllm_config)

    create_custom_proposer._medusa_train = True
    return create_custom_proposer


def _speculative_config_of_ours(original):
    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        cfg = self.speculative_config
        if isinstance(cfg, dict) and cfg.get("method") == METHOD:
            self.speculative_config = _translate(cfg, target_model_config)
        config = original(self, target_model_config, target_parallel_config)
        if config is not None and config.method == VLLM_METHOD and v1_runs():
            as_dflash(config)  # vLLM's V1 runner drafts DSpark through its DFlash proposer (inference.vllm_dspark)
        return config

    create_speculative_config._medusa_train = True
    return create_speculative_config


def _patch(owner: Any, name: str, wrap) -> None:
    current = getattr(owner, name)
    if not getattr(current, "_medusa_train", False):  # vLLM may load plugins more than once in a process
        setattr(owner, name, wrap(current))


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: make `"method": "medusa_train"` serve our heads in this process."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker import gpu_model_runner

    _patch(EngineArgs, "create_speculative_config", _speculative_config_of_ours)
    _patch(gpu_model_runner, "create_custom_proposer", _create_proposer)
    _patch(gpu_model_runner.GPUModelRunner, "propose_draft_token_ids", _propose_with_hidden_states)
    _patch(DFlashProposer, "_sample_draft_tokens", _sample_sequential)
    _patch(DFlashProposer, "propose", lambda _: context_only(DFlashProposer))
