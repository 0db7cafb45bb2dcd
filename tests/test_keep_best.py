"""Checkpoints chosen by what they accept (issue 37): the tree-aware expected tau, the engine's real tau measured
during training, the best heads kept in best/ and ended with, and the bad inputs refused before any model loads."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from runs import ROOT, WORDS, config, read_jsonl
from safetensors.torch import load_file

from medusa_train.config import ConfigError
from medusa_train.train.evaluate import acceptance_from_hits, bootstrap_stderr, tree_taus
from medusa_train.train.trainer import train

TAU = ["eval.tau_every=4", "eval.tau_num_prompts=3", "eval.tau_max_new_tokens=12", "eval.tau_budget=4"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A tiny saved Llama + tokenizer and a small chat dataset (user turn, assistant reply)."""
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("keep_best")
    save_tiny(root / "model", "llama", initializer_range=0.05)  # peaked enough for heads to learn in a few steps
    rng = random.Random(0)
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(48):
            user = " ".join(rng.choice(WORDS) for _ in range(3))
            reply = " ".join(rng.choice(WORDS) for _ in range(6))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}}}\n"
        "heads: {num_heads: 3}\n"
        f"data: {{dataset: {root / 'chat.jsonl'}, format: chat, max_length: 96, eval_size: 8}}\n"
        "train: {batch_size: 4, lr: 1.0e-2, warmup_steps: 2, log_every: 4, seed: 0}\n"
        "loss: {distill_weight: 1.0, ce_weight: 0.5, chunk_size: 64}\n"
        "eval: {max_batches: 0}\n")
    return root


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def tau_run(ws):
    """14 steps (the data's epoch is 10 steps), real tau at 4, 8, 12 and 14 (the end), the best kept by it."""
    cfg = config(ws, "tau", "train.max_steps=14", "train.keep_best=tau", *TAU)
    return cfg, train(cfg)


def test_tree_expected_tau_is_the_engines_own():
    """The trainer's tree-aware expected tau is `inference.engine.tree`'s value for the same acceptance table: the
    best static tree's node set, scored by the engine's own expected_tau."""
    from inference.engine.tree import expected_tau, static_tree_search

    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(4, 11)
    hits[:, :10] = torch.randint(0, 50, (4, 10), generator=g).float()
    hits[:, 10] = hits[:, :10].sum(1) + torch.randint(0, 80, (4,), generator=g).float()
    acceptance = acceptance_from_hits(hits, budgets=[1, 4, 8, 64])
    acc = acceptance["topk_accuracy"]
    for b in (1, 4, 8, 64):
        engine = expected_tau(static_tree_search(acc, b), acc)
        assert acceptance["expected_tau_tree"][str(b)] == pytest.approx(engine, abs=1e-12)
        assert tree_taus(acc, [b])[b] == pytest.approx(engine, abs=1e-12)
    assert acceptance["expected_tau_curve"][8] == pytest.approx(acceptance["expected_tau_tree"]["8"])
    # a tree of one node per head is the chain; a wider tree accepts more
    assert acceptance["expected_tau_tree"]["1"] < acceptance["expected_tau_tree"]["64"]


def test_the_bootstrap_error_shrinks_as_sequences_grow_and_leaves_the_global_rng_alone():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.5, 0.2, 0.1])

    def seqs(n):
        hits = torch.zeros(n, 3, 11)
        hits[:, :, 10] = 20
        hits[:, :, 0] = torch.binomial(torch.full((n, 3), 20.0), p.expand(n, 3), generator=g)
        return hits

    state = torch.get_rng_state()
    small, large = bootstrap_stderr(seqs(10), [8]), bootstrap_stderr(seqs(640), [8])
    assert torch.equal(state, torch.get_rng_state())
    assert 0 < large["expected_tau_stderr"] < small["expected_tau_stderr"] / 4  # ~ 1/sqrt(64) = 1/8 of it
    assert 0 < large["expected_tau_tree_stderr"]["8"] < 0.02


def test_the_logged_real_tau_is_the_engines_on_the_best_checkpoint(ws, tau_run):
    """best/ holds the step with the highest logged real tau, and an engine run of best/ on the same prompts, with
    the same budget and tokens, measures exactly the logged tau; output_dir ends with those heads."""
    from transformers import AutoTokenizer

    from medusa_train.data.rows import build_datasets
    from medusa_train.train.tau import tau_prompt_ids

    cfg, result = tau_run
    out = Path(cfg.output_dir)
    rows = read_jsonl(out / "metrics.jsonl")
    taus = {r["step"]: r["eval/tau"] for r in rows if "eval/tau" in r}
    assert sorted(taus) == [4, 8, 12, 14]
    assert len(set(taus.values())) > 1, "the heads' tau never moved: the test cannot tell steps apart"
    best_step = max(taus, key=lambda s: (taus[s], -s))  # the highest, the earliest of ties
    record = json.loads((out / "best" / "best.json").read_text())
    assert record == {"metric": "tau", "step": best_step, "value": taus[best_step]}
    assert rows[-1]["best/step"] == best_step and rows[-1]["best/final"] is True
    assert json.loads((out / "best" / "config.json").read_text())["training"]["best_step"] == best_step
    assert json.loads((out / "config.json").read_text())["training"]["best_step"] == best_step
    assert same_weights(out, out / "best")
    assert best_step < 14 and not same_weights(out, out / "last")  # the last step's heads, kept beside
    assert json.loads((out / "last" / "acceptance.json").read_text())["step"] == 14
    assert json.loads((out / "acceptance.json").read_text())["topk_accuracy"] == \
        json.loads((out / "best" / "acceptance.json").read_text())["topk_accuracy"]

    tokenizer = AutoTokenizer.from_pretrained(ws / "model")
    _, eval_ds, _ = build_datasets(cfg, tokenizer)
    prompts = tau_prompt_ids(cfg, tokenizer, eval_ds)
    assert len(prompts) == 3 and all(p[-3:] == tokenizer("<|im_start|>assistant\n")["input_ids"][-3:] for p in prompts)
    assert engine_tau(ws, out / "best", prompts) == taus[best_step]


def engine_tau(ws: Path, heads_dir: Path, prompts: list[list[int]], budget: int = 4, tokens: int = 12) -> float:
    """What a user measures on a saved heads directory: the engine, heads alone, the budget pinned."""
    from transformers import AutoModelForCausalLM

    from inference import SpeculativeGenerator

    target = AutoModelForCausalLM.from_pretrained(ws / "model", dtype=torch.float32)
    gen = SpeculativeGenerator.from_pretrained(heads_dir, target=target, lookup_nodes=0)
    new = forwards = 0
    for ids in prompts:
        stats = gen.generate(ids, max_new_tokens=tokens, tree_budget=budget).stats
        new, forwards = new + stats.new_tokens, forwards + stats.target_forwards
    return new / forwards


@pytest.mark.parametrize("kind", ["parallel", "eagle3", "chained-draft-vocab", "chained-context"])
def test_every_kind_logs_the_engines_tau(ws, kind):
    """Every head kind, with and without a draft vocabulary: the final real tau is the engine's on the saved heads."""
    from transformers import AutoTokenizer

    from medusa_train.data.rows import build_datasets
    from medusa_train.train.tau import tau_prompt_ids

    heads = {"parallel": ["heads.kind=parallel"], "eagle3": ["heads.kind=eagle3"],
             "chained-draft-vocab": ["heads.draft_vocab_size=64"], "chained-context": ["heads.context_layers=1"]}[kind]
    cfg = config(ws, f"kind-{kind}", "train.max_steps=4", "train.keep_best=last", *heads, *TAU)
    train(cfg)
    out = Path(cfg.output_dir)
    logged = [r["eval/tau"] for r in read_jsonl(out / "metrics.jsonl") if "eval/tau" in r]
    assert len(logged) == 1  # step 4 is the last: measured once, by the final evaluation
    tokenizer = AutoTokenizer.from_pretrained(ws / "model")
    prompts = tau_prompt_ids(cfg, tokenizer, build_datasets(cfg, tokenizer)[1])
    assert engine_tau(ws, out, prompts) == logged[0]


def test_real_tau_leaves_training_as_it_was(ws, tau_run):
    """The same run without the real-tau evaluations ends with bit-identical heads (the real tau drafts with a copy
    of the heads, under a forked RNG) and leaves the global RNG where training alone leaves it."""
    cfg, _ = tau_run
    with_tau = config(ws, "tau-last", "train.max_steps=14", "train.keep_best=last", *TAU)
    without = config(ws, "no-tau", "train.max_steps=14", "train.keep_best=last")
    train(with_tau)
    rng_with = torch.get_rng_state()
    train(without)
    assert torch.equal(rng_with, torch.get_rng_state())  # what dropout or a data order would draw next
    rows = read_jsonl(Path(with_tau.output_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/tau" in r] == [4, 8, 12, 14]
    assert not (Path(with_tau.output_dir) / "best").exists()  # keep_best=last keeps no best/
    assert same_weights(Path(with_tau.output_dir), Path(without.output_dir))
    # and the tau run's last heads are these: its best/ differs only by the step it chose
    last = read_jsonl(Path(cfg.output_dir) / "metrics.jsonl")[-1]
    if last["best/step"] == 14:
        assert same_weights(Path(cfg.output_dir), Path(without.output_dir))


def test_keep_best_by_expected_tau_survives_a_stop_and_resume(ws, monkeypatch):
    """keep_best=expected_tau scores the held-out tree at eval.tau_budget; a run stopped by a signal at its
    step-8 checkpoint and resumed ends as the uninterrupted run ends: the same best step, value and heads."""
    import signal

    import medusa_train.train.trainer as trainer

    common = ["train.max_steps=16", "train.save_every=8", "eval.every=4", "train.keep_best=expected_tau",
              "eval.tau_budget=4"]
    cfg = config(ws, "xt", *common)
    train(cfg)
    out = Path(cfg.output_dir)
    rows = read_jsonl(out / "metrics.jsonl")
    scored = {r["step"]: r["eval/expected_tau@4"] for r in rows if "eval/expected_tau@4" in r}
    assert sorted(scored) == [4, 8, 12, 16]
    best = max(scored, key=lambda s: (scored[s], -s))
    assert json.loads((out / "best" / "best.json").read_text()) == {"metric": "expected_tau", "step": best,
                                                                    "value": scored[best]}
    assert same_weights(out, out / "best")

    save = trainer.save_checkpoint

    def save_then_stop(accelerator, cfg, position):
        path = save(accelerator, cfg, position)
        if position["step"] == 8:
            signal.raise_signal(signal.SIGTERM)  # as a scheduler would: the run stops after this checkpoint
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_stop)
    stopped = train(config(ws, "xt-resumed", *common))
    monkeypatch.undo()
    assert stopped.stopped and stopped.step == 8
    resumed = train(config(ws, "xt-resumed", *common))
    assert resumed.step == 16
    again = Path(resumed.output_dir)
    assert json.loads((again / "best" / "best.json").read_text()) == \
        json.loads((out / "best" / "best.json").read_text())
    assert same_weights(out, again) and same_weights(out / "best", again / "best")


def test_a_fresh_run_drops_an_older_runs_best(ws, tau_run):
    cfg, _ = tau_run
    out = ws / "fresh"
    shutil.copytree(Path(cfg.output_dir) / "best", out / "best")
    train(config(ws, "fresh", "train.max_steps=4", "eval.every=2", "train.keep_best=expected_tau",
                 "eval.tau_budget=4", "resume=none"))
    assert json.loads((out / "best" / "best.json").read_text())["step"] in (2, 4)


def test_bad_real_tau_inputs_exit_2_before_any_model_loads(ws, tmp_path, capsys):
    """The documented command, `python train.py RECIPE ...` (the first case; the others through the same entry point
    in this process, a launch's imports being most of its time): a missing prompts file, a budget < 1,
    keep_best=tau without real-tau runs: exit 2 with one line naming the key, and nothing loaded (no output directory
    made)."""
    import subprocess
    import sys

    from medusa_train.train.cli import main

    missing = f"eval.tau_prompts={tmp_path / 'missing.jsonl'}"
    cases = [(["eval.tau_every=5", missing], "eval.tau_prompts: file not found"),
             (["eval.tau_budget=0"], "eval.tau_budget must be >= 1"),
             (["eval.tree_budgets=[4,0]"], "eval.tree_budgets must be a list of draft-node budgets >= 1"),
             (["train.keep_best=tau"], "train.keep_best=tau needs real-tau measurements"),
             (["eval.tau_every=5", "target.attn_implementation=flash_attention_2"],
              "eval.tau_every runs our engine on the target, whose tree mask target.attn_implementation="
              "flash_attention_2 cannot take: set target.attn_implementation=sdpa")]
    for i, (overrides, message) in enumerate(cases):
        out = tmp_path / "out"
        argv = [str(ws / "base.yaml"), f"output_dir={out}", *overrides]
        if i == 0:
            proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], capture_output=True, text=True,
                                  env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
            code, err = proc.returncode, proc.stderr
        else:
            code, err = main(argv), capsys.readouterr().err
        assert code == 2, err[-2000:]
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    import medusa_train.train.run as run_setup

    empty = tmp_path / "no-prompts.jsonl"
    empty.write_text('{"score": 1}\n')
    with pytest.MonkeyPatch.context() as mp:  # a prompts file without prompts: refused before the model loads
        mp.setattr(run_setup, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
        with pytest.raises(ConfigError, match="no row holds a prompt"):
            train(config(ws, "x-empty", "eval.tau_every=4", f"eval.tau_prompts={empty}"))
        long = tmp_path / "long-prompts.jsonl"  # prompts, every one longer than the rows may be: said so
        long.write_text("".join(json.dumps({"prompt": " ".join(["word"] * n)}) + "\n" for n in (200, 300)))
        with pytest.raises(ConfigError, match=r"eval.tau_prompts=.*: all 2 prompts are dropped, each at least "
                                              r"data.max_length=96 tokens long .*raise data.max_length above"):
            train(config(ws, "x-long", "eval.tau_every=4", f"eval.tau_prompts={long}"))
    with pytest.raises(ConfigError, match="eval.tau_every needs prompts"):
        config(ws, "x", "eval.tau_every=4", "data.eval_size=0")
    with pytest.raises(ConfigError, match="with target.lora the target's adapter trains too"):
        config(ws, "x", "eval.tau_every=4", "train.keep_best=tau", "target.lora.r=4")
    from medusa_train.train.best import keep_best_metric
    assert keep_best_metric(config(ws, "x", "eval.tau_every=4", "target.lora.r=4"), True) == "last"
    assert keep_best_metric(config(ws, "x", "eval.tau_every=4"), True) == "tau"
    assert keep_best_metric(config(ws, "x", "eval.every=4"), True) == "expected_tau"
    assert keep_best_metric(config(ws, "x", "eval.every=4"), False) == "last"


@pytest.mark.timeout(300)  # two torchrun attempts (a rendezvous hang is retried once) and a 1-process run
def test_two_processes_measure_the_real_tau_once_and_keep_the_same_best(ws):
    """torchrun with 2 CPU processes (gloo): only the main process generates (the other waits at the barrier), both
    agree on the best step, and the run logs what a 1-process run with the same effective batch logs."""
    from runs import torchrun_train

    common = ["train.max_steps=8", "train.keep_best=tau", *TAU]
    two = ws / "ddp-tau"
    proc = torchrun_train([str(ws / "base.yaml"), "train.batch_size=4", *common], two, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = config(ws, "ga-tau", "train.batch_size=2", "train.grad_accum=2", *common)
    train(one)
    r1, r2 = read_jsonl(Path(one.output_dir) / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    tau1, tau2 = ({r["step"]: r["eval/tau"] for r in rows if "eval/tau" in r} for rows in (r1, r2))
    assert sorted(tau2) == [4, 8] and tau1 == tau2
    assert json.loads((two / "best" / "best.json").read_text()) == \
        json.loads((Path(one.output_dir) / "best" / "best.json").read_text())
    w1, w2 = weights(Path(one.output_dir)), weights(two)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1 if w1[k].numel()) <= 1e-5
