"""Filling the hidden-state cache from vLLM (`python -m medusa_train.target.vllm_states`), the parts that need no vLLM:
the layers asked of vLLM and the conversion of what it returns (the aux layers and the last layer's output before the
final norm) into the cache's rows, checked against our own forward on several architectures (each names its final
norm differently); the CLI's one-line refusals. vLLM itself computes them in tests/test_vllm.py (`-m vllm`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from archs import tiny_model

from medusa_train.target.model import capture_layers, decoder, decoder_layers, target_hidden
from medusa_train.target.vllm_states import final_norm, rows_to_cache, vllm_layers

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2", "opt"])
@pytest.mark.parametrize("aux", [(), (0, 1, 2)])
def test_vllms_layers_become_the_rows_our_forward_writes(model_type, aux):
    model = tiny_model(model_type, dtype=torch.float32)
    L = len(decoder_layers(model))
    aux = tuple(a for a in aux if a <= L)
    ids = torch.randint(0, 250, (1, 11), generator=torch.Generator().manual_seed(0))
    layers = vllm_layers(aux, L)
    assert layers == sorted({*aux, L})
    with torch.no_grad(), capture_layers(model, layers) as got:  # what vLLM returns: [T, len(layers), d]
        decoder(model)(input_ids=ids, use_cache=False)
    states = torch.stack([s[0] for s in got], dim=1)
    row = rows_to_cache(states, layers, aux, L, final_norm(model), torch.float32)
    ours = target_hidden(model, ids, torch.ones_like(ids), aux)[0]
    assert row.shape == ours.shape
    torch.testing.assert_close(row, ours, rtol=1e-5, atol=1e-5)


def test_the_cli_refuses_bad_input_in_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a b c"}\n')
    (tmp_path / "r.yaml").write_text(f"target: {{model: some/model}}\ndata: {{dataset: {tmp_path / 'd.jsonl'}}}\n")
    base = [sys.executable, "-m", "medusa_train.target.vllm_states", str(tmp_path / "r.yaml")]
    proc = subprocess.run([*base, "--vllm-python", sys.executable], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: set train.hidden_cache_dir=DIR: the directory the states are written to (and training reads them "
        "from)"]
    proc = subprocess.run([*base, f"train.hidden_cache_dir={tmp_path / 'c'}", "--vllm-python", "/no/python"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --vllm-python /no/python: no such file")
