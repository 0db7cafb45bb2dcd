"""Real tau during training: every `eval.tau_every` steps the engine itself generates, greedy, with the heads as
they are, on held-out prompts, and the trainer logs the tokens it appended per target forward.

What it measures is what `SpeculativeGenerator.from_pretrained(heads_dir, lookup_nodes=0)` measures on a heads
directory saved at that step (heads + that step's acceptance.json), with the tree budget pinned at
`eval.tau_budget`: the engine's static tree for the acceptance just measured, heads alone (no lookup), the prompts'
new tokens summed over their target forwards (the prefill counted, as the engine counts it). It leaves training as
it was: it drafts with a copy of the heads (the engine casts its drafter to the target's dtype), under a forked RNG,
and puts the target back in the mode it found it in.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from inference.engine.drafters import HeadsDrafter
from inference.engine.generator import SpeculativeGenerator

from ..data.chat import render_prompt
from ..config import Config, ConfigError
from ..kinds.heads import DraftHeads
from ..data.prompts import load_prompts

MIN_PROMPT = 4  # a row with fewer unsupervised tokens before its reply (plain text) gives its first half instead


def tau_prompt_ids(cfg: Config, tokenizer, eval_ds) -> list[list[int]]:
    """The prompts of the real-tau runs as token ids: `eval.tau_prompts` (a file or dataset; first user turns through
    the chat template when the tokenizer has one), else the held-out split's rows up to their first supervised token
    (a chat row: its prompt and the assistant header). The first `eval.tau_num_prompts` distinct ones."""
    e = cfg.eval
    out: list[list[int]] = []
    if e.tau_prompts:
        too_long = []
        for p in load_prompts(e.tau_prompts):
            ids = (render_prompt(tokenizer, p.text) if getattr(tokenizer, "chat_template", None)
                   else tokenizer(p.text)["input_ids"])
            if len(ids) >= cfg.data.max_length:
                too_long.append(len(ids))
            elif ids not in out:
                out.append(ids)
            if len(out) == e.tau_num_prompts:
                break
        if not out and too_long:  # then every prompt was too long
            raise ConfigError(f"eval.tau_prompts={e.tau_prompts}: all {len(too_long)} prompts are dropped, each at "
                              f"least data.max_length={cfg.data.max_length} tokens long with its chat template (the "
                              f"shortest {min(too_long)}): raise data.max_length above {min(too_long)}, or give "
                              "shorter prompts")
        return out
    for row in eval_ds if eval_ds is not None else []:
        ids, labels = list(row["input_ids"]), list(row["labels"])
        first = next((i for i, label in enumerate(labels) if label != -100), len(ids))
        prompt = ids[:first] if first >= MIN_PROMPT else ids[:max(1, len(ids) // 2)]
        if prompt not in out:
            out.append(prompt)
        if len(out) == e.tau_num_prompts:
            break
    return out


def rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose RNG `torch.random.fork_rng` must keep for work on `device` (none on a CPU)."""
    if device.type != "cuda":
        return []
    return [torch.cuda.current_device() if device.index is None else device.index]


def snapshot_heads(heads: DraftHeads) -> DraftHeads:
    """A copy of `heads` on the CPU, detached from training (the engine moves and casts its drafter in place)."""
    copy = DraftHeads(heads.spec)
    copy.load_state_dict({k: v.detach().to("cpu", copy=True) for k, v in heads.state_dict().items()})
    return copy.eval()


@torch.no_grad()
def measure_tau(heads: DraftHeads, target: nn.Module, topk_accuracy: Sequence[Sequence[float]] | None,
                prompts: Sequence[Sequence[int]], budget: int, max_new_tokens: int,
                self_check: bool = True) -> dict[str, Any]:
    """Greedy generation with a copy of `heads` on each prompt at the pinned tree `budget`: {"tau" (new tokens per
    target forward, all prompts together), "tokens_per_s" (this machine, this moment), "new_tokens",
    "target_forwards", "prompts", "seconds"}. Leaves the global RNG and the target's mode as they were."""
    was_training = target.training
    new = forwards = 0
    seconds = 0.0
    with torch.random.fork_rng(devices=rng_devices(target.get_output_embeddings().weight.device)):
        drafter = HeadsDrafter(snapshot_heads(heads), target,
                               [list(r) for r in topk_accuracy] if topk_accuracy is not None else None)
        gen = SpeculativeGenerator(target, None, drafter, self_check=self_check)
        for ids in prompts:
            start = time.perf_counter()
            out = gen.generate(list(ids), max_new_tokens=max_new_tokens, tree_budget=budget)
            seconds += time.perf_counter() - start
            new += out.stats.new_tokens
            forwards += out.stats.target_forwards
    target.train(was_training)
    return {"tau": new / max(forwards, 1), "tokens_per_s": new / max(seconds, 1e-9), "new_tokens": new,
            "target_forwards": forwards, "prompts": len(prompts), "seconds": seconds}
