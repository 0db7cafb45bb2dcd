"""The target's files on disk, read without loading the model: where a name's files are (a local directory, or the
snapshot the Hugging Face cache holds for a hub id), a digest of what they hold, and single tensors.

The digest ties the hidden-state cache to the exact target that made it: the embedding and LM head signatures of
`model.target_fingerprint` do not see a fine-tune, a merged LoRA or a rope change that leaves those two alone. It
reads the config (canonical JSON: a re-save with other formatting or another transformers version keeps it) and, of
every safetensors file, its header (each tensor's name, dtype, shape and place) and three 4 KiB windows of every
tensor's bytes (its start, middle and end): a few thousand small reads for a 70B checkpoint, and a change to any
tensor's values as a fine-tune or a merge makes them (every element moves) changes the digest. Other weight files
(GGUF, .bin) give their size and 256 windows spread over them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

WINDOW = 4096
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
# config keys that say where or by what a checkpoint was written, not what it computes
CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash")


def local_dir(name: str | os.PathLike) -> Path | None:
    """The directory holding `name`'s files: `name` itself when it is one, else the snapshot of that hub id in the
    Hugging Face cache (no network); None when neither exists."""
    path = Path(os.path.expanduser(str(name)))
    if path.is_dir():
        return path
    if path.exists() or str(name).count("/") > 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(name), "config.json")
    except Exception:  # noqa: BLE001 - not a repo id
        return None
    return Path(found).parent if isinstance(found, str) else None


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, where the data starts) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def _windows(f, spans: list[tuple[int, int]], digest) -> None:
    """Feed `digest` the bytes of up to three windows (start, middle, end) of each (begin, end) span of file `f`."""
    for begin, end in spans:
        size = end - begin
        starts = sorted({begin, begin + max(0, size // 2 - WINDOW // 2), max(begin, end - WINDOW)})
        for s in starts:
            f.seek(s)
            digest.update(f.read(min(WINDOW, end - s)))


def _file_digest(path: Path, digest) -> None:
    digest.update(f"{path.name}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            header, start = _safetensors_header(path)
            digest.update(json.dumps(header, sort_keys=True).encode())
            spans = [(start + t["data_offsets"][0], start + t["data_offsets"][1])
                     for k, t in sorted(header.items()) if k != "__metadata__"]
            _windows(f, spans, digest)
        else:
            size = path.stat().st_size
            _windows(f, [(size * i // 256, size * (i + 1) // 256) for i in range(256)], digest)


def _config_digest(path: Path, digest) -> None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        digest.update(path.read_bytes() if path.is_file() else b"")
        return
    for key in CONFIG_NOISE:
        config.pop(key, None)
    digest.update(json.dumps(config, sort_keys=True).encode())


def weights_digest(name: str | os.PathLike, gguf_file: str = "", adapter: str = "") -> str | None:
    """A digest of the target `name`'s config and weight files (`gguf_file`: that file alone), and of the peft
    `adapter` merged into it, if any: equal for the same checkpoint wherever it lies, different when any tensor
    changed. None when the files cannot be found on this machine."""
    directory = local_dir(name)
    if directory is None:
        return None
    digest = hashlib.sha256()
    _config_digest(directory / "config.json", digest)
    files = [directory / gguf_file] if gguf_file else sorted(
        p for p in directory.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files or not all(p.is_file() for p in files):
        return None
    for path in files:
        _file_digest(path, digest)
    if adapter:
        more = weights_digest(adapter)
        if more is None:
            return None
        digest.update(more.encode())
    return digest.hexdigest()


def checkpoint_tensors(directory: str | os.PathLike, trust_remote_code: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's input embedding and LM head weights [V, d], read from a checkpoint's safetensors files alone
    (a 70B target's are 2 x 2 GB of its 140), `directory` a local one or a hub id in the Hugging Face cache: the model
    is built on the meta device to learn their names (a tied LM head is the embedding's). None where that cannot be
    done (no such files here, names that the files do not hold): the caller then loads the model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = local_dir(directory)
    if path is None:
        return None
    where = weight_map(path)
    if where is None:
        return None
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - whatever stops a meta build, the full load reports it better
        return None
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    keys = [f"{names[id(embed)]}.weight", f"{names[id(head)]}.weight"]
    if head.weight is embed.weight and keys[1] not in where:  # tied: the checkpoint holds the embedding only
        keys[1] = keys[0]
    if any(k not in where for k in keys):
        return None
    out = []
    for k in keys:
        with safe_open(str(where[k]), framework="pt") as f:
            out.append(f.get_tensor(k))
    return out[0], out[1]


def weight_map(path: Path) -> dict[str, Path] | None:
    """{tensor name: the safetensors file holding it} of a checkpoint directory; None without safetensors files."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    if (path / "model.safetensors").is_file():
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {k: path / "model.safetensors" for k in f.keys()}
    return None


def files_holding(model: torch.nn.Module, name: str | os.PathLike) -> dict[str, Path] | None:
    """{parameter name: the safetensors file holding it} when the checkpoint `name` (a local directory or a hub id in
    the cache) holds every parameter of `model` (a skeleton built from its config) under its own name and shape, so
    that each can be read alone (`TensorReader`); None otherwise (GGUF, .bin, names the loader converts): the caller
    then loads the model."""
    path = local_dir(name)
    where = weight_map(path) if path is not None else None
    if where is None:
        return None
    shapes = {}
    for file in set(where.values()):
        header, _ = _safetensors_header(file)
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    out = {}
    for key, p in model.named_parameters():
        if shapes.get(key) != list(p.shape):
            return None
        out[key] = where[key]
    return out


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class TensorReader:
    """Reads single tensors, or runs of their rows, from safetensors files with plain reads (a context manager): no
    more of a checkpoint is in this process's memory than the piece asked for. (A memory-mapped read, as
    `safetensors.safe_open` makes, leaves every page it touched mapped into the process while the file is open: a
    sharded load through it held its share twice, and ZeRO-3's layer-by-layer read the whole checkpoint.)"""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.headers: dict[Path, tuple[dict, int]] = {}
        self.open: dict[Path, Any] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        for f in self.open.values():
            f.close()
        self.open.clear()

    def _read(self, key: str, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Rows first..first+count of tensor `key` (all of it by default), read from its file."""
        path = self.files[key]
        if path not in self.open:
            self.headers[path] = _safetensors_header(path)
            self.open[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by __exit__
        header, start = self.headers[path]
        info = header[key]
        shape, (begin, end) = list(info["shape"]), info["data_offsets"]
        if count is not None:
            row = (end - begin) // max(shape[0], 1)
            begin, end, shape[0] = begin + first * row, begin + (first + count) * row, count
        out = torch.empty(end - begin, dtype=torch.uint8)
        view, f = memoryview(out.numpy()), self.open[path]
        f.seek(start + begin)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{path} ends inside tensor {key}: the file is damaged or incomplete")
            done += n
        return out.view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(shape)

    def tensor(self, key: str) -> torch.Tensor:
        return self._read(key)

    def rows(self, key: str, first: int, count: int) -> torch.Tensor:
        """`tensor(key)[first:first + count]`, reading those bytes only."""
        return self._read(key, first, count)


def load_generation_config(model: torch.nn.Module, name: str | os.PathLike) -> None:
    """Give a model built from its config (not `from_pretrained`) the generation config its checkpoint ships, if any."""
    from transformers import GenerationConfig

    path = local_dir(name)
    if path is not None and (path / "generation_config.json").is_file():
        try:
            model.generation_config = GenerationConfig.from_pretrained(str(path))
        except (OSError, ValueError):
            pass
