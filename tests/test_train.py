"""The training loop on a tiny random Llama: what moves, what must not, resume, two processes, logs."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runs import ROOT, config, max_diff, read_jsonl, write_text_data
from safetensors.torch import load_file

from medusa_train.config import load_config
from medusa_train.kinds.heads import DraftHeads, HeadsMismatchError
from medusa_train.train.trainer import train




@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A tiny saved Llama + tokenizer and a small plain-text dataset."""
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("train")
    save_tiny(root / "model", "llama")
    write_text_data(root / "text.jsonl")  # ~55 rows of 24 tokens: 20 steps of 4 cross an epoch boundary
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}}}\n"
        "heads: {num_heads: 3}\n"
        f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24, eval_size: 4}}\n"
        "train: {batch_size: 4, lr: 3.0e-3, warmup_steps: 2, log_every: 5, seed: 0}\n"
        "loss: {distill_weight: 1.0, ce_weight: 0.5, chunk_size: 32}\n"
        "eval: {max_batches: 2}\n")
    return root


@pytest.fixture(scope="module")
def run20(ws: Path, tmp_path_factory):
    """The reference run: 20 steps, checkpoints at 10 and 20, eval at 10, W&B in offline mode; it ends with its last
    heads (keep_best=last), which the runs that resume or cache compare with (tests/test_keep_best.py: the best)."""
    env = {k: os.environ.pop(k) for k in ("WANDB_API_KEY", "WANDB_MODE") if k in os.environ}
    os.environ["WANDB_SILENT"] = "true"
    try:
        cfg = config(ws, "run20", "train.max_steps=20", "train.save_every=10", "eval.every=10",
                     "train.keep_best=last", "tracking.backend=wandb", "tracking.project=test")
        result = train(cfg)
    finally:
        os.environ.update(env)
        os.environ.pop("WANDB_SILENT", None)
    return cfg, result


def test_every_head_parameter_moves_and_the_target_stays_bit_identical(ws, run20):
    from transformers import AutoModelForCausalLM

    cfg, result = run20
    fresh = DraftHeads.for_target(result.target, "chained", 3)
    trained = dict(result.heads.named_parameters())
    for name, p0 in fresh.named_parameters():
        assert not torch.equal(p0, trained[name].detach().cpu()), f"head parameter {name} did not move"
    on_disk = AutoModelForCausalLM.from_pretrained(ws / "model", dtype=torch.float32).state_dict()
    after = result.target.state_dict()
    assert on_disk.keys() == after.keys()
    for name, w in on_disk.items():
        assert torch.equal(w, after[name]), f"target parameter {name} changed"
    assert not any(p.requires_grad for p in result.target.parameters())


def test_outputs_metrics_and_checkpoints(ws, run20):
    cfg, result = run20
    out = Path(cfg.output_dir)
    assert result.step == 20 and not result.stopped
    rows = read_jsonl(out / "metrics.jsonl")
    # the run's record opens with what training saw of the data: rows kept and dropped, and why
    assert rows[0]["step"] == 0 and rows[0]["data/dropped"] == 0 and rows[0]["data/drop_reasons"] == {}
    assert rows[0]["data/rows"] == 40 and rows[0]["data/eval_rows"] > 0  # blocks of packed text
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20]  # one row per log step
    for key in ("train/head1/top1_target", "train/head3/top5_data", "train/lr", "train/grad_norm",
                "train/tokens_per_s", "train/head2/kl", "train/head2/ce", "train/peak_memory_gib"):
        assert all(key in r for r in train_rows), key
    peaks = [r["train/peak_memory_gib"] for r in train_rows]  # this process's resident set on a CPU: a peak
    assert 0.05 < peaks[0] and peaks == sorted(peaks)
    assert [r["step"] for r in rows if "eval/expected_tau" in r] == [10, 20]  # eval.every and the final eval
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-10", "step-20"]
    assert json.loads((out / "checkpoints/step-10/trainer_state.json").read_text())["step"] == 10
    assert (out / "recipe.yaml").is_file() and load_config(out / "recipe.yaml").train.max_steps == 20

    acc = json.loads((out / "acceptance.json").read_text())
    assert len(acc["topk_accuracy"]) == 3 and all(len(r) == 10 for r in acc["topk_accuracy"])
    assert all(0 <= sum(r) <= 1 + 1e-9 for r in acc["topk_accuracy"])  # exact ranks are disjoint events
    p1 = [r[0] for r in acc["topk_accuracy"]]
    assert acc["expected_tau"] == pytest.approx(1 + p1[0] + p1[0] * p1[1] + p1[0] * p1[1] * p1[2])
    assert acc["positions"] > 0 and acc["split"] == "eval"


def wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline `run-*.wandb` file (a LevelDB-style log of protobuf Records:
    32 KiB blocks, each record chunk = crc32 (4) + length (2) + type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, rows, buf = 7, [], b""  # 7-byte file header: ident, magic, version
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf = (b"" if kind in (1, 2) else buf) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_metrics(run20):
    cfg, _ = run20
    runs = list((Path(cfg.output_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    history = wandb_history(next(runs[0].glob("run-*.wandb")))
    logged = [r for r in read_jsonl(Path(cfg.output_dir) / "metrics.jsonl") if "train/loss" in r]
    assert [r["_step"] for r in history] == [5, 10, 15, 20]
    assert [r["train/loss"] for r in history] == pytest.approx([r["train/loss"] for r in logged])
    assert [r["_step"] for r in history if "eval/expected_tau" in r] == [10, 20]
    assert all("train/head3/top5_target" in r and "train/lr" in r for r in history)
    # per-head, per-rank acceptance as a table at each evaluation; the expected tau of the best static tree per
    # budget against the step; at the end its curve against the budget, as a plot
    assert [r["_step"] for r in history if r.get("eval/acceptance/_type") == "table-file"] == [10, 20]
    assert [r["_step"] for r in history if "eval/expected_tau@8" in r] == [10, 20]
    assert [r["_step"] for r in history if r.get("eval/expected_tau_curve_table/_type") == "table-file"] == [20]
    files = runs[0] / "files"
    table = json.loads((files / history[-1]["eval/acceptance/path"]).read_text())
    acc = json.loads((Path(cfg.output_dir) / "acceptance.json").read_text())
    assert table["columns"] == ["head", "rank", "p", "cumulative"]
    assert [[h, r, p] for h, r, p, _ in table["data"]] == \
        [[k + 1, r + 1, p] for k, row in enumerate(acc["topk_accuracy"]) for r, p in enumerate(row)]
    curve = json.loads((files / history[-1]["eval/expected_tau_curve_table/path"]).read_text())
    assert [t for _, t in curve["data"]] == pytest.approx(acc["expected_tau_curve"])


def test_heads_round_trip_and_refuse_another_target(ws, run20):
    from tiny import tiny_model

    cfg, result = run20
    loaded = DraftHeads.from_pretrained(cfg.output_dir, target=result.target)
    for (name, a), b in zip(result.heads.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a.cpu(), b), name
    with pytest.raises(HeadsMismatchError, match="weights differ"):
        DraftHeads.from_pretrained(cfg.output_dir, target=tiny_model("llama", seed=1))
    with pytest.raises(HeadsMismatchError, match="hidden_size"):
        DraftHeads.from_pretrained(cfg.output_dir, target=tiny_model("llama", hidden=64))


def test_evaluate_cli_reproduces_the_held_out_acceptance_and_crops_replies(ws, run20, tmp_path, capsys):
    from medusa_train.train import evaluate as E
    from tiny import save_tiny

    cfg, _ = run20
    base = [str(ws / "base.yaml"), "--heads", str(cfg.output_dir)]
    # training's final evaluation: the held-out split, eval.max_batches (2) batches of 4
    assert E.main(base + ["--split", "eval", "--max-batches", "2", "--out", str(tmp_path / "eval.json")]) == 0
    got = json.loads((tmp_path / "eval.json").read_text())
    saved = json.loads((Path(cfg.output_dir) / "acceptance.json").read_text())
    assert got["positions_per_head"] == saved["positions_per_head"] and got["rows"] == 8
    assert got["expected_tau"] == pytest.approx(saved["expected_tau"])
    # the tree-aware expected tau, at the recipe's budgets, as the trainer measured it
    assert got["expected_tau_tree"].keys() == {"4", "8", "64"}
    assert got["expected_tau_tree"] == pytest.approx({b: saved["expected_tau_tree"][b] for b in ("4", "8", "64")})
    printed = capsys.readouterr().out
    assert f"{saved['expected_tau']:.3f}" in printed
    tree8 = saved["expected_tau_tree"]["8"]
    assert f"best static tree of 8 draft nodes (the engine's tree search): {tree8:.3f}" in printed

    assert E.main(base + ["--out", str(tmp_path / "all.json"), "eval.tau_every=5"]) == 0  # as every recipe has it
    assert E.main(base + ["--max-reply-tokens", "6", "--out", str(tmp_path / "crop.json")]) == 0
    full, crop = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("all", "crop"))
    assert full["rows"] == crop["rows"] > got["rows"]  # every row, not the held-out split
    # head 1 at position t scores the target's token at t+2: 6 supervised tokens leave at most 4 per row
    assert 0 < crop["positions"] <= 4 * crop["rows"] < full["positions"]

    row = {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [-100, -100, 3, 4, 5, 6]}
    assert E.crop_replies(row, 2) == {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}
    assert E.crop_replies(row, 9) == row

    capsys.readouterr()
    assert E.main([str(ws / "base.yaml"), "--heads", str(tmp_path / "missing")]) == 2
    assert "--heads: no such directory" in capsys.readouterr().err
    save_tiny(tmp_path / "other", "llama", seed=1)
    assert E.main(base + [f"target.model={tmp_path / 'other'}"]) == 2
    assert "weights differ" in capsys.readouterr().err


def test_resume_from_step_10_ends_where_the_uninterrupted_run_ends(ws, run20):
    cfg, _ = run20
    out = ws / "resumed"
    shutil.copytree(Path(cfg.output_dir) / "checkpoints" / "step-10", out / "checkpoints" / "step-10")
    result = train(config(ws, "resumed", "train.max_steps=20", "train.save_every=10", "eval.every=10",
                          "train.keep_best=last"))
    assert result.step == 20
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r] == [15, 20]
    assert [r["train/epoch"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r][-1] >= 1
    assert max_diff(Path(cfg.output_dir), out) <= 1e-6


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_matches(ws, run20):
    """Kill a real `train.py` process mid-run; it checkpoints and exits 75 (stopped, not finished: a scheduler
    requeues it); resuming finishes the same run."""
    cfg, _ = run20
    out = ws / "killed"
    args = [sys.executable, str(ROOT / "train.py"), str(ws / "base.yaml"), f"output_dir={out}",
            "train.max_steps=20", "train.log_every=1"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = out / "metrics.jsonl"
        while proc.poll() is None and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, log
    steps = [int(p.name[5:]) for p in (out / "checkpoints").glob("step-*")]
    assert len(steps) == 1 and 2 <= steps[0] < 20, log
    assert "received SIGTERM" in log and not (out / "model.safetensors").exists()
    result = train(config(ws, "killed", "train.max_steps=20"))
    assert result.step == 20
    assert max_diff(Path(cfg.output_dir), out) <= 1e-6


def test_eagle3_heads_train_through_the_same_loop_and_cache_their_layers(ws, tmp_path, monkeypatch):
    """heads.kind=eagle3 through the ordinary trainer: every head parameter moves, the target stays bit-identical,
    the hidden-state cache keeps h with the aux layers (and changes nothing), a cache of other layers is refused, and
    the saved heads record the layers and reload."""
    from medusa_train.config import ConfigError

    from transformers import AutoModelForCausalLM

    plain = train(config(ws, "e3-plain", "train.max_steps=12", "heads.kind=eagle3", "heads.draft_vocab_size=64"))
    fresh = DraftHeads.for_target(plain.target, "eagle3", 3)
    trained = dict(plain.heads.named_parameters())
    for name, p0 in fresh.named_parameters():
        assert not torch.equal(p0, trained[name].detach().cpu()), f"eagle3 parameter {name} did not move"
    on_disk = AutoModelForCausalLM.from_pretrained(ws / "model", dtype=torch.float32).state_dict()
    assert all(torch.equal(w, plain.target.state_dict()[k]) for k, w in on_disk.items())
    spec = json.loads((ws / "e3-plain" / "config.json").read_text())
    assert spec["kind"] == "eagle3" and spec["aux_layers"] == [1, 2] and spec["layer_config"]["model_type"] == "llama"
    assert DraftHeads.from_pretrained(ws / "e3-plain", target=plain.target).spec.aux_layers == [1, 2]

    cache_dir = tmp_path / "h"
    cached = train(config(ws, "e3-cached", "train.max_steps=12", "heads.kind=eagle3", "heads.draft_vocab_size=64",
                          f"train.hidden_cache_dir={cache_dir}"))
    assert cached.step == 12 and max_diff(ws / "e3-plain", ws / "e3-cached") <= 1e-6
    assert json.loads((cache_dir / "meta.json").read_text())["layers"] == [1, 2]
    from medusa_train.target.states import read_shard

    rows = read_shard(sorted(cache_dir.glob("shard-*.pt"))[0])
    assert {v.shape[-1] for v in rows.values()} == {3 * 32}  # h, then the two aux layers
    with pytest.raises(ConfigError, match=r"holds the target's states at layers \[1, 2\], but these heads read none"):
        train(config(ws, "e3-chained", "train.max_steps=2", f"train.hidden_cache_dir={cache_dir}"))
    with pytest.raises(ConfigError, match="heads.aux_layers=\\[1, 5\\]: the target has 2 layers"):
        train(config(ws, "e3-bad", "heads.kind=eagle3", "heads.aux_layers=[1,5]"))


def test_loss_falls_by_a_large_factor_on_one_repeated_batch(ws):
    # one short document -> two rows of <= 24 tokens -> every step sees the same batch of 2
    (ws / "one.jsonl").write_text(json.dumps({"text": "the cat sat on the mat and the dog ran"}) + "\n")
    cfg = config(ws, "overfit", f"data.dataset={ws / 'one.jsonl'}", "data.eval_size=0", "train.batch_size=2",
                 "train.max_steps=60", "train.lr=3.0e-2", "train.warmup_steps=0", "train.min_lr_ratio=1.0",
                 "train.log_every=1", "loss.distill_weight=0", "loss.ce_weight=1.0", "heads.own_lm_head=true")
    train(cfg)
    rows = [r for r in read_jsonl(ws / "overfit" / "metrics.jsonl") if "train/loss" in r]
    tokens = [r["train/tokens"] for r in rows]
    assert len(rows) == 60 and all(b - a == tokens[0] for a, b in zip(tokens, tokens[1:]))
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] / 10


def test_a_token_weighs_the_same_whatever_its_rows_length_and_micro_batch(ws):
    """Rows of several lengths grouped by length (data.group_by_length), a step of 4 rows taken as one forward of 4 or
    two of 2 (grad_accum 2: a micro-batch of long rows and one of short rows, at some steps): every supervised
    position of a step weighs the same, so both end with the same heads. (Each forward averaging over its own
    positions gave a short row's token more weight than a long row's.)"""
    from medusa_train.data.rows import build_datasets
    from medusa_train.target.model import load_tokenizer

    from runs import WORDS

    rng = random.Random(5)
    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    with open(ws / "ragged.jsonl", "w") as f:  # chats with replies of 1 to 20 words: rows of many lengths
        for _ in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": words(rng.randint(1, 4))},
                                             {"role": "assistant", "content": words(rng.randint(1, 20))}]}) + "\n")
    common = ["train.max_steps=8", "data.group_by_length=true", "eval.every=0", "train.keep_best=last",
              f"data.dataset={ws / 'ragged.jsonl'}", "data.format=chat", "data.max_length=48"]
    cfg = config(ws, "tw-split", "train.batch_size=2", "train.grad_accum=2", *common)
    lengths = {len(r) for r in build_datasets(cfg, load_tokenizer(cfg.target))[0]["input_ids"]}
    assert len(lengths) > 4  # rows of several lengths
    train(cfg)
    train(config(ws, "tw-whole", "train.batch_size=4", "train.grad_accum=1", *common))
    assert max_diff(ws / "tw-split", ws / "tw-whole") <= 1e-5


def test_warmup_cosine_schedule():
    from medusa_train.train.optim import warmup_cosine

    lr = [warmup_cosine(s, warmup_steps=2, total_steps=10, min_lr_ratio=0.1) for s in range(11)]
    assert lr[:2] == [0.5, 1.0] and lr[2] == 1.0
    assert lr[10] == pytest.approx(0.1) and all(a >= b for a, b in zip(lr[2:], lr[3:]))
    assert lr[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_warmup_steps_reads_a_fraction_below_one_as_that_share_of_the_run(ws):
    """train.warmup_steps 0.1 over 50 steps warms up over 5, as 5 does; 1.5 (neither a count nor a fraction) is
    refused naming the key."""
    from medusa_train.base.errors import ConfigError
    from medusa_train.train.optim import build_optimizer

    heads = torch.nn.Linear(4, 4)
    for warmup in ("0.1", "5"):
        optimizer, scheduler = build_optimizer(config(ws, "warm", f"train.warmup_steps={warmup}", "train.lr=1.0",
                                                      "train.optimizer=adamw"), heads, None, total_steps=50)
        lrs = []
        for _ in range(7):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0]) and lrs[5] == 1.0 and lrs[6] < 1.0, (warmup, lrs)
    with pytest.raises(ConfigError, match="train.warmup_steps must be a whole count of steps or a fraction"):
        config(ws, "warm", "train.warmup_steps=1.5")


def test_a_recipe_silent_on_the_lr_trains_chained_heads_at_their_width_rule(ws):
    """`train.py` with no train.lr and no warm-up in the recipe: the chained heads' optimizer runs at 3 / the
    target's hidden size after a 10% warm-up (the lr logged at step 5 of 20 is the schedule's there), and recipe.yaml
    records the lr resolved; the run resumes from its checkpoint (the lr is resolved before the resume check)."""
    import yaml
    from transformers import AutoConfig

    from medusa_train.train.cli import main
    from medusa_train.train.optim import warmup_cosine

    silent = ws / "silent.yaml"
    silent.write_text((ws / "base.yaml").read_text().replace("lr: 3.0e-3, warmup_steps: 2, ", ""))
    out = ws / "silent-lr"
    args = [str(silent), f"output_dir={out}", "train.max_steps=20", "train.save_every=10", "eval.every=0",
            "tracking.backend=none"]
    assert main(args) == 0
    peak = 3 / AutoConfig.from_pretrained(ws / "model").hidden_size
    logged = {row["step"]: row["train/lr"] for row in read_jsonl(out / "metrics.jsonl") if "train/lr" in row}
    assert logged[5] == pytest.approx(peak * warmup_cosine(5, warmup_steps=2, total_steps=20, min_lr_ratio=0.1))
    recorded = yaml.safe_load((out / "recipe.yaml").read_text())["train"]
    assert (recorded["lr"], recorded["warmup_steps"]) == (pytest.approx(peak), 0.1)
    assert main([*args, f"resume={out / 'checkpoints' / 'step-10'}"]) == 0


def naive_loss(heads, target, ids, labels, mask, cfg) -> torch.Tensor:
    """The loss written position by position, straight from the definition, full logits, no chunks."""
    from medusa_train.target.model import target_hidden

    h = target_hidden(target, ids, mask)
    states = heads(h, ids, target.get_input_embeddings())
    lm_head = target.get_output_embeddings()
    teacher = lm_head(h).float()
    K, B, T, _ = states.shape
    total = 0.0
    for k in range(K):
        head_sum, n = 0.0, 0
        for b in range(B):
            for t in range(T - 2 - k):
                u = t + 2 + k  # the token head k (0-based) guesses at position t
                if labels[b, u] == -100 or not mask[b, u] or not mask[b, t]:
                    continue
                logq = torch.log_softmax(heads.logits(k, states[k, b, t], lm_head).float(), -1)
                p_logits = teacher[b, t + 1 + k]
                logp = torch.log_softmax(p_logits[heads.draft_ids] if heads.spec.draft_vocab_size else p_logits, -1)
                kl = (logp.exp() * (logp - logq)).sum()
                if heads.spec.draft_vocab_size:
                    where = (heads.draft_ids == ids[b, u]).nonzero()
                else:
                    where = ids[b, u].view(1, 1)
                ce = -logq[where[0, 0]] if len(where) else 0.0  # tokens outside a draft vocab are skipped
                head_sum, n = head_sum + cfg.distill_weight * kl + cfg.ce_weight * ce, n + 1
        total = total + cfg.decay ** k * head_sum / max(n, 1)
    return total


@pytest.mark.parametrize("kind, draft, own", [("chained", False, False), ("parallel", False, False),
                                              ("chained", True, False), ("chained", True, True)])
def test_chunked_fused_loss_equals_the_definition(kind, draft, own):
    """Any chunk size gives the loss and gradients of the position-by-position definition."""
    from tiny import tiny_model

    from medusa_train.config import LossConfig
    from medusa_train.train.losses import HeadsObjective

    torch.manual_seed(0)
    target = tiny_model("llama")
    heads = DraftHeads.for_target(target, kind, 3, own_lm_head=own, own_embed=own,
                                  draft_ids=torch.randperm(260)[:50].sort().values if draft else None)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 260, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 7:] = -100
    cfg = LossConfig(distill_weight=1.0, ce_weight=0.5, decay=0.8)
    ref = naive_loss(heads, target, ids, labels, mask, cfg)
    ref_grads = torch.autograd.grad(ref, list(heads.parameters()))
    from medusa_train.target.states import TargetStates

    h, greedy = TargetStates(target, target.get_output_embeddings())({"input_ids": ids, "attention_mask": mask})
    ref_stats = None
    for chunk in (1, 4, 1000):
        cfg.chunk_size = chunk
        loss, stats = HeadsObjective(heads, cfg)(h, greedy, ids, labels, mask, target.get_input_embeddings(),
                                                  target.get_output_embeddings())
        grads = torch.autograd.grad(loss, list(heads.parameters()))
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
        assert all(torch.allclose(g, r, atol=1e-7, rtol=1e-4) for g, r in zip(grads, ref_grads))
        assert stats[:, 0].tolist() == [11, 10, 8]  # supervised positions per head
        ref_stats = stats if ref_stats is None else ref_stats
        assert torch.allclose(stats, ref_stats, rtol=1e-4, atol=1e-6)


def test_cpu_chunks_stay_under_the_mmap_threshold():
    """On a CPU a chunk's [rows, vocab] fp32 tensors stay under CPU_CHUNK_BYTES (larger ones are fresh mmaps
    that page-fault on every use); on other devices the configured chunk size holds."""
    from medusa_train.target.model import CPU_CHUNK_BYTES, chunk_positions

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for vocab in (260, 8192, 49152, 152064):
        rows = 4 * chunk_positions(1024, 4, vocab, cpu)
        assert rows * vocab * 4 <= CPU_CHUNK_BYTES and rows >= 4
    assert chunk_positions(1024, 4, 260, cpu) == 256  # small vocabularies keep the configured size
    assert chunk_positions(1024, 4, 152064, cuda) == 256
    assert chunk_positions(1024, 4096, 152064, cpu) == 1  # never less than one position


def spy_training_forwards(monkeypatch) -> list[tuple[torch.dtype, int]]:
    """(dtype, rows) of every target forward a training step makes; held-out evaluation's own are not counted."""
    import medusa_train.target.states as target_states
    import medusa_train.train.trainer as trainer

    calls: list[tuple[torch.dtype, int]] = []
    in_eval = [False]
    real_forward, real_eval = target_states.target_hidden, trainer.evaluate_heads

    def forward(model, ids, *a, **k):
        if not in_eval[0]:
            calls.append((next(model.parameters()).dtype, ids.shape[0]))
        return real_forward(model, ids, *a, **k)

    def evaluate_heads(*a, **k):
        in_eval[0] = True
        try:
            return real_eval(*a, **k)
        finally:
            in_eval[0] = False

    monkeypatch.setattr(target_states, "target_hidden", forward)
    monkeypatch.setattr(trainer, "evaluate_heads", evaluate_heads)
    return calls


def test_cached_hidden_states_give_the_same_heads(ws, run20, monkeypatch):
    """train.cache_hidden reuses the frozen target's h from the first epoch; nothing else may change."""
    cfg, _ = run20
    calls = spy_training_forwards(monkeypatch)
    result = train(config(ws, "cached", "train.max_steps=20", "train.save_every=10", "eval.every=10",
                          "train.keep_best=last", "train.cache_hidden=true"))
    assert result.step == 20
    assert [r["train/epoch"] for r in read_jsonl(ws / "cached" / "metrics.jsonl") if "train/loss" in r][-1] >= 1
    assert max_diff(Path(cfg.output_dir), ws / "cached") <= 1e-6
    # without the cache every one of the 20 micro-steps runs the target; with it only the first epoch's do
    assert 0 < len(calls) < 20


def test_hidden_cache_dir_is_shared_across_runs(ws, run20, monkeypatch, tmp_path):
    """train.hidden_cache_dir: the first run writes h per row; a second run (other head kind) trains from it
    without one target forward and gets the heads a run without any cache gets; another target is refused."""
    from medusa_train.config import ConfigError

    cfg, _ = run20
    cache_dir = tmp_path / "h"
    first = train(config(ws, "disk1", "train.max_steps=20", f"train.hidden_cache_dir={cache_dir}"))
    assert first.step == 20
    assert max_diff(Path(cfg.output_dir), ws / "disk1") <= 1e-6  # the cache changes nothing
    shards = sorted(cache_dir.glob("shard-*.pt"))
    assert shards and not list(cache_dir.glob("*.tmp"))

    calls = spy_training_forwards(monkeypatch)
    train(config(ws, "disk2-nocache", "train.max_steps=8", "heads.kind=parallel"))
    n_plain = len(calls)
    calls.clear()
    train(config(ws, "disk2", "train.max_steps=8", "heads.kind=parallel", f"train.hidden_cache_dir={cache_dir}"))
    assert n_plain >= 8 and calls == []  # every training row came from the first run's shards
    assert max_diff(ws / "disk2-nocache", ws / "disk2") <= 1e-6
    assert sorted(cache_dir.glob("shard-*.pt")) == shards  # nothing new to write

    meta = cache_dir / "meta.json"
    meta.write_text(json.dumps({"target_fingerprint": {"vocab_size": -1}}))
    with pytest.raises(ConfigError, match="hidden_cache_dir.*another target"):
        train(config(ws, "disk3", "train.max_steps=2", f"train.hidden_cache_dir={cache_dir}"))


def test_forward_dtype_runs_the_target_forward_in_bf16_and_keeps_heads_in_fp32(ws, run20, monkeypatch, tmp_path):
    """target.forward_dtype=bfloat16: h comes from a bf16 copy of the target, the heads and the loss stay
    float32, the heads still learn (close to the float32 run), and a hidden cache of another dtype is refused."""
    from medusa_train.config import ConfigError

    cfg, _ = run20
    calls = spy_training_forwards(monkeypatch)
    cache_dir = tmp_path / "h16"
    result = train(config(ws, "bf16fwd", "train.max_steps=20", "target.forward_dtype=bfloat16",
                          f"train.hidden_cache_dir={cache_dir}"))
    assert calls and {dtype for dtype, _ in calls} == {torch.bfloat16}
    assert {p.dtype for p in result.heads.parameters()} == {torch.float32}
    assert next(result.target.parameters()).dtype == torch.float32
    assert json.loads((cache_dir / "meta.json").read_text())["dtype"] == "bfloat16"
    # same data, steps and seed as the float32 run: the heads differ by bf16 rounding of h only
    drift = max_diff(Path(cfg.output_dir), ws / "bf16fwd")
    moved = max(w.abs().max().item() for w in load_file(str(Path(cfg.output_dir) / "model.safetensors")).values()
                if w.is_floating_point() and w.numel())
    assert 0 < drift < 0.2 * moved  # bf16 rounding of h, not different data
    logged = [r for r in read_jsonl(ws / "bf16fwd" / "metrics.jsonl") if "train/loss" in r]
    assert logged[-1]["train/loss"] < logged[0]["train/loss"]

    with pytest.raises(ConfigError, match="forward_dtype=bfloat16"):
        train(config(ws, "bf16fwd-2", "train.max_steps=2", f"train.hidden_cache_dir={cache_dir}"))
    # the same target loaded in bf16 is the same target: it trains from those rows without a forward
    calls.clear()
    train(config(ws, "bf16-all", "train.max_steps=4", "target.dtype=bfloat16", f"train.hidden_cache_dir={cache_dir}"))
    assert calls == []


def test_init_from_starts_from_trained_heads(ws, run20):
    """heads.init_from: training starts from those heads (same weights, same draft vocabulary) and records
    where it started; a recipe whose heads.* keys differ from the heads, or a path that is not a heads
    directory, is refused with the key named."""
    from medusa_train.config import ConfigError

    cfg, _ = run20
    src = Path(cfg.output_dir)
    fresh_first = [r for r in read_jsonl(src / "metrics.jsonl") if "train/loss" in r][0]["train/loss"]
    warm = train(config(ws, "warm", "train.max_steps=5", "train.lr=1.0e-9", f"heads.init_from={src}"))
    assert warm.step == 5 and max_diff(src, ws / "warm") < 1e-5  # a vanishing lr: still the heads it started from
    first = [r for r in read_jsonl(ws / "warm" / "metrics.jsonl") if "train/loss" in r][0]["train/loss"]
    assert first < fresh_first  # it starts where run20 ended, not from scratch
    spec = json.loads((ws / "warm" / "config.json").read_text())
    assert spec["training"]["init_from"] == str(src)

    with pytest.raises(ConfigError, match="heads.kind='parallel' but those heads have 'chained'"):
        train(config(ws, "warm-bad", "train.max_steps=1", "heads.kind=parallel", f"heads.init_from={src}"))
    with pytest.raises(ConfigError, match="heads.init_from=.* is not a heads directory"):
        config(ws, "warm-bad2", "train.max_steps=1", f"heads.init_from={ws / 'no-such-heads'}")
    with pytest.raises(ConfigError, match="not a draft heads config.*model directory"):  # the target's own dir
        train(config(ws, "warm-bad3", "train.max_steps=1", f"heads.init_from={ws / 'model'}"))


def test_hidden_cache_runs_the_target_on_new_rows_only(ws, run20, monkeypatch, tmp_path):
    """Data grown after a cached run: a batch that mixes cached and new rows runs the target on the new rows
    only, and the heads are those of a run without any cache."""
    from medusa_train.target.states import read_shard

    cache_dir = tmp_path / "h"
    # 3 batches of 2: the first 6 rows of the data order, so the next run's second batch of 4 is half cached
    train(config(ws, "part", "train.max_steps=3", "train.batch_size=2", f"train.hidden_cache_dir={cache_dir}"))
    before = set(cache_dir.glob("shard-*.pt"))
    calls = spy_training_forwards(monkeypatch)
    train(config(ws, "grown", "train.max_steps=10", f"train.hidden_cache_dir={cache_dir}"))  # one epoch
    forwarded = [rows for _, rows in calls]
    monkeypatch.undo()
    new_rows = sum(len(read_shard(p)) for p in set(cache_dir.glob("shard-*.pt")) - before)
    assert 0 < sum(forwarded) == new_rows < 40  # each new row once; the 40 rows minus those cached before
    assert any(0 < n < 4 for n in forwarded), forwarded  # mixed batches ran the target on their new rows only
    train(config(ws, "grown-nocache", "train.max_steps=10"))
    assert max_diff(ws / "grown", ws / "grown-nocache") <= 1e-6


def test_weight_decay_shrinks_matrices_and_leaves_biases_and_norm_scales():
    from medusa_train.kinds.heads import make_spec
    from medusa_train.train.optim import param_groups

    heads = DraftHeads(make_spec(kind="chained", num_heads=2, hidden_size=64, vocab_size=100, context_layers=1))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(1.0)  # zero-initialised weights would not show decay
    before = {n: p.detach().clone() for n, p in heads.named_parameters()}
    lr, wd = 0.1, 0.5
    opt = torch.optim.AdamW(param_groups(heads, wd), lr=lr)
    for p in heads.parameters():
        p.grad = torch.zeros_like(p)  # Adam's own update is 0: only the decay moves anything
    opt.step()
    one_d = [n for n, p in heads.named_parameters() if p.ndim == 1]
    assert any(n.endswith("norm.weight") for n in one_d) and any(n.endswith("bias") for n in one_d)
    for n, p in heads.named_parameters():
        factor = 1.0 if p.ndim == 1 else 1 - lr * wd
        torch.testing.assert_close(p.detach(), before[n] * factor, msg=n)
    # no decay: one group of every parameter, the layout of checkpoints written before the split
    groups = param_groups(heads, 0.0)
    assert len(groups) == 1 and len(groups[0]["params"]) == len(list(heads.parameters()))


def test_the_optimizer_sees_gradients_clipped_to_max_grad_norm(ws, monkeypatch):
    """With train.max_grad_norm the optimizer steps on gradients of total norm at most that; with 0 (no clipping)
    on the raw ones, which here are larger, so the bound is not met by accident. The logged grad_norm is the
    norm before clipping."""
    norms: list[float] = []
    real = torch.optim.AdamW.step

    def step(self, *a, **k):
        grads = [p.grad.detach().flatten() for g in self.param_groups for p in g["params"] if p.grad is not None]
        norms.append(float(torch.cat(grads).norm()))
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    train(config(ws, "clip", "train.max_steps=4", "train.max_grad_norm=0.01", "eval.every=0"))
    clipped, norms[:] = norms[:], []
    train(config(ws, "no-clip", "train.max_steps=4", "train.max_grad_norm=0", "eval.every=0"))
    assert len(clipped) == len(norms) == 4
    assert max(clipped) <= 0.01 * (1 + 1e-4) and min(norms) > 0.05
    logged = [r["train/grad_norm"] for r in read_jsonl(ws / "clip" / "metrics.jsonl") if "train/grad_norm" in r]
    assert logged and min(logged) > 0.05


def nan_on_calls(monkeypatch, bad: set[int]) -> list[int]:
    """Make the training objective return a NaN loss on the given calls (0-based); returns the call counter."""
    from medusa_train.train.losses import HeadsObjective

    calls = [0]
    real = HeadsObjective.forward

    def forward(self, *a, **k):
        loss, stats = real(self, *a, **k)
        calls[0] += 1
        return (loss * float("nan"), stats) if calls[0] - 1 in bad else (loss, stats)

    monkeypatch.setattr(HeadsObjective, "forward", forward)
    return calls


def test_a_step_with_a_non_finite_gradient_is_skipped_and_counted(ws, monkeypatch):
    """A NaN loss makes a NaN gradient: that optimizer step changes nothing and is counted; training goes on and
    the saved heads are finite."""
    nan_on_calls(monkeypatch, {2, 3})
    result = train(config(ws, "skip", "train.max_steps=8", "eval.every=0", "train.log_every=1"))
    assert result.step == 8
    rows = [r for r in read_jsonl(ws / "skip" / "metrics.jsonl") if "train/loss" in r]
    assert [r["train/skipped_steps"] for r in rows] == [0, 0, 1, 2, 2, 2, 2, 2]
    assert math.isnan(rows[2]["train/grad_norm"]) and math.isfinite(rows[4]["train/loss"])
    weights = load_file(str(ws / "skip" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


def test_a_diverging_run_stops_with_exit_1_and_keeps_its_last_checkpoint(ws, monkeypatch, capsys):
    """Non-finite gradients from step 5 on: after train.max_nonfinite_steps of them the run stops with one line
    and exit code 1, without saving heads or a checkpoint over the last good one (step 4)."""
    from medusa_train.train.cli import main

    nan_on_calls(monkeypatch, set(range(4, 100)))
    out = ws / "diverged"
    code = main([str(ws / "base.yaml"), f"output_dir={out}", "train.max_steps=20", "train.save_every=4",
                 "train.max_nonfinite_steps=3", "eval.every=0"])
    errors = re.findall(r"error: [^\r\n]*", capsys.readouterr().err)  # (stderr also holds the progress bars)
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith("error: training diverged: 3 optimizer steps in a row (to step 7)")
    assert "lower train.lr" in errors[0] and "step-4" in errors[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4"]
    assert not (out / "model.safetensors").exists()


def test_heads_with_non_finite_weights_are_refused(ws, run20, tmp_path):
    import shutil

    from safetensors.torch import save_file

    cfg, result = run20
    bad = tmp_path / "bad-heads"
    shutil.copytree(cfg.output_dir, bad, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    weights = load_file(str(bad / "model.safetensors"))
    name = next(k for k, v in weights.items() if v.is_floating_point() and v.numel())
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=f"non-finite weights \\({name}\\).*lower train.lr"):
        DraftHeads.from_pretrained(bad, target=result.target)


def test_resume_refuses_a_recipe_that_changes_the_math_and_allows_the_rest(ws, capsys):
    """A changed lr (or batch size, data, heads, loss, seed...) would be silently ignored or mixed into the run:
    it is refused before any model loads, every such key named with both values. Logging, saving and a longer
    run are allowed, and printed."""
    from medusa_train.config import ConfigError

    train(config(ws, "resumable", "train.max_steps=4", "train.save_every=2", "eval.every=0"))
    with pytest.raises(ConfigError) as err:
        train(config(ws, "resumable", "train.max_steps=8", "train.lr=2.0e-3", "train.batch_size=2", "loss.decay=0.5"))
    msg = str(err.value)
    assert "train.lr=0.002 (the checkpoint has 0.003)" in msg and "train.batch_size=2 (the checkpoint has 4)" in msg
    assert "loss.decay=0.5 (the checkpoint has 0.8)" in msg and "resume=none" in msg and "\n" not in msg
    capsys.readouterr()
    result = train(config(ws, "resumable", "train.max_steps=6", "train.log_every=1", "eval.every=0"))
    assert result.step == 6
    out = capsys.readouterr().out
    assert "resume: changed since the checkpoint (allowed): train.max_steps: 4 -> 6" in out
    assert "train.log_every: 5 -> 1" in out


def test_a_resumed_run_counts_every_token_once_and_logs_every_step_once(ws):
    """Resumed from a checkpoint between two log steps: train/tokens equals the uninterrupted run's (the tokens
    since the last log travel in the checkpoint), and the rows logged after that checkpoint, before the crash,
    are not repeated."""
    common = ("train.max_steps=7", "train.save_every=3", "train.keep_checkpoints=5", "eval.every=0")
    train(config(ws, "count-ref", *common))
    ref = [r for r in read_jsonl(ws / "count-ref" / "metrics.jsonl") if "train/loss" in r]
    train(config(ws, "count", *common))
    out = ws / "count"
    shutil.rmtree(out / "checkpoints" / "step-7")  # as if killed after logging step 7, before its checkpoint
    (out / "model.safetensors").unlink()
    train(config(ws, "count", *common))
    rows = read_jsonl(out / "metrics.jsonl")
    kinds = [(r["step"], "train/loss" in r) for r in rows]  # the final eval shares the last step with a train row
    assert kinds == [(r["step"], "train/loss" in r) for r in read_jsonl(ws / "count-ref" / "metrics.jsonl")]
    got = [r for r in rows if "train/loss" in r]
    assert [r["train/tokens"] for r in got] == [r["train/tokens"] for r in ref]


def test_what_would_fail_after_the_work_fails_before_it(ws, tmp_path, monkeypatch):
    """An output directory that cannot be written, a disk too small for the checkpoints, sequences longer than the
    target's positions: each a one-line ConfigError before any model loads (with save_every=0 an unwritable
    output_dir used to surface only after the whole run, at its first write)."""
    import medusa_train.train.preflight as preflight
    import medusa_train.train.run as run_setup
    from medusa_train.config import ConfigError
    from medusa_train.target.model import text_config

    monkeypatch.setattr(run_setup, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^output_dir=.*a-file is a file, not a directory"):
        train(config(ws, "x", f"output_dir={blocker}"))
    with pytest.raises(ConfigError, match=r"^output_dir=.*cannot be written \(Not a directory\)"):
        train(config(ws, "x", f"output_dir={blocker / 'sub'}"))
    with pytest.raises(ConfigError, match=r"^train.hidden_cache_dir=.*is a file"):
        train(config(ws, "x", f"train.hidden_cache_dir={blocker}"))
    with pytest.raises(ConfigError, match=r"^data.max_length=600 exceeds the target's 512 positions"):
        train(config(ws, "x", "data.max_length=600"))
    cfg = config(ws, "x")
    n = preflight.head_parameters(cfg, text_config(preflight.target_config(cfg)))  # without loading the target
    assert n == sum(p.numel() for p in DraftHeads.for_target(_tiny_target(ws), "chained", 3).parameters())
    monkeypatch.setattr(preflight, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(ConfigError, match=r"GiB free, but 2 checkpoints and the heads need about .* lower "
                                          "train.keep_checkpoints"):
        train(config(ws, "x"))


def test_a_run_reads_the_targets_config_once_before_loading(ws, tmp_path, monkeypatch):
    """The lr `auto` resolves, the checks before loading and the cache's room on its disk all use the one config
    `setup` reads (a GGUF target's is parsed from the file's header each time), and the run trains as before."""
    import yaml
    from transformers import AutoConfig

    import medusa_train.train.preflight as preflight
    import medusa_train.train.run as run_setup

    reads = []
    real = preflight.target_config
    monkeypatch.setattr(run_setup, "target_config", lambda cfg: reads.append(cfg.target.model) or real(cfg))
    monkeypatch.setattr(preflight, "target_config", lambda cfg: pytest.fail("the target's config was read again"))
    cfg = config(ws, "read-once", "train.max_steps=2", "train.lr=auto", f"train.hidden_cache_dir={tmp_path}")
    train(cfg)
    out = Path(cfg.output_dir)
    assert reads == [str(ws / "model")] and (out / "model.safetensors").is_file()
    assert any(tmp_path.iterdir())  # the cache was written where its room was checked
    recorded = yaml.safe_load((out / "recipe.yaml").read_text())["train"]["lr"]
    assert recorded == pytest.approx(3 / AutoConfig.from_pretrained(ws / "model").hidden_size)


def test_a_target_the_engine_refuses_is_refused_before_training(ws, tmp_path, monkeypatch):
    """The engine's support rules run on the target's config before anything loads: ALiBi (Bloom) and recurrent
    layers (LFM2's convolutions) stop with one line naming the model type; eagle3 heads on OPT find its decoder
    layers one level down (model.decoder.layers) and pass."""
    import medusa_train.train.preflight as preflight
    import medusa_train.train.run as run_setup
    from medusa_train.config import ConfigError

    from archs import tiny_config

    monkeypatch.setattr(run_setup, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for name, overrides, message in [("bloom", {}, "bloom: its ALiBi position bias"),
                                     ("lfm2", dict(layer_types=["conv", "full_attention"]), "lfm2: its conv layers")]:
        tiny_config(name, **overrides).save_pretrained(tmp_path / name)
        with pytest.raises(ConfigError, match=rf"^target.model=.*{name}: {message}.*nothing was trained"):
            train(config(ws, "x", f"target.model={tmp_path / name}"))
    tiny_config("opt").save_pretrained(tmp_path / "opt")
    opt = config(ws, "x", f"target.model={tmp_path / 'opt'}", "heads.kind=eagle3")
    preflight.check_before_loading(opt, preflight.target_config(opt))


def _tiny_target(ws):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ws / "model")


def test_checkpoints_verify_themselves_and_resume_falls_back_past_damaged_ones(ws, capsys):
    """Each checkpoint carries a manifest (sizes and sha256 of every file) written last. resume=auto skips a newest
    checkpoint whose bytes are damaged, or that lost a file (a rotation cut short), says so in one line, and resumes
    from the newest that verifies, ending with the heads of an uninterrupted run; an explicit resume=PATH that
    does not verify is refused naming the file; what interrupted writes left behind is removed on start."""
    from medusa_train.config import ConfigError

    common = ("train.max_steps=6", "train.save_every=2", "train.keep_checkpoints=3", "eval.every=0")
    train(config(ws, "verify-ref", *common))
    out = ws / "verify"
    train(config(ws, "verify", *common))
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-4", "step-6"]
    assert all((ckpts / s / "manifest.json").is_file() for s in ("step-2", "step-4", "step-6"))
    weights = next((ckpts / "step-6").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the newest weights
    weights.write_bytes(bytes(data))
    (next((ckpts / "step-4").glob("optimizer*"))).unlink()  # and the next one lost a file
    (out / "model.safetensors").unlink()  # as if the run died before its final save
    (out / ".model.safetensors.tmp-12345").write_bytes(b"partial")  # an interrupted atomic write
    (ckpts / ".tmp-step-8").mkdir()
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"^resume=.*step-6: .*\.safetensors does not match its checksum"):
        train(config(ws, "verify", *common, f"resume={ckpts / 'step-6'}"))
    result = train(config(ws, "verify", *common))
    printed = capsys.readouterr().out
    assert "resume: skipping" in printed and "step-6: " in printed and "does not match its checksum" in printed
    assert "step-4: optimizer" in printed and "is missing" in printed
    assert f"resumed from {ckpts / 'step-2'} at step 2" in printed
    assert result.step == 6 and max_diff(ws / "verify-ref", out) <= 1e-6
    assert not list(out.glob(".*.tmp-*")) and not list(ckpts.glob(".tmp-*"))


def test_rotation_keeps_the_checkpoints_that_verify(ws, capsys):
    """The newest checkpoint is damaged and skipped on resume; the resumed run's next save must then rotate out the
    damaged one, not the good one it resumed from (a second fault would otherwise leave nothing to resume)."""
    common = ("train.keep_checkpoints=2", "eval.every=0")
    train(config(ws, "rotate", "train.max_steps=6", "train.save_every=3", *common))
    ckpts = ws / "rotate" / "checkpoints"
    weights = next((ckpts / "step-6").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"damaged!")
    capsys.readouterr()
    train(config(ws, "rotate", "train.max_steps=4", "train.save_every=2", *common))  # resumes from step 3, saves 4
    printed = capsys.readouterr().out
    assert f"resumed from {ckpts / 'step-3'}" in printed
    assert f"removing {ckpts / 'step-6'}, which does not verify" in printed
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-3", "step-4"]


def test_an_exploding_loss_is_a_divergence(ws, capsys):
    """lr=1e6: the loss grows by orders of magnitude while staying finite (no step is skipped). The run stops with
    exit code 1 and one line, keeps the last checkpoint written before the explosion, and saves no heads."""
    from medusa_train.train.cli import main

    out = ws / "explode"
    code = main([str(ws / "base.yaml"), f"output_dir={out}", "train.lr=1e6", "train.warmup_steps=0",
                 "train.max_steps=30", "train.log_every=2", "train.save_every=1", "eval.every=0"])
    err = capsys.readouterr().err
    assert code == 1, err
    m = re.search(r"error: training diverged: at step (\d+) the training loss is (\S+), over "
                  r"train.max_loss_growth=10 x its best \((\S+)\); .*The last good checkpoint is .*: "
                  r"lower train.lr", err)
    assert m, err
    loss, best = float(m[2]), float(m[3])
    assert loss > 10 * best and best < 20  # the start (about 6 on this data), not a window already exploded
    assert not (out / "model.safetensors").exists()
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert all(math.isfinite(r["train/loss"]) for r in rows) and rows[-1]["train/skipped_steps"] == 0
    # no checkpoint was written from a window over the bound: each kept one precedes the first such logged window
    grown_from = min([r["step"] for r in rows if r["train/loss"] > 10 * best] + [int(m[1])])
    kept = [int(p.name[5:]) for p in (out / "checkpoints").glob("step-*")]
    assert all(step < grown_from for step in kept)


def test_damaged_heads_and_hidden_cache_files_are_named_in_one_line(ws, run20, tmp_path, capsys):
    from medusa_train.target.states import TargetStates

    cfg, result = run20
    heads = tmp_path / "heads"
    shutil.copytree(cfg.output_dir, heads, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    (heads / "model.safetensors").write_bytes((heads / "model.safetensors").read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match=r"model.safetensors cannot be read \(.*\): the file is damaged"):
        DraftHeads.from_pretrained(heads, target=result.target)
    cache = tmp_path / "hidden"
    cache.mkdir()
    (cache / "shard-1.pt").write_bytes(b"not a torch file")
    states = TargetStates(result.target, result.target.get_output_embeddings(), directory=cache)
    assert len(states) == 0 and (cache / "damaged-shard-1.pt").is_file()  # set aside: its rows computed again
    assert re.search(r"hidden_cache_dir: .*shard-1.pt cannot be read \(.*\): set aside as damaged-shard-1.pt",
                     capsys.readouterr().out)


@pytest.mark.parametrize("seed", [0, 1, 2, "final"])
def test_sigkill_at_a_random_point_then_resume_ends_as_an_uninterrupted_run(ws, seed):
    """kill -9 a real `train.py` at a random point of a run that checkpoints every step (after a random number of
    logged steps, plus a random fraction of a step: inside a step, a checkpoint write or a rotation; "final": right
    after the last step is logged, in its checkpoint, the final evaluation or the final save of the heads), then
    resume: the heads equal an uninterrupted run's, whatever the kill left behind."""
    common = ["train.max_steps=24", "train.save_every=1", "train.keep_checkpoints=2", "train.log_every=1",
              "eval.every=0"]
    ref = ws / "kill-ref"
    if not (ref / "model.safetensors").exists():
        train(config(ws, "kill-ref", *common))
    rng = random.Random(seed)
    logged, extra = (24, rng.uniform(0.0, 0.05)) if seed == "final" else (rng.randint(2, 18), rng.uniform(0.0, 0.03))
    out = ws / f"kill-{seed}"
    args = [sys.executable, str(ROOT / "train.py"), str(ws / "base.yaml"), f"output_dir={out}", *common]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = out / "metrics.jsonl"
        while proc.poll() is None and not (metrics.is_file() and metrics.read_text().count("train/loss") >= logged):
            time.sleep(0.002)
        time.sleep(extra)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL  # killed before it could finish
    assert seed == "final" or not (out / "model.safetensors").exists()  # the others: killed mid-run
    result = train(config(ws, f"kill-{seed}", *common))
    assert result.step == 24
    assert max_diff(ref, out) <= 1e-6


def test_a_data_error_is_the_first_thing_printed(ws, tmp_path, capsys):
    """An empty dataset stops with exit code 2 and one line, before the resolved config is printed (it came after a
    70-line dump of the recipe)."""
    from medusa_train.train.cli import main

    (tmp_path / "empty.jsonl").write_text("")
    code = main([str(ws / "base.yaml"), f"output_dir={tmp_path / 'out'}", f"data.dataset={tmp_path / 'empty.jsonl'}"])
    captured = capsys.readouterr()
    assert code == 2 and "resolved config" not in captured.out, captured.out
    assert len(captured.err.strip().splitlines()) == 1 and "empty" in captured.err


def test_a_trainable_lm_heads_gradient_is_kept_once_not_once_a_chunk():
    """Heads with LM heads of their own: what a step keeps for backward does not grow with the number of loss chunks
    (each chunk's [V, d] weight gradient is summed into one buffer a head, handed over once), and the gradients are
    those of one chunk."""
    from tiny import tiny_model

    from medusa_train.config import LossConfig
    from medusa_train.target.states import TargetStates
    from medusa_train.train.losses import HeadsObjective

    torch.manual_seed(0)
    target = tiny_model("llama")
    heads = DraftHeads.for_target(target, "chained", 3, own_lm_head=True)
    ids = torch.randint(0, 260, (2, 24))
    mask, labels = torch.ones_like(ids), ids.clone()
    h, greedy = TargetStates(target, target.get_output_embeddings())({"input_ids": ids, "attention_mask": mask})

    def step(chunk: int) -> tuple[int, list[torch.Tensor]]:
        saved = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = HeadsObjective(heads, LossConfig(chunk_size=chunk, ce_weight=0.5))(
                h, greedy, ids, labels, mask, target.get_input_embeddings(), target.get_output_embeddings())
        return sum(saved), torch.autograd.grad(loss * 0.5, [lm.weight for lm in heads.lm_heads])

    one_bytes, one_grads = step(1000)  # one chunk
    many_bytes, many_grads = step(2)  # a chunk a position
    vd = 260 * 32 * 4  # one head's [V, d] in float32
    assert many_bytes - one_bytes < vd  # was (chunks - 1) x 3 heads x vd more
    for g, r in zip(many_grads, one_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7)
