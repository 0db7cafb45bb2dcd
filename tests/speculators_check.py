"""Run by test_export.py with the `speculators` package's own Python: load an export with speculators'
Eagle3DraftModel and print, as one JSON line, its missing and unexpected keys, whether every saved tensor loaded
as saved, and the logits of each of its training-time-test steps on the given inputs.

    python tests/speculators_check.py EXPORT_DIR INPUTS.pt
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

export, inputs = sys.argv[1], sys.argv[2]
config = Eagle3SpeculatorConfig.from_pretrained(export)
config.transformer_layer_config._attn_implementation = "eager"  # the default (flex attention) needs a compiler
model = Eagle3DraftModel.from_pretrained(export, config=config).eval()
saved = load_file(str(Path(export) / "model.safetensors"))
loaded = model.state_dict()
data = torch.load(inputs)
logits = []
hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
with torch.no_grad():
    model(hidden_states=data["aux"], input_ids=data["input_ids"], document_ids=torch.zeros_like(data["input_ids"]),
          ttt_steps=data["steps"])
hook.remove()
print(json.dumps({
    "missing": sorted(set(loaded) - set(saved)), "unexpected": sorted(set(saved) - set(loaded)),
    "as_saved": all(torch.equal(saved[k], loaded[k].to(saved[k].dtype)) for k in saved if k in loaded),
    "aux_layers": list(model.config.eagle_aux_hidden_state_layer_ids),
    "norms": [n for n in ("norm_before_fc", "norm_before_residual", "norm_output") if getattr(model.config, n)],
    "logits": torch.stack(logits).tolist(),
}))
