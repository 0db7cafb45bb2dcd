"""Run by test_export.py with the `speculators` package's own Python, once for every export it checks (speculators'
imports take most of a run): for each `KIND EXPORT_DIR INPUTS.pt` triple, load the export with speculators' own
draft model and report its missing and unexpected keys, whether every saved tensor loaded as saved, what its config
says, and its logits on the given inputs; prints one JSON line, a list of the reports in the order given.

    python tests/speculators_check.py eagle3 EXPORT_DIR INPUTS.pt [dflash EXPORT_DIR INPUTS.pt ...]

eagle3: the logits of each training-time-test step. dflash: those of every block its training forward builds (an
anchor at every position the loss mask allows). dspark: the same with its Markov bias, and its confidence logits.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def load(export: str, model_class, config_class):
    config = config_class.from_pretrained(export)
    config.transformer_layer_config._attn_implementation = "eager"  # the default (flex attention) needs a compiler
    model = model_class.from_pretrained(export, config=config).eval()
    saved, loaded = load_file(str(Path(export) / "model.safetensors")), model.state_dict()
    return model, {
        "missing": sorted(set(loaded) - set(saved)), "unexpected": sorted(set(saved) - set(loaded)),
        "as_saved": all(torch.equal(saved[k], loaded[k].to(saved[k].dtype)) for k in saved if k in loaded)}


def eagle3(export: str, data: dict) -> dict:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model, report = load(export, Eagle3DraftModel, Eagle3SpeculatorConfig)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    with torch.no_grad():
        model(hidden_states=data["aux"], input_ids=data["input_ids"],
              document_ids=torch.zeros_like(data["input_ids"]), ttt_steps=data["steps"])
    hook.remove()
    return report | {
        "aux_layers": list(model.config.eagle_aux_hidden_state_layer_ids),
        "norms": [n for n in ("norm_before_fc", "norm_before_residual", "norm_output") if getattr(model.config, n)],
        "logits": torch.stack(logits).tolist()}


def dflash(export: str, data: dict, model_class=None, config_class=None) -> dict:
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    model, report = load(export, model_class or DFlashDraftModel, config_class or DFlashSpeculatorConfig)
    ids, block = data["input_ids"], model.config.block_size
    with torch.no_grad():
        hidden, logits, _, mask, anchors = model._backbone_forward(
            hidden_states=data["aux"], input_ids=ids, loss_mask=data["loss_mask"],
            verifier_last_hidden_states=torch.zeros(*ids.shape, model.config.transformer_layer_config.hidden_size),
            document_ids=torch.zeros_like(ids), max_anchors=ids.shape[1])
    logits = logits[0].view(-1, block, logits.shape[-1])
    report |= {"aux_layers": list(model.config.aux_hidden_state_layer_ids), "block_size": block,
               "mask_token_id": model.config.mask_token_id,
               "positions": anchors.view(-1, block)[:, 0].tolist(),  # each block's anchor position
               "trained": mask.view(-1, block).any(dim=1).tolist()}  # blocks that are anchors, not padding
    if model_class is None:
        return report | {"logits": logits.tolist()}
    # dspark: its own forward's Markov bias (the anchor is the bonus token: slot i's previous token is the block's
    # token i-1) and confidence logits, as DSparkDraftModel.forward computes them
    c = model.config
    tokens = ids[0, anchors.view(-1)].view(-1, block)
    prev = torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)
    hidden = hidden.view(-1, block, hidden.shape[-1])
    with torch.no_grad():
        emb = model.markov_head.prev_embeddings(prev)
        logits = logits + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)
        confidence = model.confidence_head(torch.cat([hidden, emb], dim=-1))
    return report | {"logits": logits.tolist(), "confidence": confidence.tolist(),
                     "dspark": {k: getattr(c, k) for k in ("markov_rank", "markov_head_type", "sample_from_anchor",
                                                            "enable_confidence_head", "confidence_head_with_markov")}}


def dspark(export: str, data: dict) -> dict:
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    return dflash(export, data, DSparkDraftModel, DSparkSpeculatorConfig)


if __name__ == "__main__":
    args = sys.argv[1:]
    checks = {"eagle3": eagle3, "dflash": dflash, "dspark": dspark}
    print(json.dumps([checks[kind](export, torch.load(inputs))
                      for kind, export, inputs in zip(args[::3], args[1::3], args[2::3])]))
