"""Bad input gets a clear error before any generation: mismatched heads, batches, over-long prompts,
unsupported architectures, bad arguments."""

from __future__ import annotations

import pytest
import torch
from test_inference_greedy import float64_model, random_heads
from tiny import tiny_model, tiny_tokenizer

from inference import (ContextLengthError, HeadsDrafter, NGramDrafter, SpeculativeGenerator,
                       UnsupportedModelError)
from medusa_train.kinds.heads import DraftHeads, HeadsMismatchError



@pytest.fixture(scope="module")
def gen():
    model = float64_model("llama")
    return SpeculativeGenerator(model, tiny_tokenizer(), HeadsDrafter(random_heads(model, "chained", 3), model))


def test_heads_for_another_target_are_refused(tmp_path):
    model_a, model_b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    random_heads(model_a, "chained", 2).save_pretrained(tmp_path / "heads")
    with pytest.raises(HeadsMismatchError, match="differ"):
        SpeculativeGenerator.from_pretrained(tmp_path / "heads", target=model_b, tokenizer=tiny_tokenizer())
    with pytest.raises(HeadsMismatchError, match="hidden_size"):
        SpeculativeGenerator.from_pretrained(tmp_path / "heads", target=tiny_model("llama", hidden=64),
                                             tokenizer=tiny_tokenizer())


def test_batch_of_prompts_is_refused(gen):
    with pytest.raises(ValueError, match="batch generation is not supported.*2 prompts"):
        gen.generate(torch.zeros(2, 5, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="one prompt at a time, got a list of 2 strings"):
        gen.generate(["hello", "world"], max_new_tokens=4)


def test_over_long_prompt_is_refused_before_generating(gen):
    class Recorder:
        puts = 0

        def put(self, value):
            self.puts += 1

        def end(self):
            pass

    rec = Recorder()
    with pytest.raises(ContextLengthError, match=r"500 tokens.*max_new_tokens \(20\).*512"):
        gen.generate(torch.zeros(1, 500, dtype=torch.long), max_new_tokens=20, streamer=rec)
    assert rec.puts == 0
    # just fits: prompt + new tokens + tree depth == context
    out = gen.generate(torch.zeros(1, 500, dtype=torch.long), max_new_tokens=9, eos_token_id=[])
    assert len(out.token_ids) == 9
    # one more does not, though prompt + new tokens alone would: the last step's tree reaches 3 past them
    with pytest.raises(ContextLengthError, match=r"tree depth \(3\) = 513 exceeds the target's context of 512"):
        gen.generate(torch.zeros(1, 500, dtype=torch.long), max_new_tokens=10)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(acceptance="greedy"), "acceptance"),
    (dict(tree="bushy"), "tree"),
    (dict(tree_budget=-2), "tree_budget"),
    (dict(tree=[(0,), (-1,)]), "rank"),
    # numbers that are not what they claim: each was accepted before (nan sampled token 0 forever, True meant 1)
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0 .*got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be a number in"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int >= 0, got True"),
    (dict(max_new_tokens=4.0), "max_new_tokens must be an int"),
    (dict(tree_budget=True), "tree_budget must be 'auto' or an int"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(seed=1.5), "seed must be an int or None"),
])
def test_bad_arguments(gen, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gen.generate(torch.tensor([[1, 2, 3]]), **{"max_new_tokens": 4, **kwargs})


def test_bad_prompts(gen):
    for floats in (torch.tensor([[1.0, 2.7, 3.0]]), [1.5, 2.0], torch.tensor([[True, False]])):
        with pytest.raises(ValueError, match="prompt token ids must be integers"):  # was truncated to ints
            gen.generate(floats, max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        gen.generate(torch.tensor([[1, 9999]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        gen.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    no_tok = SpeculativeGenerator(gen.target, None, gen.drafter, self_check=False)
    with pytest.raises(ValueError, match="tokenizer"):
        no_tok.generate("hello", max_new_tokens=2)


def test_tree_deeper_than_the_heads_is_refused(gen):
    with pytest.raises(ValueError, match="at most 3 levels"):
        gen.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, tree=[(0, 0, 0, 0)])


def test_recurrent_model_is_refused():
    from transformers import AutoModelForCausalLM, MambaConfig

    config = MambaConfig(vocab_size=260, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="mamba"):
        SpeculativeGenerator(model, None, NGramDrafter())


def test_model_that_post_processes_logits_in_an_unknown_way_is_refused():
    """A forward that changes its logits after the LM head in a way its config does not say (here: adds a bias that
    depends on the position): the load self-check notices the mismatch instead of sampling from the wrong
    distribution, and says so in one line."""
    from transformers import LlamaForCausalLM

    class Shifted(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + torch.arange(out.logits.shape[-1], dtype=out.logits.dtype) * 0.1
            return out

    torch.manual_seed(0)
    model = Shifted(tiny_model("llama").config).eval()
    with pytest.raises(UnsupportedModelError, match="llama: tree verification self-check failed: its logits are "
                                                    "not its output layer") as e:
        SpeculativeGenerator(model, None, NGramDrafter())
    assert "\n" not in str(e.value)


def test_sliding_window_shorter_than_the_request_is_refused():
    model = tiny_model("mistral", sliding_window=64)
    gen = SpeculativeGenerator(model, None, NGramDrafter(max_depth=4))
    with pytest.raises(ContextLengthError, match="64 tokens"):
        gen.generate(torch.zeros(1, 50, dtype=torch.long), max_new_tokens=20)
    assert len(gen.generate(torch.zeros(1, 50, dtype=torch.long), max_new_tokens=10, eos_token_id=[]).token_ids) == 10


def test_an_unreachable_hub_fails_at_once_in_one_line(tmp_path, monkeypatch):
    """A hub name that is not a local directory nor cached, with the hub unreachable (HF_ENDPOINT on a closed port of
    this machine): one line naming the key and the fix, before transformers tries (it retried for ~90 s)."""
    import transformers

    from medusa_train.config import ConfigError, load_config
    from medusa_train.train.trainer import train

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", lambda *a, **k: pytest.fail("transformers was asked"))
    with pytest.raises(ConfigError, match=r"^target.model='someone/no-such-model' is not a local directory nor in "
                                          r"the Hugging Face cache, and the hub \(http://127.0.0.1:9\) cannot be "
                                          r"reached .*hf download someone/no-such-model"):
        train(load_config(None, ["target.model=someone/no-such-model", f"output_dir={tmp_path / 'out'}",
                                 f"data.dataset={tmp_path / 'd.jsonl'}"], world_size=1))
    # behind a proxy it is the proxy that must answer (never the hub directly)
    monkeypatch.delenv("HF_ENDPOINT")
    monkeypatch.setenv("HTTPS_PROXY", "127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"the hub \(https://huggingface.co\) cannot be reached from this machine "
                                          r"through the proxy 127.0.0.1"):
        train(load_config(None, ["target.model=someone/no-such-model", f"output_dir={tmp_path / 'out'}",
                                 f"data.dataset={tmp_path / 'd.jsonl'}"], world_size=1))
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    heads = tmp_path / "heads"
    DraftHeads.for_target(tiny_model("llama"), "chained", 2, target_name="someone/no-such-model").save_pretrained(heads)
    with pytest.raises(ValueError, match=r"^target='someone/no-such-model' is not a local directory"):
        SpeculativeGenerator.from_pretrained(heads)


def test_a_forward_that_ignores_the_tree_mask_is_refused_naming_that_cause():
    """The self-check tells its two causes apart: a decoder that drops the attention mask (every tree node then sees
    the nodes before it, siblings included) is refused for the mask, not for its logits."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    inner = model.model.forward
    model.model.forward = lambda *args, attention_mask=None, **kwargs: inner(*args, **kwargs)
    with pytest.raises(UnsupportedModelError, match="llama: tree verification self-check failed: its forward does "
                                                    "not honour a custom 4D attention mask and position ids"):
        SpeculativeGenerator(model, None, NGramDrafter())
