"""Joint (Medusa-2) training, `target.lora`: LoRA adapters on the target train with the heads. What moves and what
must not, the KL term that holds the target to the original, the heads' warm-up, resume, two processes, the saved
adapter, exact generation with base + adapter + heads, and bad input."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from runs import config, torchrun_train, write_text_data
from safetensors.torch import load_file
from test_inference_greedy import greedy_reference

import medusa_train.train.optim as optim
import medusa_train.train.processes as processes
import medusa_train.train.run as run_setup
from inference import SpeculativeGenerator
from medusa_train.train.cli import main
from medusa_train.config import ConfigError, LoraSettings, LossConfig
from medusa_train.kinds.heads import DraftHeads, HeadsMismatchError
from medusa_train.train.joint import JointObjective, add_lora, lm_kl
from medusa_train.target.model import peft_quietly
from medusa_train.train.trainer import train

@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("joint")
    save_tiny(root / "model", "llama")
    write_text_data(root / "text.jsonl", seed=1)
    (root / "base.yaml").write_text(
        f"target: {{model: {root / 'model'}, lora: {{r: 4, alpha: 8, lr: 1.0e-2}}}}\n"
        "heads: {num_heads: 3}\n"
        f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24, eval_size: 4}}\n"
        "train: {batch_size: 4, lr: 3.0e-3, warmup_steps: 1, log_every: 2, seed: 0}\n"
        "loss: {distill_weight: 1.0, ce_weight: 0.5, chunk_size: 32}\n"
        "eval: {max_batches: 2}\n")
    return root


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights under their own names (peft's `.base_layer` removed), adapters left out."""
    return {n.replace(".base_layer", ""): p.detach() for n, p in model.named_parameters() if "lora_" not in n}


@pytest.fixture(scope="module")
def initial_adapters():
    """Every add_lora call's adapters as they were made, recorded by a wrapper (in call order)."""
    made: list[dict[str, torch.Tensor]] = []
    real = run_setup.add_lora

    def recording(target, settings):
        peft = real(target, settings)
        made.append(adapter_state(peft.get_base_model()))
        return peft

    run_setup.add_lora = recording
    yield made
    run_setup.add_lora = real


@pytest.fixture(scope="module")
def joint8(ws, initial_adapters):
    """The reference joint run: 8 steps, 2 of them the heads' warm-up, checkpoints at 4 and 8."""
    result = train(config(ws, "joint8", "train.max_steps=8", "train.heads_warmup_steps=2", "train.save_every=4"))
    return result, initial_adapters[-1]


def test_adapters_and_heads_move_and_the_base_stays_bit_identical(ws, joint8):
    from transformers import AutoModelForCausalLM

    result, before = joint8
    after = adapter_state(result.target)
    assert before.keys() == after.keys() and len(after) == 2 * 2 * 2  # A and B of q_proj and v_proj, 2 layers
    for name in before:
        assert not torch.equal(before[name], after[name]), f"adapter weight {name} did not move"
    fresh = DraftHeads.for_target(result.target, "chained", 3)
    trained = dict(result.heads.named_parameters())
    for name, p0 in fresh.named_parameters():
        assert not torch.equal(p0, trained[name].detach()), f"head parameter {name} did not move"
    on_disk = AutoModelForCausalLM.from_pretrained(ws / "model", dtype=torch.float32).state_dict()
    base = base_state(result.target)
    assert base.keys() == on_disk.keys()
    for name, w in base.items():
        assert torch.equal(w, on_disk[name]), f"base parameter {name} changed"
    assert not any(p.requires_grad for n, p in result.target.named_parameters() if "lora_" not in n)


def test_the_heads_warm_up_keeps_the_adapters_exactly_still(ws, initial_adapters):
    result = train(config(ws, "warm", "train.max_steps=4", "train.heads_warmup_steps=4", "eval.max_batches=1"))
    before, after = initial_adapters[-1], adapter_state(result.target)
    for name in before:
        assert torch.equal(before[name], after[name]), f"adapter weight {name} moved during the heads' warm-up"
    assert all(not after[n].any() for n in after if "lora_B" in n)  # B starts at 0: still the original target
    # out of the step, not only unmoved: no gradient reached them, so AdamW holds no state for them (the adapters'
    # group is the last)
    optimizer = torch.load(ws / "warm" / "checkpoints" / "step-4" / "optimizer.bin", weights_only=False)
    *heads_groups, adapters = optimizer["param_groups"]
    assert not set(adapters["params"]) & set(optimizer["state"])
    assert all(set(g["params"]) <= set(optimizer["state"]) for g in heads_groups)
    logged = [r for r in rows(ws / "warm") if "train/loss" in r]
    assert logged and all(r["train/lm_kl"] == 0.0 for r in logged)
    assert [r for r in rows(ws / "warm") if "eval/lm_kl" in r][-1]["eval/lm_kl"] == 0.0


def test_the_kl_term_is_logged_and_grows_from_zero_once_the_adapters_train(ws, joint8):
    logged = [r for r in rows(ws / "joint8") if "train/loss" in r]
    assert [r["step"] for r in logged] == [2, 4, 6, 8]
    assert logged[0]["train/lm_kl"] == 0.0  # steps 1-2: the heads' warm-up
    # the lr logged at a step is the next step's: the adapters' schedule starts after the warm-up, warmup_steps 1
    assert [r["train/adapter_lr"] for r in logged[:2]] == [1.0e-2, pytest.approx(
        1.0e-2 * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.2))))]  # step 4: 2 past the warm-up, cosine 1/5 done
    assert [optim.adapter_schedule(s, 2, 1, 8, 0.1) for s in range(3)] == [0.0, 0.0, 1.0]
    assert all(r["train/lm_kl"] > 0 for r in logged[1:])
    held_out = [r for r in rows(ws / "joint8") if "eval/lm_kl" in r]
    assert held_out and held_out[-1]["eval/lm_kl"] > 0 and held_out[-1]["eval/expected_tau"] >= 1


def naive_lm_kl(h, h_original, lm_head, valid, weight):
    p = torch.log_softmax(lm_head(h_original).float(), -1)
    q = torch.log_softmax(lm_head(h).float(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return weight * (kl * valid).sum() / valid.sum()


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_lm_kl_equals_the_definition_with_its_gradient(bias):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=bias).double().requires_grad_(False)
    h_original = torch.randn(2, 7, 16, dtype=torch.float64)
    h = (h_original + 0.3 * torch.randn_like(h_original)).requires_grad_()
    valid = torch.rand(2, 7) > 0.3
    loss, kl_sum, greedy = lm_kl(h, h_original, lm_head, valid, 0.7, chunk_size=3)
    want = naive_lm_kl(h, h_original, lm_head, valid, 0.7)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)  # logits in float32, as in training
    assert kl_sum.item() == pytest.approx(want.item() / 0.7 * valid.sum().item(), rel=1e-6)  # a float32 log
    assert torch.equal(greedy, lm_head(h).argmax(-1))
    grad, = torch.autograd.grad(loss, h)
    want_grad, = torch.autograd.grad(want, h)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-8)
    same, _, _ = lm_kl(h_original.clone().requires_grad_(), h_original, lm_head, valid, 1.0, chunk_size=3)
    assert same.item() == 0.0


def test_the_kl_term_is_zero_at_step_0_and_its_gradient_reaches_only_the_adapters():
    from tiny import tiny_model

    target = tiny_model("llama")
    peft = add_lora(target, LoraSettings(r=4, alpha=8, dropout=0.0))
    model = peft.get_base_model()
    heads = DraftHeads.for_target(model, "chained", 2)
    objective = JointObjective(heads, peft, LossConfig(lm_weight=1.0, chunk_size=16))
    ids = torch.randint(3, 200, (2, 12))
    labels, mask = ids.clone(), torch.ones_like(ids)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    _, _, kl = objective(ids, labels, mask, embed, lm_head, joint=True)
    assert kl[0].item() == 0.0 and kl[1].item() == 2 * 11  # B = 0: the adapted target is the original, exactly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    # the KL term alone (the heads' loss weighted 0): its gradient reaches the adapters and nothing else
    objective.cfg = LossConfig(distill_weight=0.0, ce_weight=0.0, lm_weight=1.0, chunk_size=16)
    loss, _, kl = objective(ids, labels, mask, embed, lm_head, joint=True)
    assert kl[0].item() > 0
    loss.backward()
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert all(p.grad is None or not p.grad.any() for p in heads.parameters())
    # the objective's parameters are the adapters and the heads (the base is not registered), and so its checkpoints
    assert {id(p) for p in objective.parameters()} == {id(p) for p in [*heads.parameters(), *lora.values()]}
    assert all(k.startswith(("heads.", "adapters.")) for k in objective.state_dict())


def test_resume_of_a_joint_run_ends_identical_to_the_uninterrupted_one(ws, joint8):
    out = ws / "joint-resumed"
    shutil.copytree(ws / "joint8" / "checkpoints" / "step-4", out / "checkpoints" / "step-4")
    result = train(config(ws, "joint-resumed", "train.max_steps=8", "train.heads_warmup_steps=2",
                          "train.save_every=4"))
    reference, _ = joint8
    assert result.step == 8
    for name, want in adapter_state(reference.target).items():
        torch.testing.assert_close(adapter_state(result.target)[name], want, rtol=0, atol=1e-6)
    a, b = load_file(str(ws / "joint8" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a if a[k].numel()) <= 1e-6
    assert [r["step"] for r in rows(out) if "train/loss" in r] == [6, 8]


def test_the_saved_adapter_loads_with_peft_and_generation_is_exact_for_the_adapted_target(ws, joint8):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result, _ = joint8
    out = ws / "joint8"
    spec = json.loads((out / "config.json").read_text())
    assert spec["target_fingerprint"]["adapter"]["path"] == "adapter"  # next to the heads: the pair moves as one
    assert spec["training"]["joint"] == {"lora_r": 4, "heads_warmup_steps": 2}
    moved = ws / "moved-heads"
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns("checkpoints"))
    base = AutoModelForCausalLM.from_pretrained(ws / "model").eval()
    with peft_quietly():  # peft's own deprecation warning on transformers 5.24
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), moved / "adapter").eval()
    ids = torch.tensor([[5, 80, 81, 99, 100, 7, 31]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, result.target.eval()(ids).logits)
    merged = loaded.merge_and_unload()
    prompt = torch.tensor([[5, 80, 81, 99, 100, 7]])
    want = greedy_reference(merged, prompt, 24, eos_token_id=[])
    gen = SpeculativeGenerator.from_pretrained(moved, dtype="float32", device="cpu")  # base + adapter + heads
    for tree in ("static", "dynamic"):
        got = gen.generate(prompt, max_new_tokens=24, tree=tree, tree_budget=4, eos_token_id=[])
        assert got.token_ids.tolist() == want.tolist(), tree
    with pytest.raises(HeadsMismatchError, match="bare base model, but they were trained for it with the adapter"):
        SpeculativeGenerator.from_pretrained(moved, target=base)


def test_two_processes_match_one_process_with_grad_accum_2(ws):
    """torchrun with 2 CPU processes (gloo) vs 1 process with 2 micro-steps: heads and adapters agree (no adapter
    dropout, whose draws differ by process); a warm-up step exercises DDP with the adapters out of the step."""
    common = ["train.max_steps=3", "train.log_every=1", "data.eval_size=0", "eval.max_batches=1",
              "target.lora.dropout=0", "train.heads_warmup_steps=1"]
    two = ws / "joint-ddp2"
    proc = torchrun_train([str(ws / "base.yaml"), "train.batch_size=4", *common], two, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = train(config(ws, "joint-ga2", "train.batch_size=2", "train.grad_accum=2", *common))
    a, b = load_file(str(ws / "joint-ga2" / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a if a[k].numel()) <= 1e-5
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with peft_quietly():  # peft's own deprecation warning on transformers 5.24
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ws / "model"), two / "adapter")
    ddp = adapter_state(loaded.get_base_model())
    single = adapter_state(one.target)
    assert ddp.keys() == single.keys()
    assert all(ddp[name].any() for name in ddp)  # B too: the adapters trained
    for name in ddp:
        torch.testing.assert_close(ddp[name], single[name], rtol=0, atol=1e-5)
    r1, r2 = rows(ws / "joint-ga2"), rows(two)
    kl1, kl2 = ([r["train/lm_kl"] for r in r if "train/loss" in r] for r in (r1, r2))
    assert kl1[0] == kl2[0] == 0.0 and kl1[2] == pytest.approx(kl2[2], rel=1e-3, abs=1e-9)


def test_bad_joint_recipes_exit_2_with_one_line_before_training(ws, tmp_path, capsys):
    recipe = ws / "base.yaml"
    fake_adapter = tmp_path / "adapter"
    fake_adapter.mkdir()
    (fake_adapter / "adapter_config.json").write_text("{}")
    cases = (
        (["train.cache_hidden=true"], r"target.lora trains the target, so its hidden states .* cannot be cached"),
        ([f"train.hidden_cache_dir={tmp_path / 'h'}"], "cannot be cached"),
        (["target.lora.target_modules=[nope_proj]"], r"target.lora.target_modules=\['nope_proj'\]: peft cannot place"),
        (["target.lora.target_modules=[embed_tokens, q_proj]"], "puts an adapter on the target's embedding"),
        (["target.lora.r=0", "train.heads_warmup_steps=3"], "train.heads_warmup_steps is for joint training"),
        ([f"target.adapter={ws}"], "is not a peft adapter"),
        ([f"target.adapter={fake_adapter}"], "target.lora trains a new adapter on target.model, and target.adapter"),
        (["target.forward_dtype=bfloat16"], "remove target.forward_dtype=bfloat16"),
        (["target.lora.lr=0"], "target.lora.lr must be > 0"),
    )
    for overrides, message in cases:
        out = tmp_path / f"out{len(message)}"
        assert main([str(recipe), f"output_dir={out}", "train.max_steps=1", *overrides]) == 2, overrides
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("error: ") and re.search(message, errors[0]), errors
        assert not (out / "checkpoints").exists() and not (out / "model.safetensors").exists()


def test_lora_settings_are_part_of_the_math_a_resume_cannot_change(ws):
    with pytest.raises(ConfigError, match=r"target.lora.r=8 \(the checkpoint has 4\)"):
        train(config(ws, "joint8", "train.max_steps=10", "train.heads_warmup_steps=2", "target.lora.r=8"))


def test_evaluate_cli_brings_the_adapter_back_and_reproduces_the_held_out_acceptance(ws, joint8, tmp_path):
    from medusa_train.train import evaluate as E

    out = ws / "joint8"
    args = [str(out / "recipe.yaml"), "--heads", str(out), "--split", "eval", "--max-batches", "2"]
    assert E.main(args + ["--out", str(tmp_path / "eval.json")]) == 0  # the run's own recipe: base + its adapter
    got, saved = (json.loads(p.read_text()) for p in (tmp_path / "eval.json", out / "acceptance.json"))
    assert got["positions_per_head"] == saved["positions_per_head"]
    assert got["expected_tau"] == pytest.approx(saved["expected_tau"], abs=1e-6)


@pytest.fixture(scope="module")
def joint_eagle3(ws, initial_adapters):
    result = train(config(ws, "joint-eagle3", "heads.kind=eagle3", "heads.num_heads=2", "train.max_steps=3",
                          "eval.max_batches=1", "train.warmup_steps=0"))
    return result, initial_adapters[-1]


def test_eagle3_heads_train_jointly_and_generate_exactly_for_the_adapted_target(ws, joint_eagle3):
    """eagle3 heads read three of the target's layers: joint training reaches the adapters through them too."""
    result, before = joint_eagle3
    after = adapter_state(result.target)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    prompt = torch.tensor([[5, 80, 81, 99, 100, 7]])
    gen = SpeculativeGenerator.from_pretrained(ws / "joint-eagle3", dtype="float32", device="cpu", lookup_nodes=0)
    want = greedy_reference(gen.target, prompt, 16, eos_token_id=[])
    got = gen.generate(prompt, max_new_tokens=16, tree_budget=4, eos_token_id=[])
    assert got.token_ids.tolist() == want.tolist()


def test_export_writes_the_merged_target_to_serve_and_names_it_the_verifier(ws, joint_eagle3, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from medusa_train import export as E

    heads, out, merged = ws / "joint-eagle3", tmp_path / "vllm", tmp_path / "merged"
    assert E.main([str(heads), str(out), "--format", "speculators", "--merged-target", str(merged)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(merged.resolve())
    served = AutoModelForCausalLM.from_pretrained(merged).eval()  # a plain model: no peft needed to serve it
    gen = SpeculativeGenerator.from_pretrained(heads, dtype="float32", device="cpu")
    prompt = torch.tensor([[5, 80, 81, 99, 100, 7]])
    assert greedy_reference(served, prompt, 16).tolist() == greedy_reference(gen.target, prompt, 16).tolist()
    DraftHeads.from_pretrained(heads, target=served)  # the heads accept it as the model they draft for
    assert (merged / "tokenizer_config.json").is_file()
    capsys.readouterr()
    # heads for the bare target have nothing to merge; an occupied directory is not overwritten without --force
    assert E.main([str(heads), str(tmp_path / "again"), "--format", "speculators", "--merged-target", str(out)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    bare = tmp_path / "bare-heads"
    DraftHeads.for_target(AutoModelForCausalLM.from_pretrained(ws / "model"), "eagle3", 2).save_pretrained(bare)
    assert E.main([str(bare), str(tmp_path / "x"), "--format", "speculators", "--target", str(ws / "model"),
                   "--merged-target", str(tmp_path / "m2")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "was trained for the bare target" in errors[0]
    assert not (tmp_path / "x").exists() and not (tmp_path / "m2").exists()


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED"])
def test_joint_training_refuses_sharded_launches_in_one_line(kind):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    with pytest.raises(ConfigError, match=f"target.lora runs on one process or under DDP, not {kind}") as err:
        processes.check_joint_distributed(SimpleNamespace(distributed_type=DistributedType[kind]))
    assert "\n" not in str(err.value)
    for fine in ("NO", "MULTI_CPU", "MULTI_GPU"):
        processes.check_joint_distributed(SimpleNamespace(distributed_type=DistributedType[fine]))
