"""Run by test_export.py with the `speculators` package's own Python: load a dflash export with speculators'
DFlashDraftModel and print, as one JSON line, its missing and unexpected keys, whether every saved tensor loaded as
saved, what its config says, and the logits of every block its training forward builds on the given inputs (an
anchor at every position the loss mask allows).

    python tests/speculators_dflash_check.py EXPORT_DIR INPUTS.pt
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

export, inputs = sys.argv[1], sys.argv[2]
config = DFlashSpeculatorConfig.from_pretrained(export)
config.transformer_layer_config._attn_implementation = "eager"  # the default (flex attention) needs a compiler
model = DFlashDraftModel.from_pretrained(export, config=config).eval()
saved = load_file(str(Path(export) / "model.safetensors"))
loaded = model.state_dict()
data = torch.load(inputs)
ids = data["input_ids"]
with torch.no_grad():
    _, logits, _, mask, anchors = model._backbone_forward(
        hidden_states=data["aux"], input_ids=ids, loss_mask=data["loss_mask"],
        verifier_last_hidden_states=torch.zeros(*ids.shape, config.transformer_layer_config.hidden_size),
        document_ids=torch.zeros_like(ids), max_anchors=ids.shape[1])
print(json.dumps({
    "missing": sorted(set(loaded) - set(saved)), "unexpected": sorted(set(saved) - set(loaded)),
    "as_saved": all(torch.equal(saved[k], loaded[k].to(saved[k].dtype)) for k in saved if k in loaded),
    "aux_layers": list(model.config.aux_hidden_state_layer_ids), "block_size": model.config.block_size,
    "mask_token_id": model.config.mask_token_id,
    "positions": anchors.view(-1, model.config.block_size)[:, 0].tolist(),  # each block's anchor position
    "trained": mask.view(-1, model.config.block_size).any(dim=1).tolist(),  # blocks that are anchors, not padding
    "logits": logits[0].view(-1, model.config.block_size, logits.shape[-1]).tolist(),
}))
