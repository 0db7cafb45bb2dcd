"""Build a small, fast chat target from scratch: the engine's hard case, where a verify forward costs a few ms.

A Qwen2-architecture model shaped like `inference.oracle`'s "small" (6 layers, d 384, 6 query / 2 KV heads, a
byte-level BPE vocabulary of 8192 trained here, tied embeddings: 12.6M parameters) is trained for a few minutes
on GSM8K's training questions and answers rendered in ChatML, the format it then answers in. It writes
`OUT/model` (model, tokenizer with a chat template: a plain transformers directory the trainer, the distiller and
the benchmark load by path), `OUT/train-prompts.jsonl` (the questions it trained on: distill these for the heads),
`OUT/train-rows.jsonl` (those questions with the answers it trained on)
and `OUT/heldout-prompts.jsonl` (the last `--heldout` questions, never seen in training: benchmark on these).

    python scripts/small_target.py --data ../shared/data/gsm8k_train.jsonl --out runs/small --minutes 8

GSM8K (MIT) is in the steering repo's shared/data; any JSONL of {question, answer} rows works. `--code DIR` builds
a code target instead: every function of every Python file under DIR (e.g. the interpreter's own standard library,
/usr/lib/python3.11) becomes a row, its `def` line and docstring the question, the whole function the answer; the
rows of the last files are held out, so held-out prompts come from modules the target never saw.

    python scripts/small_target.py --code /usr/lib/python3.11 --out runs/code --minutes 10
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import time
from pathlib import Path

import torch

from medusa_train.demo import fast_bfloat16

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat_text(question: str, answer: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def code_rows(root: str, max_chars: int = 2000) -> list[dict[str, str]]:
    """{question, answer} rows from the functions of the Python files under `root` (sorted paths, so the split is
    fixed): the question asks for the function by its `def` line and docstring, the answer is its source. Functions
    longer than `max_chars`, or without a docstring, are skipped."""
    rows = []
    for path in sorted(Path(root).rglob("*.py")):
        if any(part in {"test", "tests", "idlelib", "site-packages", "lib2to3"} for part in path.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node) is None:
                continue
            text = "\n".join(lines[node.lineno - 1: node.end_lineno])
            indent = len(text) - len(text.lstrip())
            text = "\n".join(line[indent:] for line in text.splitlines())
            doc = node.body[0]
            head = "\n".join(line[indent:] for line in lines[node.lineno - 1: doc.end_lineno])
            if len(text) <= max_chars and len(text) > len(head) + 20:
                rows.append({"question": f"Write this Python function:\n{head}", "answer": text})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="JSONL of {question, answer} rows (GSM8K's train split)")
    source.add_argument("--code", help="a folder of Python files: a code target (its functions are the rows)")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=8.0, help="training wall-clock")
    p.add_argument("--steps", type=int, default=0, help="train this many steps instead (the same target on any "
                   "machine); the schedule follows steps")
    p.add_argument("--heldout", type=int, default=64, help="last N questions kept out of training")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(args.seed)
    rows = code_rows(args.code) if args.code else [json.loads(line) for line in open(args.data) if line.strip()]
    prefix = "code" if args.code else "gsm8k"
    train_rows, heldout = rows[:-args.heldout], rows[-args.heldout:]
    out = Path(args.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    for name, part in (("train-prompts.jsonl", train_rows), ("heldout-prompts.jsonl", heldout)):
        with open(out / name, "w") as f:
            for i, r in enumerate(part):
                f.write(json.dumps({"id": f"{prefix}-{name.split('-')[0]}-{i}", "prompt": r["question"]}) + "\n")
    with open(out / "train-rows.jsonl", "w") as f:  # the conversations it trained on: rows for heads
        f.writelines(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in train_rows)
    texts = [chat_text(r["question"], r["answer"]) for r in train_rows]
    tok = train_tokenizer(texts, 8192)
    ids = [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]]
    data = torch.tensor(ids[: len(ids) // args.seq_len * args.seq_len]).view(-1, args.seq_len)
    print(f"{len(texts)} conversations, {len(ids)} tokens, {data.shape[0]} sequences of {args.seq_len}", flush=True)

    config = Qwen2Config(vocab_size=len(tok), hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60
    start, step, order = time.perf_counter(), 0, []
    rng = random.Random(args.seed)
    model.train()
    bf16 = fast_bfloat16()  # emulated bfloat16 (a CPU without AVX512-BF16 or AMX) runs ~10x slower than float32
    while (step < args.steps) if args.steps else (time.perf_counter() - start < budget):
        elapsed = time.perf_counter() - start
        if len(order) < args.batch_size:
            order = list(range(data.shape[0]))
            rng.shuffle(order)
        batch = data[[order.pop() for _ in range(args.batch_size)]]
        frac = step / args.steps if args.steps else elapsed / budget  # warm-up, then cosine to a tenth
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e} {elapsed:.0f} s", flush=True)
    model.eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    print(f"saved {out / 'model'} after {step} steps ({time.perf_counter() - start:.0f} s), "
          f"last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
