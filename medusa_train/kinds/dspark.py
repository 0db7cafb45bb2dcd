"""DSpark (`heads.kind: dspark`): DFlash's block drafter with a sequential Markov head and a confidence head, as
speculators 0.9 trains it and vLLM 0.32 serves it (`"method": "dspark"`; DeepSeek's DeepSpec).

The backbone is dflash's (`medusa_train.kinds.dflash`): one forward over the block of the anchor x_{t+1} and K mask
tokens gives every slot's state s_i = norm(x_i) at once. Purely parallel slots cannot see what was drafted before
them in the block, so DSpark adds a first-order Markov head: slot i's logits are

    lm_head(s_i) + markov_w2(markov_w1[y_{i-1}]),

where y_{i-1} is the token drafted at the slot before (y_0: the anchor), markov_w1 an embedding of the target's
vocabulary into r dimensions (`heads.markov_rank`) and markov_w2 [V', r] a low-rank map onto the draft vocabulary. So a
depth's candidates depend on their parent's token (the engine drafts per node, as chained heads), at the cost of one
r-wide lookup and an r x V' product per node. The confidence head predicts each drafted token's chance of
acceptance, sigmoid(proj([s_i; markov_w1[y_{i-1}]])), trained to the rate sampling accepts it, sum_v min(p_v, q_v)
(`loss.confidence_weight`); vLLM schedules each request's verify length by it, and our engine's calibrated trim
keys each parent's best child by it (`inference.engine.calibrate`, kind "confident").

Training (teacher-forced): y_{i-1} is the data token x_{t+i}. The states a step scores carry the Markov embedding
past the hidden size, [s_i; markov_w1[x_{t+i}]], which `extra_scoring_weight` (markov_w2) scores beside the LM head,
so the fused chunked loss takes the bias without a [n, V'] tensor of its own. The objective is DSpark's unless the
recipe says otherwise (`loss_defaults`): total variation to the target's distribution 0.9 (the direct proxy of
acceptance), cross-entropy 0.1, positions weighted by `loss.decay`. markov_w2 starts at zero, so fresh heads draft
exactly as dflash heads would.

Tensor names follow speculators' DSpark layout (`markov_head.markov_w1`, `markov_head.markov_w2`,
`confidence_head.proj`), so the export is dflash's plus these and the config's DSpark keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..base.errors import ConfigError
from .dflash import DFlashDraft, DFlashDrafting, DFlashHeads, DFlashOptions, speculators_config
from .heads import Export, ExportSource, register
from .speculators import speculators_source_tensors

DEFAULT_RANK = 256  # speculators' and DeepSpec's markov_rank


@dataclass
class DSparkOptions(DFlashOptions):
    markov_rank: int = DEFAULT_RANK
    """dspark only: the rank r of its Markov head (the token drafted before a slot adds markov_w2(markov_w1[token]),
    [V', r] x [r], to the slot's logits)."""
    confidence_head: bool = True
    """dspark only: a head that predicts each drafted token's chance of acceptance (vLLM's confidence-scheduled
    verify length reads it)."""


class DSparkDraft(DFlashDraft):
    """dflash's layers, plus `markov_head` (markov_w1 [V, r], markov_w2 [V', r]) and `confidence_head` (proj: d + r ->
    1, with a bias), named as speculators' DSpark model names them."""

    def __init__(self, layer: dict[str, Any], num_aux: int, scored_vocab: int, num_slots: int, mask_token_id: int,
                 vocab: int, rank: int, confidence: bool):
        super().__init__(layer, num_aux, scored_vocab, num_slots, mask_token_id)
        d = self.fc.out_features
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_head.markov_w2 = nn.Linear(rank, scored_vocab, bias=False)
        nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)  # speculators' start
        nn.init.zeros_(self.markov_head.markov_w2.weight)  # no bias yet: fresh heads draft as dflash's
        self.confidence_head = None
        if confidence:
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(d + rank, 1)
            nn.init.zeros_(self.confidence_head.proj.weight)
            nn.init.zeros_(self.confidence_head.proj.bias)

    def markov(self, tokens: torch.Tensor) -> torch.Tensor:
        """The Markov embedding [..., r] of previous tokens (target ids) [...]."""
        return self.markov_head.markov_w1(tokens)

    def bias(self, embedding: torch.Tensor) -> torch.Tensor:
        """The logit bias [..., V'] of Markov embeddings [..., r]."""
        return self.markov_head.markov_w2(embedding)


def speculators_files(heads: DSparkHeads, source: ExportSource) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """speculators' DSpark layout, which vLLM serves with `{"method": "dspark", "model": OUT,
    "num_speculative_tokens": num_heads}`: dflash's config and tensors (the anchor is the bonus token, the K mask
    slots predict: `sample_from_anchor` false), the Markov head's rank and tensors (markov_w2's rows in the draft
    vocabulary's order, as the LM head's), and the confidence head if the heads have one."""
    spec = heads.spec
    config = speculators_config(heads, source.verifier, source.architectures())
    config["speculators_config"]["algorithm"] = config["speculators_model_type"] = "dspark"
    config |= {"architectures": ["DSparkSpeculator"], "markov_rank": spec.markov_rank, "markov_head_type": "vanilla",
               "enable_confidence_head": spec.confidence_head, "confidence_head_with_markov": spec.confidence_head}
    tensors = speculators_source_tensors(heads, source)
    if spec.draft_vocab_size:  # the LM head's rows were put in target-id order: the Markov map's go with them
        order = torch.sort(heads.draft_ids.cpu()).indices
        tensors["markov_head.markov_w2.weight"] = tensors["markov_head.markov_w2.weight"][order].contiguous()
    return config, tensors


@register
class DSparkHeads(DFlashHeads):
    kind = "dspark"
    Options = DSparkOptions
    loss_defaults = {"distill_weight": 0.0, "tv_weight": 0.9, "ce_weight": 0.1}
    exports = {"speculators": Export("vLLM", speculators_files)}

    def make_draft(self, spec) -> DSparkDraft:
        return DSparkDraft(spec.layer_config, len(spec.aux_layers), spec.scored_vocab, spec.num_heads,
                           spec.mask_token_id, spec.vocab_size, spec.markov_rank, spec.confidence_head)

    @classmethod
    def check_options(cls, options: DSparkOptions) -> None:
        super().check_options(options)
        if options.markov_rank < 1:
            raise ConfigError(f"heads.markov_rank must be >= 1, got {options.markov_rank} (a block drafter without "
                              "the Markov head is heads.kind=dflash)")

    # -- training: the states carry the Markov embedding of each slot's previous token ----------------

    def with_markov(self, states: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[K, B, N, d + r]: the slots' states [K, B, N, d] of the blocks after `anchors` [B, N], each followed by the
        Markov embedding of the token before its guess (slot k+1 of the block after t: x_{t+1+k}, the anchor first)."""
        K, T = states.shape[0], input_ids.shape[1]
        at = anchors[None] + 1 + torch.arange(K, device=anchors.device).view(K, 1, 1)  # [K, B, N]
        prev = input_ids[None].expand(K, -1, -1).gather(2, at.clamp_max(T - 1))
        return torch.cat([states, self.dflash.markov(prev).to(states.dtype)], dim=-1)

    def forward(self, h, input_ids, embed=None):
        B, T = input_ids.shape
        return self.with_markov(super().forward(h, input_ids, embed), input_ids,
                                torch.arange(T, device=input_ids.device).expand(B, T))

    def training_states(self, h, input_ids, supervised, attention_mask, embed):
        states, positions, valid = super().training_states(h, input_ids, supervised, attention_mask, embed)
        if positions is None:  # a block after every position: `forward` gave the Markov columns already
            return states, None, None
        return self.with_markov(states, input_ids, positions), positions, valid

    def extra_scoring_weight(self) -> torch.Tensor:
        return self.dflash.markov_head.markov_w2.weight

    def logits(self, k, states, lm_head=None):
        d = self.spec.hidden_size
        return self.dflash.lm_head(states[..., :d]) + self.dflash.bias(states[..., d:])

    @property
    def has_confidence(self) -> bool:
        return self.dflash.confidence_head is not None

    def confidence(self, k, states):
        head = self.dflash.confidence_head
        return None if head is None else head.proj(states).squeeze(-1)

    # -- the engine -----------------------------------------------------------------------------------

    def drafting(self, embed, score, dtype):
        return DSparkDrafting(self, embed, score, dtype)


class DSparkDrafting(DFlashDrafting):
    """dflash's drafting (one forward over the block gives every depth's base logits), then the Markov bias of each
    node's own token: a level's candidates depend on their parent (`per_node`), as in vLLM's sequential sampling,
    where the chain's node at depth k is drafted from base logits k plus the bias of the token above it."""

    per_node = True

    def step(self, k, tokens, states):
        draft = self.heads.dflash
        return self._logits[k:k + 1] + draft.bias(draft.markov(tokens)).to(self._logits.dtype), None

    def confidence(self, tokens, parents, depth):
        if not self.heads.has_confidence:
            return None
        slot = (depth - 1).clamp_min(0)  # node at depth k: slot k's state and its parent's token
        states = torch.cat([self._states[slot], self.heads.dflash.markov(tokens[parents]).to(self._states.dtype)], -1)
        out = torch.sigmoid(self.heads.confidence(0, states).float())
        return out.masked_fill(depth == 0, float("nan"))
