"""Export trained heads to the formats serving engines load: one CLI for every kind. Each kind names the formats its
heads are written in and writes them (`exports` in its module, medusa_train/kinds/); this command checks the request,
loads what the writer asks for, and writes the directory atomically.

    python -m medusa_train.export HEADS_DIR OUT --format speculators      # eagle3 and dflash heads: vLLM
    python -m medusa_train.export HEADS_DIR OUT --format eagle3           # eagle3 heads: SGLang (EAGLE-3's layout)
    python -m medusa_train.export HEADS_DIR OUT --format dflash           # dflash heads: SGLang (DFlash's layout)
    python -m medusa_train.export HEADS_DIR OUT --format medusa           # parallel heads: vLLM <= 0.32
    python -m medusa_train.export HEADS_DIR OUT --format mlp_speculator   # chained mlp_speculator heads: no engine

- `speculators`: speculators 0.9's Eagle3 layout (`speculators_model_type: eagle3`), which vLLM serves with
  `--speculative-config '{"method": "eagle3", "model": OUT, ...}'` (or `vllm serve OUT`, the verifier taken from the
  config) and SGLang with `--speculative-algorithm EAGLE3 --speculative-draft-model-path OUT`. Tensor names are the
  heads' own (`fc`, `layers.0.*`, `norm`, `lm_head`); the draft vocabulary becomes `d2t` (target id = draft id +
  d2t[draft id]) and `t2d` (a mask over the target vocabulary), ordered by target id; `embed_tokens.weight` is the
  target's embedding (read from the target; `--no-embed` leaves it out, and the engine then shares the target's).
- `speculators` for dflash heads: speculators 0.9's DFlash layout (`speculators_model_type: dflash`, `block_size` =
  num_heads + 1, `aux_hidden_state_layer_ids` = our aux layers, `mask_token_id`), which vLLM serves with
  `{"method": "dflash", "model": OUT, "num_speculative_tokens": num_heads}`. vLLM 0.32/0.33 turns the config's
  `sliding_window_non_causal` into its `causal` flag for every layer (`causal = not sliding_window_non_causal`), while
  speculators itself keeps full-attention layers non-causal whatever the flag says: the export writes true, so both
  read the block as non-causal, as it was trained.
- `dflash`: DFlash's own release layout (z-lab's: `architectures: DFlashDraftModel`, the Qwen3 layer config at the top,
  `block_size`, `dflash_config.target_layer_ids` counted as the layer whose output is taken: ours minus one, and
  `mask_token_id`), which SGLang loads with `--speculative-algorithm DFLASH`; no LM head (the engine shares the
  target's), so it holds heads with the full vocabulary only.
- `eagle3`: the original EAGLE-3 release's layout (`architectures: LlamaForCausalLMEagle3`, the layer as
  `midlayer.*`, no embedding), which SGLang loads with `--speculative-algorithm EAGLE3`; SGLang counts auxiliary
  layers by the layer whose output it takes, so `eagle_config.eagle_aux_hidden_state_layer_ids` holds ours minus one.
- `medusa`: vLLM's Medusa layout (`blocks.{k}.layers.{l}`, `lm_heads.{k}`; removed in vLLM 0.33), with the target's
  LM head copied into each head.
- `mlp_speculator`: IBM's MLP speculator layout (vLLM's V1 engine, the only one of 0.32 and 0.33, does not run it;
  no current engine serves it).

Heads trained for base + adapter (`target.adapter`, or a joint run's `target.lora`) draft for the merged model, which
is what the engine must serve: `--merged-target DIR` also writes it there (model and tokenizer, in the base's dtype)
and names it as the speculators verifier.

The directory is written beside OUT and renamed into place, so OUT is either the old export or the whole new one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .base.errors import ArgumentParser, ExportError
from .base.files import CONFIG_NAME, WEIGHTS_NAME, atomic_write_dir
from .kinds import KINDS
from .kinds.heads import (DraftHeads, ExportSource, HeadsMismatchError, HeadsSpec, check_fingerprint, kind_class,
                          load_spec)
from .target.model import fingerprint_difference, merge_recorded_adapter, recorded_adapter, weights_fingerprint
from .target.weights import checkpoint_tensors

FORMATS = tuple(dict.fromkeys(fmt for kind in KINDS.values() for fmt in kind.exports))


def _target_config(name: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - offline, missing, gated: one message
        raise ExportError(f"cannot read the target's config from {name!r} ({str(e).splitlines()[0][:100]}): pass "
                          "--target with a local copy of the target") from None


def _target_model(name: str, fingerprint: dict[str, Any], dtype: torch.dtype | str = torch.float32, tokenizer=False):
    """The target (float32 by default), with the peft adapter the heads (of this fingerprint) were trained for
    merged in; with `tokenizer`, (model, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(name) if tokenizer else None
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"cannot load the target {name!r} ({str(e).splitlines()[0][:100]}): pass --target with a "
                          "local copy of the target") from None
    model = merge_recorded_adapter(model, fingerprint, name)
    return (model, tok) if tokenizer else model


def target_weights(name: str, spec: HeadsSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head weights, float32, checked against the heads' fingerprint: read from a local
    checkpoint's safetensors alone (`checkpoint_tensors`: a 70B target's 4 GB, not its 140 in float32; a hub id is read
    from its snapshot in the Hugging Face cache), else from the loaded model (with the heads' recorded adapter merged
    in, which never touches these two)."""
    tensors = checkpoint_tensors(name)
    if tensors is None:
        model = _target_model(name, spec.target_fingerprint)
        check_fingerprint(spec.target_fingerprint, model, spec.target_name)
        return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    embedding, lm_head = (t.float() for t in tensors)
    expected = {k: v for k, v in spec.target_fingerprint.items() if k != "adapter"}  # an adapter leaves these alone
    diff = fingerprint_difference(expected, weights_fingerprint(embedding, lm_head))
    if diff is not None:
        where = f" (heads were trained for {spec.target_name})" if spec.target_name else ""
        raise HeadsMismatchError(f"heads do not fit this target: {diff}{where}")
    return embedding, lm_head


def _needs_text(needs: dict[str, Any]) -> str:
    return " ".join(f"heads.{k}={'|'.join(v) if isinstance(v, tuple) else str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in needs.items())


def holders(fmt: str) -> str:
    """The recipe keys of the heads a format holds: each kind that writes it, with what it needs."""
    kinds = [(name, kind.exports[fmt].needs) for name, kind in KINDS.items() if fmt in kind.exports]
    if all(not needs for _, needs in kinds):
        return f"heads.kind={'|'.join(name for name, _ in kinds)}"
    return " or ".join(_needs_text({"kind": name} | needs) for name, needs in kinds)


def format_problem(spec: HeadsSpec, fmt: str) -> str | None:
    """Why heads of this spec do not fit `fmt` (None: they do), naming the recipe keys the format needs."""
    export = kind_class(spec.kind).exports.get(fmt)
    if export is not None and all(getattr(spec, k) in (v if isinstance(v, tuple) else (v,))
                                  for k, v in export.needs.items()):
        return export.refuse(spec) if export.refuse else None
    return f"the {fmt} format holds heads trained with {holders(fmt)}"


def check_request(heads_dir: str | os.PathLike, out: str | os.PathLike, fmt: str, force: bool) -> None:
    """Everything that can be refused before loading anything: ExportError / FileNotFoundError with one line."""
    spec = load_spec(heads_dir)  # FileNotFoundError: not a heads directory
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    problem = format_problem(spec, fmt)
    if problem:
        fits = [f for f in FORMATS if format_problem(spec, f) is None]
        exporting = "; ".join(f"{_needs_text({'kind': name} | e.needs)} ({f}: {e.serves})"
                              for name, kind in KINDS.items() for f, e in kind.exports.items())
        hint = (f"export them with --format {' or '.join(fits)}" if fits else
                f"no format holds them; heads that export are trained with {exporting}")
        raise ExportError(f"{problem}, but {heads_dir} holds {kind_class(spec.kind).describe(spec)}: {hint}")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ExportError(f"{out} is a file: name a directory to export into")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty: pick another directory, or pass --force to replace it")
    if path.resolve() == Path(heads_dir).resolve():
        raise ExportError(f"{out} is the heads directory itself: export into another directory")


def write_merged_target(name: str, fingerprint: dict[str, Any], out: Path) -> Path:
    """The target with the heads' recorded adapter merged in, saved to `out` with its tokenizer (staged, then renamed)
    in the base's own dtype: the model a serving engine runs these heads against."""
    model, tokenizer = _target_model(name, fingerprint, dtype="auto", tokenizer=True)

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return atomic_write_dir(out, write)


def export(heads_dir: str | os.PathLike, out: str | os.PathLike, fmt: str, force: bool = False,
           target: str | None = None, verifier: str | None = None, embed: bool = True,
           merged_target: str | os.PathLike | None = None) -> Path:
    """Write the export of `heads_dir` into `out` (see the module docs); returns its path. `target`: where to read
    the target from (default: the model the heads were trained for); `verifier`: the name the serving machine
    knows the target by (default: `target`, or `merged_target`); `merged_target`: for heads trained for base + adapter,
    also write the merged model there."""
    from safetensors.torch import save_file

    check_request(heads_dir, out, fmt, force)
    heads = DraftHeads.from_pretrained(heads_dir)
    name = target or heads.spec.target_name
    fingerprint = heads.spec.target_fingerprint
    if not name:
        raise ExportError(f"{heads_dir}/config.json names no target: pass --target")
    final = Path(out)
    if merged_target is not None:
        merged = Path(merged_target)
        if not recorded_adapter(fingerprint):
            raise ExportError(f"--merged-target: {heads_dir} was trained for the bare target {name}, with no adapter "
                              "to merge: serve that model as it is and drop --merged-target")
        if merged.exists() and (not merged.is_dir() or any(merged.iterdir())) and not force:
            raise ExportError(f"--merged-target {merged} exists and is not an empty directory: pick another, or pass "
                              "--force to replace it")
        if merged.resolve() in (final.resolve(), Path(heads_dir).resolve()):
            raise ExportError(f"--merged-target {merged} is the export or the heads directory: name a directory of "
                              "its own")
        verifier = verifier or str(write_merged_target(name, fingerprint, merged).resolve())
    loaded: dict[str, Any] = {}

    def weights() -> tuple[torch.Tensor, torch.Tensor]:  # read once, on the writer's first ask
        if "weights" not in loaded:
            loaded["weights"] = target_weights(name, heads.spec)
        return loaded["weights"]

    def architectures() -> list[str]:
        archs = list(getattr(_target_config(name), "architectures", None) or [])
        if not archs:
            raise ExportError(f"the target's config ({name}) names no architectures: pass --target with its "
                              "Hugging Face directory")
        return archs

    source = ExportSource(lambda: weights()[0], lambda: weights()[1], architectures, verifier or name, embed)
    config, state = type(heads).exports[fmt].write(heads, source)

    def write(staging: Path) -> None:
        save_file(state, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    return atomic_write_dir(final, write)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m medusa_train.export",
                            description="Export trained heads for a serving engine.")
    parser.add_argument("heads", help="heads directory (written by train.py)")
    parser.add_argument("out", help="directory to write (must not exist or be empty, unless --force)")
    parser.add_argument("--format", required=True, choices=tuple(FORMATS),
                        help="; ".join(f"{fmt}: " + " or ".join(f"{name} heads ({kind.exports[fmt].serves})"
                                                                for name, kind in KINDS.items() if fmt in kind.exports)
                                       for fmt in FORMATS))
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    parser.add_argument("--target", default=None, help="where to read the target (default: the heads' config)")
    parser.add_argument("--verifier", default=None,
                        help="speculators: the target's name on the serving machine (default: --target)")
    parser.add_argument("--merged-target", default=None, metavar="DIR",
                        help="heads trained for base + adapter: also write the merged model (what to serve) to DIR, "
                             "and name it as the verifier")
    parser.add_argument("--no-embed", action="store_true",
                        help="speculators: leave the target's embedding out (the engine shares the target's)")
    args = parser.parse_args(argv)
    try:
        path = export(args.heads, args.out, args.format, args.force, args.target, args.verifier, not args.no_embed,
                      args.merged_target)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.heads} as {args.format} to {path}"
          + (f"; the merged target to serve is in {args.merged_target}" if args.merged_target else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
