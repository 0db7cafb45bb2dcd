"""Targets that are adapters (`target.adapter`): heads trained for base + a peft adapter generate exactly the merged
model's greedy output, bring the adapter back when loaded, and refuse the bare base."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from test_inference_greedy import greedy_reference
from tiny import save_tiny, tiny_model

from inference import SpeculativeGenerator
from medusa_train.train.cli import main
from medusa_train.config import ConfigError, load_config
from medusa_train.kinds.heads import DraftHeads, HeadsMismatchError
from medusa_train.target.model import merge_adapter, peft_quietly
from medusa_train.train.trainer import train

WORDS = "red green blue one two three cats dogs run jump far near and the".split()


def make_adapter(base, path: Path, seed: int = 0) -> None:
    """A random LoRA adapter on attention and MLP projections (B not zero, so it changes the model)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    with peft_quietly():  # peft's own deprecation warning on transformers 5.24
        peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                                                     target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(path)
    peft_model.unload()  # leave `base` as it was


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter")
    base = save_tiny(root / "base", "llama", seed=2)
    make_adapter(tiny_model("llama", seed=2), root / "adapter")
    rng = random.Random(0)
    with open(root / "text.jsonl", "w") as f:
        for _ in range(8):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(30))}) + "\n")
    cfg = load_config(None, [f"target.model={root / 'base'}", f"target.adapter={root / 'adapter'}",
                             f"data.dataset={root / 'text.jsonl'}", "data.format=text", "data.max_length=24",
                             "data.eval_size=2", "heads.num_heads=2", "train.max_steps=6", "train.batch_size=4",
                             "eval.max_batches=1", f"output_dir={root / 'heads'}"], world_size=1)
    train(cfg)
    return root, base


def merged_model(root: Path):
    from transformers import AutoModelForCausalLM

    return merge_adapter(AutoModelForCausalLM.from_pretrained(root / "base"), root / "adapter").eval()


def test_heads_bring_their_adapter_back_and_generate_the_merged_models_greedy_output(adapted):
    root, base = adapted
    spec = json.loads((root / "heads" / "config.json").read_text())
    assert spec["target_fingerprint"]["adapter"]["path"] == str((root / "adapter").resolve())
    merged = merged_model(root)
    prompt = torch.tensor([[5, 80, 81, 99, 100, 7]])
    want = greedy_reference(merged, prompt, 24, eos_token_id=[])
    assert want.tolist() != greedy_reference(base.eval(), prompt, 24, eos_token_id=[]).tolist()  # it matters
    gen = SpeculativeGenerator.from_pretrained(root / "heads", dtype="float32", device="cpu")  # base + adapter
    for tree in ("static", "dynamic"):
        out = gen.generate(prompt, max_new_tokens=24, tree=tree, tree_budget=4, eos_token_id=[])
        assert out.token_ids.tolist() == want.tolist(), tree
    # a model the user merged themselves is accepted: it computes what the heads were trained on
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with peft_quietly():  # peft's own deprecation warning on transformers 5.24
        own = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), root / "adapter")
    SpeculativeGenerator.from_pretrained(root / "heads", target=own.merge_and_unload())


def test_heads_for_an_adapted_target_refuse_the_bare_base(adapted):
    root, base = adapted
    with pytest.raises(HeadsMismatchError, match="bare base model, but they were trained for it with the adapter"):
        SpeculativeGenerator.from_pretrained(root / "heads", target=base)
    # and heads for the bare base refuse the adapted model
    bare = DraftHeads.for_target(base, "chained", 2)
    bare.save_pretrained(root / "bare-heads")
    with pytest.raises(HeadsMismatchError, match="has the adapter .* merged in, but they were made for the bare"):
        DraftHeads.from_pretrained(root / "bare-heads", target=merged_model(root))


def test_hidden_cache_of_the_bare_base_is_refused_for_the_adapted_target(adapted, tmp_path):
    root, _ = adapted
    common = [f"target.model={root / 'base'}", f"data.dataset={root / 'text.jsonl'}", "data.format=text",
              "data.max_length=24", "data.eval_size=0", "heads.num_heads=2", "train.max_steps=2",
              "train.batch_size=4", f"train.hidden_cache_dir={tmp_path / 'h'}"]
    train(load_config(None, common + [f"output_dir={tmp_path / 'a'}"], world_size=1))
    with pytest.raises(ConfigError, match="another target .*bare base model"):
        train(load_config(None, common + [f"target.adapter={root / 'adapter'}", f"output_dir={tmp_path / 'b'}"],
                          world_size=1))


def test_bad_adapters_exit_2_with_one_line(adapted, tmp_path, capsys):
    root, _ = adapted
    (tmp_path / "empty").mkdir()
    other = tmp_path / "other-adapter"
    make_adapter(tiny_model("llama", hidden=64), other)  # made for a base of another width
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {root / 'base'}}}\n"
                      f"data: {{dataset: {root / 'text.jsonl'}, format: text, max_length: 24}}\n"
                      f"train: {{max_steps: 1, batch_size: 4}}\noutput_dir: {tmp_path / 'out'}\n")
    for adapter, message in ((tmp_path / "empty", r"is not a peft adapter \(no adapter_config.json\)"),
                             (tmp_path / "nope", "target.adapter: directory not found"),
                             (other, "does not fit the target .* it was made for another base model")):
        assert main([str(recipe), f"target.adapter={adapter}"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("error: ") and re.search(message, errors[0]), errors
