"""Joint (Medusa-2) training: peft LoRA adapters on the target train together with the heads.

    peft = add_lora(target, cfg.target.lora)          # the target with adapters (B = 0: still the original)
    objective = JointObjective(heads, peft, cfg.loss)
    loss, stats, lm_kl = objective(ids, labels, mask, embed, lm_head, joint=True)

One step: the adapted target's forward with grad gives h (and the eagle3 layers); the heads' loss reads it as in
frozen-target training, with the adapted target as teacher (what the heads will draft for), and its gradient
reaches the adapters through h. `loss.lm_weight` x KL(original || adapted) on the next token keeps the adapted
target's own predictions near the original's; the original's distribution comes from the same target's forward
with the adapters disabled, without grad. The embedding and the LM head stay the base's, shared with the heads.

During `train.heads_warmup_steps` (`joint=False`) the target runs without grad and the adapters get none, so those
steps cost what frozen-target steps cost and the adapters stay exactly still.

The objective registers the heads and the adapters' modules (the same module objects the peft model runs), never
the base model: Accelerate's DDP reduces the adapters' gradients with the heads', and checkpoints hold heads and
adapters only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from ..config import ConfigError, LoraSettings, LossConfig
from ..base.files import atomic_write_dir
from ..kinds.heads import DraftHeads
from .losses import IGNORE, FusedHeadLoss, chunked_head_losses, shift_left
from ..target.model import (LogitTransform, chunk_positions, decoder, greedy_tokens, hidden_with_layers,
                            logit_transform, output_signature, peft_quietly)

ADAPTER_DIR = "adapter"


def add_lora(target: nn.Module, settings: LoraSettings) -> nn.Module:
    """`target` (frozen) wrapped by peft with fresh LoRA adapters per `settings`: a PeftModel whose only trainable
    parameters are the adapters'. ConfigError in one line when peft cannot place them."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    modules = list(settings.target_modules) or None
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=modules, bias="none")
    try:
        with peft_quietly():
            peft_model = get_peft_model(target, config)
    except ValueError as e:
        first = " ".join(str(e).split())[:200]
        which = settings.target_modules or "(peft's default)"
        raise ConfigError(f"target.lora.target_modules={which}: peft cannot place adapters ({first}): name the "
                          "target's linear layers, e.g. [q_proj, v_proj]") from None
    model = peft_model.get_base_model()
    for what, module in (("embedding", model.get_input_embeddings()), ("LM head", model.get_output_embeddings())):
        if isinstance(module, LoraLayer):
            raise ConfigError(f"target.lora.target_modules={settings.target_modules} puts an adapter on the target's "
                              f"{what}, which the heads share frozen: leave it out of the list")
    peft_model.eval()  # the base's own dropout stays off; JointObjective.train turns the adapters' dropout on
    return peft_model


def adapter_modules(peft_model: nn.Module) -> nn.ModuleList:
    """Every LoRA layer's adapter modules (A, B and the adapters' dropout), as one ModuleList to register."""
    from peft.tuners.lora import LoraLayer

    return nn.ModuleList(nn.ModuleDict({"A": m.lora_A, "B": m.lora_B, "dropout": m.lora_dropout})
                         for m in peft_model.modules() if isinstance(m, LoraLayer))


def lm_kl(h: torch.Tensor, h_original: torch.Tensor, lm_head: nn.Module, valid: torch.Tensor, weight: float,
          chunk_size: int, transform: LogitTransform | None = None, token_sums: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight x mean KL(original || adapted) over `valid` positions (`token_sums`: the sum), with grad to h; the
    sum of that KL over them, detached; the adapted target's greedy token at every position [B, T]).

    h, h_original [B, T, d]: the adapted and the original target's final states. Chunked over positions: the
    [rows, V] logits of a chunk live inside one `FusedHeadLoss` call, which also gives the gradient to h.
    """
    B, T, d = h.shape
    w, bias = lm_head.weight, getattr(lm_head, "bias", None)
    flat, flat_o = h.reshape(-1, d).to(w.dtype), h_original.reshape(-1, d).to(w.dtype)
    if bias is not None:  # a biased LM head: one more input column that is always 1
        w = torch.cat([w, bias[:, None]], dim=1)
        flat, flat_o = (torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1) for x in (flat, flat_o))
    mask = valid.reshape(-1).float()
    pos_weight = mask if token_sums else mask / mask.sum().clamp_min(1)
    no_target = torch.zeros(flat.shape[0], dtype=torch.long, device=h.device)  # unused: no cross-entropy term
    rows = chunk_positions(chunk_size, 1, w.shape[0], h.device)
    loss = h.new_zeros((), dtype=torch.float32)
    kl_sum = torch.zeros((), device=h.device)
    greedy = []
    for a in range(0, flat.shape[0], rows):
        b = a + rows
        with torch.no_grad():  # the same matmul FusedHeadLoss makes, so that equal states give a KL of exactly 0
            z = (flat_o[a:b] @ w.t()).float()
            teacher = torch.log_softmax(z if transform is None or transform.identity else transform(z), dim=-1)
        part, kl, _, top5, *_ = FusedHeadLoss.apply(flat[a:b], w, teacher, no_target[a:b], pos_weight[a:b], weight, 0.0,
                                                transform)
        loss, kl_sum = loss + part, kl_sum + kl
        greedy.append(top5[:, 0])
    return loss, kl_sum, torch.cat(greedy).view(B, T)


def next_token_supervised(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: attended positions whose next token is supervised (where the target's own prediction is
    trained and scored)."""
    return mask.bool() & shift_left(labels != IGNORE, 1, False)


class JointObjective(nn.Module):
    """The trainable part of a joint step: the adapted target's forward, the heads and both losses. `train()` and
    `eval()` reach the heads and the adapters' dropout; the base model stays in eval mode (its own dropout off)."""

    def __init__(self, heads: DraftHeads, peft_model: nn.Module, cfg: LossConfig, token_sums: bool = False):
        super().__init__()
        self.heads = heads
        self.adapters = adapter_modules(peft_model)
        self.cfg = cfg
        self.token_sums = token_sums  # as HeadsObjective's
        self._peft = (peft_model,)  # a tuple: not registered, so neither DDP nor checkpoints see the base

    @property
    def peft(self) -> nn.Module:
        return self._peft[0]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor,
                embed: nn.Module, lm_head: nn.Module, joint: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, heads' stats [K, len(STATS)], the summed KL(original || adapted) and its position count [2]).
        `joint=False` (the heads' warm-up): the target runs without grad and the adapters stay out of the step."""
        model, d = self.peft.get_base_model(), self.heads.spec.hidden_size
        transform = logit_transform(model.config)
        kw = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        valid = next_token_supervised(labels, attention_mask)
        kl = torch.zeros(2, device=input_ids.device)
        kl[1] = valid.sum()
        with torch.set_grad_enabled(joint), record_function("joint: adapted forward"):
            h = hidden_with_layers(model, self.heads.target_layers, **kw)
        if joint and self.cfg.lm_weight > 0:
            with torch.no_grad(), self.peft.disable_adapter(), record_function("joint: original forward"):
                h_original = decoder(model)(**kw).last_hidden_state
            with record_function("joint: KL to the original"):
                lm_loss, kl[0], greedy = lm_kl(h[..., :d], h_original, lm_head, valid, self.cfg.lm_weight,
                                               self.cfg.chunk_size, transform, self.token_sums)
        else:  # the adapters have not moved (warm-up) or nothing holds the target to the original
            lm_loss, greedy = 0.0, greedy_tokens(lm_head, h[..., :d].detach())
        with record_function("joint: heads and their loss"):
            dtype = next(self.heads.parameters()).dtype
            states = self.heads(h.to(dtype), input_ids, embed)
            loss, stats = chunked_head_losses(self.heads, states, h[..., :d], greedy * attention_mask, input_ids,
                                              labels, attention_mask, lm_head, self.cfg, transform, self.token_sums)
        return loss + lm_loss, stats, kl.detach()


@torch.no_grad()
def held_out_lm_kl(peft_model: nn.Module, batches, max_batches: int, chunk_size: int, accelerator=None) -> float:
    """Mean KL(original || adapted) per supervised next-token position over held-out batches (adapters' dropout
    off): how far joint training moved the target."""
    model = peft_model.get_base_model()
    lm_head = model.get_output_embeddings()
    total = torch.zeros(2)
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        h = decoder(model)(**kw).last_hidden_state
        with peft_model.disable_adapter():
            h_original = decoder(model)(**kw).last_hidden_state
        valid = next_token_supervised(batch["labels"], batch["attention_mask"])
        _, kl, _ = lm_kl(h, h_original, lm_head, valid, 1.0, chunk_size, logit_transform(model.config))
        both = torch.stack([kl, valid.sum().float()])
        if accelerator is not None:
            both = accelerator.reduce(both, "sum")
        total += both.cpu()
    return float(total[0] / total[1].clamp_min(1))


def save_adapter(peft_model: nn.Module, out: Path) -> dict[str, Any]:
    """Write the adapters in peft's format to `out/adapter` (staged beside it, then renamed into place) and return
    what the heads' fingerprint records of them: the path, relative to the heads' directory, and the output
    signatures of the base and the adapted target (so that heads refuse the bare base)."""
    atomic_write_dir(out / ADAPTER_DIR, lambda staging: peft_model.save_pretrained(str(staging),
                                                                                save_embedding_layers=False))
    with peft_model.disable_adapter():
        base = output_signature(peft_model)
    return {"path": ADAPTER_DIR, "base_signature": base, "adapted_signature": output_signature(peft_model)}
