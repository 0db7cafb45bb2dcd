"""Export trained heads to the formats serving engines load: one CLI for every kind.

    python -m medusa_train.export HEADS_DIR OUT --format speculators      # eagle3 and dflash heads: vLLM
    python -m medusa_train.export HEADS_DIR OUT --format eagle3           # eagle3 heads: SGLang (EAGLE-3's layout)
    python -m medusa_train.export HEADS_DIR OUT --format dflash           # dflash heads: SGLang (DFlash's layout)
    python -m medusa_train.export HEADS_DIR OUT --format medusa           # parallel heads: vLLM <= 0.32
    python -m medusa_train.export HEADS_DIR OUT --format mlp_speculator   # chained mlp_speculator heads: vLLM <= 0.32

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
- `mlp_speculator`: IBM's MLP speculator layout (removed in vLLM 0.33; no current engine serves it).

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

from .config import EAGLE3_NORMS
from .errors import ArgumentParser
from .files import CONFIG_NAME, WEIGHTS_NAME, atomic_write_dir
from .heads import DraftHeads, load_spec
from .target import merge_recorded_adapter, recorded_adapter

FORMATS = ("speculators", "eagle3", "dflash", "medusa", "mlp_speculator")
SPECULATORS_VERSION = "0.9.0"


class ExportError(ValueError):
    """The heads cannot be exported as asked (one line: what and how to fix it)."""


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


def speculators_config(heads: DraftHeads, verifier: str, architectures: list[str]) -> dict[str, Any]:
    """config.json as speculators 0.9 writes an Eagle3SpeculatorConfig (the norm flags explicit: vLLM assumes
    norm_before_residual=true when the key is missing)."""
    spec = heads.spec
    layer = dict(spec.layer_config)
    layer.setdefault("model_type", "llama")
    return {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": spec.scored_vocab,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layers),
        "embed_requires_grad": False,
        "fc_norm": False,
        **norm_flags(spec, EAGLE3_NORMS),
        **speculators_common(spec, "eagle3", verifier, architectures, layer),
    }


def speculators_common(spec, algorithm: str, verifier: str, architectures: list[str], layer: dict[str, Any]
                       ) -> dict[str, Any]:
    """What every speculators 0.9 config holds: the proposal (a greedy chain of num_heads tokens), the verifier, the
    versions and the draft layers' transformers config."""
    return {
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": spec.num_heads, "verifier_accept_k": 1}],
            "verifier": {"architectures": list(architectures), "name_or_path": verifier},
        },
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "transformer_layer_config": layer,
        "torch_dtype": "float32",
    }


def speculators_dflash_config(heads: DraftHeads, verifier: str, architectures: list[str]) -> dict[str, Any]:
    """config.json as speculators 0.9 writes a DFlashSpeculatorConfig (see the module docs for the causal flag)."""
    spec = heads.spec
    layer = dict(spec.layer_config)
    layer.setdefault("model_type", "qwen3")
    return {
        "architectures": ["DFlashSpeculator"],
        "aux_hidden_state_layer_ids": list(spec.aux_layers),
        "block_size": spec.num_heads + 1,
        "draft_vocab_size": spec.scored_vocab,
        "mask_token_id": spec.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,
        **speculators_common(spec, "dflash", verifier, architectures, layer),
    }


def dflash_files(heads: DraftHeads, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) in DFlash's release layout, from the speculators tensors of the same (full-vocabulary)
    heads, without the LM head and the embedding: SGLang shares the target's."""
    spec = heads.spec
    config = {k: v for k, v in spec.layer_config.items() if k != "transformers_version"}
    config |= {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "block_size": spec.num_heads + 1,
               "dflash_config": {"target_layer_ids": [i - 1 for i in spec.aux_layers],
                                 "mask_token_id": spec.mask_token_id},
               "torch_dtype": "float32"}
    return config, {k: v for k, v in state.items() if k not in ("lm_head.weight", "embed_tokens.weight")}


def speculators_tensors(heads: DraftHeads, embed: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The eagle3 or dflash heads' tensors under speculators' names, the draft vocabulary ordered by target id."""
    spec = heads.spec
    draft = heads.eagle3 if spec.kind == "eagle3" else heads.dflash
    state = {k: v.detach().float().cpu().contiguous() for k, v in draft.state_dict().items()
             if not k.startswith("rotary_emb.")}
    if spec.draft_vocab_size:
        ids, order = torch.sort(heads.draft_ids.cpu())
        state["lm_head.weight"] = state["lm_head.weight"][order].contiguous()
        state["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    if embed is not None:
        state["embed_tokens.weight"] = embed.detach().float().cpu().contiguous()
    return state


def norm_flags(spec, names: tuple[str, ...]) -> dict[str, bool]:
    """The config flags for the eagle3 norms `names` a format reads, each written explicitly (true: trained with it):
    a missing flag would be the engine's default, not what the heads compute."""
    return {name: name in spec.norms for name in names}


def import_speculators(checkpoint: str | os.PathLike, target: torch.nn.Module, target_name: str = "") -> DraftHeads:
    """eagle3 heads for `target` from a drafter in speculators' Eagle3 layout (what `speculators train` saves and
    `--format speculators` writes): the export read backwards, so our engine drafts with an EAGLE-3 drafter trained
    elsewhere. ExportError for what our layer cannot be (more than one decoder layer, per-layer `fc_norm`, a trained
    embedding). Attention is full where theirs may use a sliding window (2048 by default): the same below that."""
    from safetensors.torch import load_file

    from .heads import HeadsSpec
    from .target import target_fingerprint

    path = Path(checkpoint)
    files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not files:
        raise ExportError(f"{checkpoint} is not a speculators checkpoint: expected config.json and *.safetensors")
    config = json.loads((path / "config.json").read_text())
    kind = config.get("speculators_model_type")
    if kind is None:
        raise ExportError(f"{checkpoint} is not a speculators checkpoint: its config.json names no "
                          "speculators_model_type")
    if kind != "eagle3":
        raise ExportError(f"{checkpoint} holds a {kind!r} speculator: only eagle3 drafters import")
    layer = {k: v for k, v in config["transformer_layer_config"].items()
             if k not in ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers")}
    why = [what for what, bad in (("more than one decoder layer", layer.get("num_hidden_layers", 1) != 1),
                                  ("fc_norm", config.get("fc_norm")),
                                  ("a trained embedding", config.get("embed_requires_grad"))) if bad]
    if why:
        raise ExportError(f"{checkpoint} has {why[0]}, which our eagle3 layer does not: it cannot be imported")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state |= load_file(str(f))
    norms = [n for n in EAGLE3_NORMS if config.get(n)]
    aux = list(config["eagle_aux_hidden_state_layer_ids"])
    d = target.get_input_embeddings().weight.shape[1]
    vocab = target.get_output_embeddings().weight.shape[0]
    t2d = state.pop("t2d", None)
    state.pop("d2t", None)
    state.pop("embed_tokens.weight", None)
    draft_ids = torch.nonzero(t2d).flatten() if t2d is not None and int(t2d.sum()) < vocab else None
    methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
    spec = HeadsSpec(kind="eagle3", num_heads=int(methods[0].get("speculative_tokens", 3)), hidden_size=d,
                     vocab_size=vocab, draft_vocab_size=0 if draft_ids is None else len(draft_ids), aux_layers=aux,
                     layer_config=layer, norms=norms, target_name=target_name,
                     target_fingerprint=target_fingerprint(target))
    heads = DraftHeads(spec)
    missing, unexpected = heads.eagle3.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ExportError(f"{checkpoint}: tensors do not match an eagle3 layer of its config (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]})")
    if draft_ids is not None:
        heads.draft_ids.copy_(draft_ids)
    return heads


def eagle3_files(heads: DraftHeads, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) in the original EAGLE-3 layout, from the speculators tensors of the same heads (without
    the embedding: SGLang shares the target's)."""
    config = {k: v for k, v in heads.spec.layer_config.items() if k != "transformers_version"}
    config |= {"model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"],
               "draft_vocab_size": heads.spec.scored_vocab,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in heads.spec.aux_layers]},
               **norm_flags(heads.spec, ("norm_before_fc", "norm_output")), "torch_dtype": "float32"}
    renamed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    return config, renamed


def medusa_files(heads: DraftHeads, lm_head: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) in vLLM's Medusa layout for parallel heads."""
    spec = heads.spec
    state: dict[str, torch.Tensor] = {}
    for k, block in enumerate(heads.blocks):
        for i, res in enumerate(block):
            state[f"blocks.{k}.layers.{i}.weight"] = res.linear.weight.detach().float().cpu().contiguous()
            state[f"blocks.{k}.layers.{i}.bias"] = res.linear.bias.detach().float().cpu().contiguous()
        w = heads.lm_heads[k].weight if heads.lm_heads is not None else lm_head
        state[f"lm_heads.{k}.weight"] = w.detach().float().cpu().clone()  # one copy per head, as vLLM loads
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": spec.hidden_size,
              "vocab_size": spec.vocab_size, "num_heads": spec.num_heads, "num_hidden_layers": spec.layers_per_head,
              "max_paths": 64, "topk": 10, "truncated_vocab_size": None, "medusa_fc_bias": True,
              "torch_dtype": "float32"}
    return config, state


# what each format holds, as the recipe keys that train such heads (a tuple: any of them)
NEEDS = {"speculators": {"kind": ("eagle3", "dflash")}, "eagle3": {"kind": "eagle3"},
         "dflash": {"kind": "dflash", "draft_vocab_size": 0},
         "medusa": {"kind": "parallel", "draft_vocab_size": 0, "context_layers": 0},
         "mlp_speculator": {"kind": "chained", "block": "mlp_speculator", "layers_per_head": 1, "draft_vocab_size": 0,
                            "context_layers": 0}}


def format_problem(spec, fmt: str) -> str | None:
    """Why heads of this spec do not fit `fmt` (None: they do), naming the recipe keys the format needs."""
    wrong = [k for k, v in NEEDS[fmt].items() if getattr(spec, k) not in (v if isinstance(v, tuple) else (v,))]
    if not wrong and fmt == "eagle3" and "norm_before_residual" in spec.norms:  # SGLang's layer has no such norm
        return ("the eagle3 format holds heads trained without norm_before_residual in heads.norms (SGLang's draft "
                "layer has no such norm)")
    if not wrong:
        return None
    keys = " ".join(f"heads.{k}={'|'.join(v) if isinstance(v, tuple) else str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in NEEDS[fmt].items())
    return f"the {fmt} format holds heads trained with {keys}"


def describe(spec) -> str:
    """The heads' kind and what sets them apart, as recipe keys."""
    extra = [f"heads.{k}={getattr(spec, k)}" for k in ("block", "draft_vocab_size", "context_layers", "layers_per_head")
             if spec.kind not in ("eagle3", "dflash") and getattr(spec, k) not in (0, 1, "residual")]
    if spec.kind == "dflash":
        extra += [f"heads.num_heads={spec.num_heads}", f"heads.draft_vocab_size={spec.draft_vocab_size}"]
    if spec.kind == "eagle3" and spec.norms:
        extra.append(f"heads.norms=[{','.join(spec.norms)}]")
    return f"{spec.kind} heads" + (f" ({', '.join(extra)})" if extra else "")


def check_request(heads_dir: str | os.PathLike, out: str | os.PathLike, fmt: str, force: bool) -> None:
    """Everything that can be refused before loading anything: ExportError / FileNotFoundError with one line."""
    spec = load_spec(heads_dir)  # FileNotFoundError: not a heads directory
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    problem = format_problem(spec, fmt)
    if problem:
        fits = [f for f in FORMATS if format_problem(spec, f) is None]
        hint = (f"export them with --format {' or '.join(fits)}" if fits else
                "no format holds them; heads that export are trained with heads.kind=eagle3 (speculators, eagle3: "
                "vLLM and SGLang), heads.kind=dflash (speculators, dflash: vLLM and SGLang), or heads.kind=parallel "
                "heads.draft_vocab_size=0 heads.context_layers=0 (medusa: vLLM <= 0.32)")
        raise ExportError(f"{problem}, but {heads_dir} holds {describe(spec)}: {hint}")
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
    files: dict[str, Any]
    if fmt == "speculators":
        model = _target_model(name, fingerprint) if embed else None
        config = (model.config if model is not None else _target_config(name))
        archs = list(getattr(config, "architectures", None) or [])
        if not archs:
            raise ExportError(f"the target's config ({name}) names no architectures: pass --target with its "
                              "Hugging Face directory")
        if model is not None:
            from .heads import check_fingerprint

            check_fingerprint(heads.spec.target_fingerprint, model, heads.spec.target_name)
        state = speculators_tensors(heads, model.get_input_embeddings().weight if model is not None else None)
        make = speculators_config if heads.spec.kind == "eagle3" else speculators_dflash_config
        files = {"config": make(heads, verifier or name, archs), "state": state}
    elif fmt == "dflash":  # no embedding, no LM head: nothing to read from the target
        config, state = dflash_files(heads, speculators_tensors(heads, None))
        files = {"config": config, "state": state}
    elif fmt == "eagle3":  # no embedding, no verifier: nothing to read from the target
        config, state = eagle3_files(heads, speculators_tensors(heads, None))
        files = {"config": config, "state": state}
    elif fmt == "medusa":
        model = None if heads.lm_heads is not None else _target_model(name, fingerprint)
        config, state = medusa_files(heads, None if model is None else model.get_output_embeddings().weight)
        files = {"config": config, "state": state}
    else:
        model = _target_model(name, fingerprint)
        try:
            return atomic_write_dir(final, lambda staging: heads.export_mlp_speculator(staging, model))
        except ValueError as e:
            raise ExportError(str(e)) from None

    def write(staging: Path) -> None:
        save_file(files["state"], str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(json.dumps(files["config"], indent=2) + "\n")

    return atomic_write_dir(final, write)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m medusa_train.export",
                            description="Export trained heads for a serving engine.")
    parser.add_argument("heads", help="heads directory (written by train.py)")
    parser.add_argument("out", help="directory to write (must not exist or be empty, unless --force)")
    parser.add_argument("--format", required=True, choices=tuple(FORMATS),
                        help="speculators (eagle3 and dflash heads, for vLLM), eagle3 (eagle3 heads, for SGLang), "
                             "dflash (dflash heads, for SGLang), medusa (parallel heads), mlp_speculator")
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
