"""Tiny models and a tokenizer built in-process, so tests need no network and run in seconds."""

from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, PreTrainedTokenizerFast,
                          Qwen2Config)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens + ChatML specials (vocab 260), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<pad>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML_TEMPLATE
    return tok


VOCAB = 260


def tiny_config(arch: str = "llama", vocab_size: int = VOCAB, hidden: int = 32, layers: int = 2, **kw):
    common = dict(vocab_size=vocab_size, eos_token_id=258, bos_token_id=256, pad_token_id=259)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, **common, **kw)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    return cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, **common, **kw)


def tiny_model(arch: str = "llama", seed: int = 0, **kw):
    """A random tiny causal LM in eval mode, float32, eager attention-free of any hub download."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw))
    return model.eval()


def save_tiny(path, arch: str = "llama", seed: int = 0, **kw):
    """Save a tiny model and the tiny tokenizer into `path` (a directory `from_pretrained` loads)."""
    model = tiny_model(arch, seed, **kw)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model
