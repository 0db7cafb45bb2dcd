"""Typed recipe config: dataclasses that the YAML mirrors one to one.

`load_config(recipe, overrides)` reads a YAML recipe, applies dotted `key=value` overrides, checks every
key, type and range, and returns a frozen-by-convention `Config`. Every problem raises `ConfigError`
with one line that names the key and the fix; `train.py` turns it into exit code 2 before any model is
loaded.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .base.errors import ConfigError
from .base.files import is_heads_dir, local_data_files, looks_local
from .base.keys import unknown_key_error
from .kinds import KINDS

__all__ = ["ConfigError", "Config", "load_config", "validate"]

MUON_KINDS = ("eagle3",)  # the head kinds `train.optimizer: auto` trains with Muon
MUON_LR_SCALE = 5.0  # `train.muon_lr` 0: this times train.lr (the panel's choice: docs/results.md, "The panel")


@dataclass
class LoraSettings:
    r: int = 0
    """LoRA rank. > 0 turns on joint (Medusa-2) training: peft LoRA adapters on the target train together with
    the heads, and the heads draft for the adapted target, whose output is no longer the original's (see
    `loss.lm_weight`). 0: the target stays frozen (Medusa-1)."""
    alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.05
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = field(default_factory=list)
    """Names of the linear layers that get adapters (e.g. [q_proj, v_proj]); empty: peft's default for the
    architecture. The embedding and the LM head cannot take one (the heads share them)."""
    lr: float = 2.0e-4
    """The adapters' learning rate (the heads use train.lr); same warm-up and cosine shape, starting after
    train.heads_warmup_steps."""


@dataclass
class TargetConfig:
    model: str = ""
    """Hub name or local directory of the frozen target (any causal LM that `from_pretrained` loads)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the target is loaded in. `auto`: bfloat16 on a GPU that supports it, else float32."""
    forward_dtype: Literal["same", "float32", "bfloat16", "float16"] = "same"
    """Training only: dtype of the frozen target's forward that produces h (`same`: target.dtype). The
    heads, and the embedding and LM head they and the loss use, stay in target.dtype; h is cast to it.
    On a CPU with native bf16 (AVX512-BF16 or AMX) `bfloat16` runs that forward ~2.4x faster than float32
    (SmolLM2-135M, 2 cores); the heads then learn from h with bf16 rounding, which the float32 target
    they serve does not have (a small shift). Costs a second copy of the target in memory."""
    gguf_file: str | None = None
    """File name inside `model` when the target is a GGUF checkpoint (dequantized on load)."""
    attn_implementation: str | None = None
    """Passed to `from_pretrained` (`sdpa`, `eager`, `flash_attention_2`); None keeps the default."""
    trust_remote_code: bool = False
    chat_template: str | None = None
    """A Jinja chat template (a .jinja file path, or the template itself) for targets whose tokenizer has
    none (e.g. Vicuna); None keeps the tokenizer's own."""
    adapter: str = ""
    """A peft adapter directory (what `PeftModel.save_pretrained` wrote) for targets served as base + adapter: the
    frozen target is `model` with this adapter merged in. The heads record it, so loading them brings base +
    adapter back, and they refuse the bare base model."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """Joint (Medusa-2) training: LoRA on the target, trained with the heads (`target.lora.r` > 0)."""


def kind_options() -> tuple[type, ...]:
    """Every kind's `Options` (its own heads.* keys), each once, in the order the kinds are listed. A key two kinds
    share (`aux_layers`, `layers_per_head`) must mean the same type and default in both."""
    seen: dict[str, dataclasses.Field] = {}
    for cls in {k.Options: None for k in KINDS.values()}:
        for f in dataclasses.fields(cls):
            first = seen.setdefault(f.name, f)
            if (first.type, first.default, first.default_factory) != (f.type, f.default, f.default_factory):
                raise TypeError(f"heads.{f.name} is declared twice, differently ({first.type} and {f.type})")
    classes = list({k.Options: None for k in KINDS.values()})  # less those another extends (it has their keys)
    return tuple(c for c in classes if not any(o is not c and issubclass(o, c) for o in classes))


@dataclass
class CommonHeadsConfig:
    kind: str = "chained"
    """`chained`: head k reads head k-1's state and the embedding of token x_{t+k} (`heads.block` says how).
    `parallel`: Medusa-1 heads, each a stack of residual SiLU blocks on h_t (the baseline). `eagle3`: EAGLE-3's
    draft layer (three target layers fused, one decoder layer applied num_heads times with its own attention, its
    own LM head over the draft vocabulary), the kind vLLM and SGLang serve (`python -m medusa_train.export`).
    `dflash`: DFlash's block drafter (the target's layers fused as context, `layers_per_head` small decoder layers over
    a block of the decided token and num_heads mask tokens, non-causal: one forward drafts every depth), which vLLM
    and SGLang serve too. `dspark`: DSpark, dflash's block plus a Markov head over the tokens drafted before each slot
    and a confidence head, which vLLM serves. Each kind's module (medusa_train/kinds/) says what it takes: the keys
    below the common ones are each kind's own."""
    num_heads: int = 4
    """K: head k predicts token x_{t+1+k}. dflash: the mask tokens of its block, whose size (speculators'
    `block_size`) is num_heads + 1: block_size 8 is num_heads 7."""
    draft_vocab_size: int | Literal["auto"] = "auto"
    """If > 0, heads score only the this-many most frequent tokens of the training data (0: full vocab). "auto": a
    quarter of the target's vocabulary where that is at least 2048 tokens (Llama-3: 32064; SmolLM2: 12288), else the
    full vocabulary. Drafting projects onto it at every tree level, so on a fast target it is most of the drafting
    cost; on a 12.6M target with a vocabulary of 8192, heads scoring 2048 tokens reached the held-out expected tau of
    full-vocabulary heads (3.36 against 3.31; docs/results.md). The medusa, mlp_speculator and dflash (SGLang) exports
    need 0."""
    init_from: str = ""
    """A trained heads directory to start from instead of fresh heads (warm start: more data or epochs on
    heads you have). Its architecture and draft vocabulary are kept, so the heads.* keys must match it (an error names
    any that differ; keys that only shape training, such as heads.anchors, are the recipe's); they must have been
    trained for this target. Not a resume: the optimizer, schedule and data order start afresh."""

    def draft_vocab(self, vocab_size: int) -> int:
        """The draft vocabulary for a target of `vocab_size` tokens (0: the full vocabulary), "auto" resolved."""
        if self.draft_vocab_size == "auto":
            return vocab_size // 4 if vocab_size // 4 >= 2048 else 0
        return min(self.draft_vocab_size, vocab_size)


COMMON_KEYS = {f.name for f in dataclasses.fields(CommonHeadsConfig)}


@dataclass
class HeadsConfig(*kind_options(), CommonHeadsConfig):
    """heads.*: the keys every kind takes (`CommonHeadsConfig`), then each kind's own (its `Options`, documented in its
    module under medusa_train/kinds/); a key of another kind than heads.kind is refused."""


@dataclass
class DataConfig:
    dataset: str = ""
    """Hub name, local file, directory or glob of json/jsonl/parquet/txt files."""
    format: Literal["text", "chat", "auto"] = "auto"
    """`chat`: a `messages` ({role, content}) or ShareGPT `conversations` ({from, value}) column rendered
    with the target's chat template, supervised on assistant replies only. `text`: plain text packed
    into blocks. `auto`: chat if such a column exists, else text."""
    split: str = "train"
    """Split to read when `dataset` is a hub name with several splits."""
    text_column: str = "text"
    max_length: int = 2048
    """Tokens per training sequence (text is packed to exactly this; chat is truncated to it)."""
    eval_size: float = 0.02
    """Held-out share: a fraction in (0, 1), or a number of examples if >= 1; 0 disables eval."""
    max_examples: int = 0
    """Use only the first this-many examples after shuffling (0: all)."""
    num_proc: int = 1
    """Processes for tokenization (`datasets.map`)."""
    max_dropped: float = 0.5
    """Rows that cannot be trained on (no assistant reply, a reply beyond max_length, an empty document...) are
    dropped and reported with their reasons; more than this fraction of them is an error (1: never)."""
    group_by_length: bool = False
    """Batches of rows of similar length: each epoch's shuffled order is cut into spans of 64 steps' rows, each span
    sorted by length into steps (batch_size x grad_accum rows, cut into the processes' batches in order), and the steps
    shuffled again, so a batch pads its rows to a length near their own; the order does not depend on the process count
    (batches of 8 Alpaca rows: 53% padding at random, 3% grouped; docs/results.md, "Batches of rows of similar
    length"). False: batches of random rows, the order of every run before it."""


@dataclass
class TrainConfig:
    max_steps: int = 0
    """Optimizer steps to run; 0 means `epochs` full passes over the data."""
    epochs: float = 1.0
    batch_size: int = 8
    """Sequences per micro-step summed over all processes; each process gets batch_size / world_size."""
    grad_accum: int = 1
    """Micro-steps per optimizer step (the effective batch is batch_size * grad_accum)."""
    lr: float | Literal["auto"] = "auto"
    """The heads' peak lr (AdamW's groups; Muon's is train.muon_lr). `auto`: the kind's own for this target
    (`default_lr` on its class: chained and parallel heads 3 / the target's hidden size, the others 1e-3;
    docs/training.md "The lr"), resolved from the target's config before any weight loads; recipe.yaml records the
    value."""
    optimizer: Literal["auto", "adamw", "muon"] = "auto"
    """`adamw`: AdamW on every parameter. `muon`: Muon (momentum 0.95, Newton-Schulz orthogonalized) on the heads'
    hidden weight matrices at train.muon_lr, AdamW on the rest, as speculators trains; one schedule. `auto`: muon for
    the kinds in MUON_KINDS, adamw for the others; resolved when the recipe loads, so recipe.yaml records which."""
    muon_lr: float = 0.0
    """Muon's lr (the hidden matrices' group, same schedule); 0: MUON_LR_SCALE x train.lr, resolved with it."""
    weight_decay: float = 0.0
    """Decoupled weight decay, on weight matrices only (biases and norm scales are not decayed)."""
    warmup_steps: int | float = 0
    """Linear warm-up from 0 to the peak lr over this many optimizer steps; a fraction in (0, 1): that share of the
    run's steps (as transformers' TrainingArguments reads it). Where the recipe does not set it, the kind's own
    (`train_defaults`), else 0."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping."""
    seed: int = 0
    log_every: int = 10
    save_every: int = 0  # checkpoint every this-many steps (0: only at the end); keep the newest keep_checkpoints
    keep_checkpoints: int = 2
    max_nonfinite_steps: int = 10
    """An optimizer step whose gradient norm is not finite (a NaN or infinite loss or gradient) is skipped: no
    update, counted in `train/skipped_steps`. This many in a row stop the run with exit code 1, keeping the last
    checkpoint (0: never stop). Heads with non-finite weights are never saved."""
    max_loss_growth: float = 10.0
    """A loss that explodes is a divergence too, finite or not: when the mean training loss of a logging window is
    more than this many times the best window's so far, twice in a row, the run stops with exit code 1 keeping the
    last good checkpoint; a checkpoint (or the final heads) is never written from a window above it (0: never
    stop). A healthy run's windows stay within 2x of their best; lr=1e6 reaches 1e8x."""
    cache_hidden: bool = False
    """Keep the frozen target's hidden states of every training row once computed, so every epoch after the first
    skips the target forward (costs d x 4 bytes per token in float32; eagle3 heads also keep their three layers,
    4 d x 4 bytes; a bfloat16 forward, `target.forward_dtype=bfloat16` or `target.dtype=bfloat16`, halves either).
    In CPU memory with one process (small targets and datasets, such as the offline default); with several, on disk
    in `output_dir/hidden-cache` (where the processes share their rows), unless hidden_cache_dir names a place."""
    heads_warmup_steps: int = 0
    """Joint training (target.lora): the first this-many optimizer steps train the heads alone on the original
    target (the adapters stay still, and the step costs what a frozen-target step does), then heads and adapters
    train together."""
    keep_best: Literal["auto", "tau", "expected_tau", "last"] = "auto"
    """Which heads the run ends with. `tau`: the evaluation with the highest real tau (needs eval.tau_every);
    `expected_tau`: the highest held-out expected tau of the static tree at eval.tau_budget (needs a held-out split);
    `last`: the final step's. `auto`: tau when eval.tau_every is set, else expected_tau when evaluations run during
    training (eval.every and a held-out split), else last (always last with target.lora, whose adapter trains
    too). The best so far is kept in `output_dir/best/` (written atomically at each evaluation that beats it) and
    `output_dir` ends with it, the last step's heads in `output_dir/last/`; metrics.jsonl and W&B log `best/step`."""
    activation_checkpointing: bool = False
    """eagle3, dflash: draft layers recomputed in backward, a seventh of their activations kept (docs/results.md)."""
    hidden_cache_dir: str = ""
    """Keep those hidden states on disk here instead (implies cache_hidden), keyed by each row's token ids, tied to
    the target's files, read memory-mapped: the processes of a run share their rows through it, and a later run on the
    same target (another head kind, other steps or lr) skips the target forward even in its first epoch. Shards are
    written atomically (every 512 MiB and each epoch's end); one that cannot be read is set aside and its rows
    computed again; a full disk stops the caching, not the run; another target's directory is refused."""
    process_timeout_minutes: float = 60.0
    """How long a process waits for the others in a collective before the run fails (torch's default: 10 minutes
    under NCCL): long enough for the main process to load a 70B target alone (FSDP2) or write a large checkpoint."""


@dataclass
class LossConfig:
    distill_weight: float = 1.0
    """Weight of KL(target || head k) to the target's own distribution at position t+k (soft labels)."""
    ce_weight: float = 0.0
    """Weight of cross-entropy to the data token x_{t+1+k}."""
    tv_weight: float = 0.0
    """Weight of the total-variation distance to the target's distribution, 1 - sum_v min(p_v, q_v): one minus the
    rate at which sampling accepts the head's token (DSpark's objective; the dspark kind's default is 0.9, with
    ce_weight 0.1 and distill_weight 0, where the recipe does not set them)."""
    confidence_weight: float = 1.0
    """Heads with a confidence head (dspark): weight of its binary cross-entropy to each position's acceptance rate."""
    decay: float = 0.8
    """Head k's loss is weighted decay**(k-1)."""
    lm_weight: float = 10.0
    """Joint training (target.lora): weight of KL(original target || adapted target) on the next token at every
    supervised position, which keeps the adapted target's own predictions close to the original's (Medusa-2's
    self-distillation). The loss is the heads' loss plus this times that KL. The heads' loss pulls the target towards
    being easy to predict: at 1 (SmolLM2, 38 joint steps, adapter lr 1e-3) the adapted model drifted to a KL of 0.27
    and repeated itself; at 10, 0.028 (docs/results.md, "Medusa-2")."""
    chunk_size: int = 1024
    """Positions per chunk when computing vocab-sized logits, so fp32 logits for all heads over the
    whole batch are never alive at once."""


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate on the held-out split every this-many steps (0: only at the end)."""
    max_batches: int = 20
    """Held-out batches per evaluation (0: the whole split). The split is a seeded shuffle of the data, so the first
    batches are a seeded sample; each evaluation reports the standard error of its expected tau (a bootstrap over
    sequences) and says when it is above 0.02."""
    tree_budgets: list[int] = field(default_factory=lambda: [4, 8, 64])
    """Draft-node budgets (root excluded) at which each evaluation reports the expected tau of the best static tree
    for the measured acceptance, found by the engine's own tree search (`eval/expected_tau@B`)."""
    tau_every: int = 0
    """Every this-many steps (and at the end) the engine itself generates, greedy, with the heads as they are, and
    logs the real tau (`eval/tau`; 0: never). Only the main process generates; the training state is untouched."""
    tau_prompts: str = ""
    """Prompts for the real tau: a file or dataset (first user turns, rendered with the chat template), or "" for
    the held-out split's own prompts (each row up to its first supervised token)."""
    tau_num_prompts: int = 8
    """How many of those prompts each real-tau measurement generates for."""
    tau_max_new_tokens: int = 64
    """New tokens per prompt in a real-tau measurement."""
    tau_budget: int = 8
    """The tree budget (draft nodes, root excluded) of the real-tau runs: the engine's static tree for the
    acceptance measured at that step, heads alone (no lookup). `train.keep_best=expected_tau` scores this budget."""


@dataclass
class TrackingConfig:
    backend: Literal["wandb", "none"] = "none"
    project: str = "medusa-train"
    run_name: str | None = None
    entity: str | None = None


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    output_dir: str = "runs/heads"
    """Where final heads, metrics.jsonl and checkpoints/ go."""
    resume: str = "auto"
    """`auto`: continue from the newest complete checkpoint in output_dir; `none`; or a checkpoint path."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------
# Loading, overrides and validation


def load_config(recipe: str | os.PathLike | None, overrides: list[str] | None = None,
                world_size: int | None = None) -> Config:
    """Load a YAML recipe (or only defaults when `recipe` is None), apply `key=value` overrides, validate.

    `world_size` defaults to the `WORLD_SIZE` set by `accelerate launch` / `torchrun`, so a batch size
    that does not split across processes fails before any model is loaded.
    """
    raw: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(raw).__name__}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.lr=1e-4")
        _set_dotted(raw, key.strip(), _parse_scalar(value))
    cfg = _build(Config, raw, prefix="")
    for section in ("loss", "train"):  # the kind's own objective and warm-up where the recipe is silent
        for key, value in getattr(KINDS.get(cfg.heads.kind), f"{section}_defaults", {}).items():
            if key not in (raw.get(section) or {}):
                setattr(getattr(cfg, section), key, value)
    _expand_home(cfg)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size=world_size)
    if cfg.train.optimizer == "auto":
        cfg.train.optimizer = "muon" if cfg.heads.kind in MUON_KINDS else "adamw"
    need(cfg.train.optimizer == "muon" or not cfg.train.muon_lr,
         f"train.muon_lr is Muon's lr, and this run trains with {cfg.train.optimizer}: drop it or set train.optimizer=muon")
    if cfg.train.lr != "auto":
        _muon_lr_follows(cfg)
    return cfg


def resolve_lr(cfg: Config, hidden_size: int) -> None:
    """`train.lr: auto` -> the kind's own lr for a target this wide (the trainer calls it with the target's config,
    before any weight loads); Muon's lr follows where unset."""
    if cfg.train.lr == "auto":
        cfg.train.lr = KINDS.get(cfg.heads.kind).default_lr(hidden_size)
        _muon_lr_follows(cfg)


def _muon_lr_follows(cfg: Config) -> None:
    if cfg.train.optimizer == "muon" and not cfg.train.muon_lr:
        cfg.train.muon_lr = MUON_LR_SCALE * cfg.train.lr


def _expand_home(cfg: Config) -> None:
    """`~/...` in path-valued keys means the home directory (from_pretrained and datasets do not expand it)."""
    for section, key in (("target", "model"), ("data", "dataset"), ("train", "hidden_cache_dir"), (None, "output_dir"),
                         (None, "resume")):
        obj = getattr(cfg, section) if section else cfg
        value = getattr(obj, key)
        if value.startswith("~"):
            setattr(obj, key, os.path.expanduser(value))


def _parse_scalar(text: str) -> Any:
    text = text.strip()
    try:
        return yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return text


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'recipe'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        if key not in names:
            full = prefix + str(key)
            while isinstance(value, dict) and len(value) == 1:  # a misspelled section: name the whole key
                (sub, value), = value.items()
                full += f".{sub}"
            raise unknown_key_error(full, Config)
    kwargs = {}
    for name in names & set(raw):
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, raw[name], prefix + name + ".")
        else:
            kwargs[name] = _coerce(prefix + name, raw[name], hint)
    return cls(**kwargs)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against the annotation `hint`; allow int -> float and nothing else implicit."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{key} must be {_type_name(hint)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(hint):
            return value
        raise ConfigError(f"{key} must be one of {_type_name(hint)}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, (list, tuple)):
            return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        raise ConfigError(f"{key} must be a list, got {value!r}")
    if hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads `5e-4` (no dot) as a string
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. a run name written as a number
    else:  # pragma: no cover - only the types above are used in Config
        return value
    raise ConfigError(f"{key} must be {_type_name(hint)}, got {value!r} ({type(value).__name__})")


def listed(names: list[str], conjunction: str) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def need(ok: bool, msg: str) -> None:  # ConfigError(msg) unless ok
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config, world_size: int = 1) -> None:
    """Range and consistency checks, section by section. Raises ConfigError naming the key."""
    validate_target(cfg)
    validate_heads(cfg.heads)
    validate_data(cfg.data)
    validate_train(cfg.train, world_size)
    takers = listed([k for k, c in KINDS.items() if c.recomputes], "and")
    need(not cfg.train.activation_checkpointing or KINDS[cfg.heads.kind].recomputes, f"train.activation_checkpointing "
         f"recomputes draft layers, which {cfg.heads.kind} heads do not have (only {takers} do): remove it")
    validate_loss(cfg.loss)
    validate_eval(cfg)


def validate_target(cfg: Config) -> None:
    """target.*, and what joint training (target.lora) rules out elsewhere."""
    need(bool(cfg.target.model), "target.model is required: a hub name or a local model directory")
    if looks_local(cfg.target.model) or os.path.sep in cfg.target.model and Path(cfg.target.model).exists():
        need(Path(os.path.expanduser(cfg.target.model)).exists(),
             f"target.model: directory not found: {cfg.target.model}")
    tmpl = cfg.target.chat_template
    need(tmpl is None or "{{" in tmpl or "{%" in tmpl or Path(os.path.expanduser(tmpl)).is_file(),
         f"target.chat_template: {tmpl} is neither a file nor a Jinja template")
    if cfg.target.adapter:
        adapter = Path(os.path.expanduser(cfg.target.adapter))
        need(adapter.is_dir(), f"target.adapter: directory not found: {cfg.target.adapter}")
        need((adapter / "adapter_config.json").is_file(),
             f"target.adapter={cfg.target.adapter} is not a peft adapter (no adapter_config.json): point it at the "
             "directory PeftModel.save_pretrained wrote")
    lora = cfg.target.lora
    need(lora.r >= 0, f"target.lora.r must be >= 0 (0: a frozen target), got {lora.r}")
    if lora.r:
        need(lora.alpha > 0, f"target.lora.alpha must be > 0, got {lora.alpha}")
        need(0 <= lora.dropout < 1, f"target.lora.dropout must be in [0, 1), got {lora.dropout}")
        need(lora.lr > 0, f"target.lora.lr must be > 0, got {lora.lr}")
        need(not cfg.train.cache_hidden and not cfg.train.hidden_cache_dir,
             "target.lora trains the target, so its hidden states change every step and cannot be cached: set "
             "train.cache_hidden=false and train.hidden_cache_dir='' (or target.lora.r=0 for frozen-target heads)")
        need(not cfg.target.adapter, "target.lora trains a new adapter on target.model, and target.adapter is "
                                     "another one: merge that adapter into a model directory first (peft's "
                                     "merge_and_unload, then save_pretrained) and point target.model at it")
        need(cfg.target.forward_dtype == "same",
             f"target.lora: the target's forward trains, so it runs in target.dtype: remove "
             f"target.forward_dtype={cfg.target.forward_dtype}")
    else:
        need(not cfg.train.heads_warmup_steps, "train.heads_warmup_steps is for joint training: set target.lora.r "
                                               "> 0, or remove it")
    if cfg.target.gguf_file is not None and Path(os.path.expanduser(cfg.target.model)).is_dir():
        need((Path(os.path.expanduser(cfg.target.model)) / cfg.target.gguf_file).is_file(),
             f"target.gguf_file: {cfg.target.gguf_file} not found in {cfg.target.model}")


def validate_heads(h: HeadsConfig) -> None:
    """heads.*: the common keys here; a key of another kind is refused; the kind checks its own (`check_options`)."""
    kind = KINDS.get(h.kind)
    need(kind is not None, f"heads.kind must be one of {' | '.join(repr(k) for k in KINDS)}, got {h.kind!r}")
    need(1 <= h.num_heads <= 16, f"heads.num_heads must be between 1 and 16, got {h.num_heads}")
    need(h.draft_vocab_size == "auto" or h.draft_vocab_size >= 0,
         f"heads.draft_vocab_size must be 'auto' or >= 0 (0: full vocab), got {h.draft_vocab_size}")
    own = {f.name for f in dataclasses.fields(kind.Options)}
    defaults = HeadsConfig()
    foreign = [f.name for f in dataclasses.fields(HeadsConfig) if f.name not in own and f.name not in COMMON_KEYS
               and getattr(h, f.name) != getattr(defaults, f.name)]
    if foreign:
        def takers(key: str) -> str:
            names = [n for n, k in KINDS.items() if key in {f.name for f in dataclasses.fields(k.Options)}]
            return f"heads.kind={listed(names, 'or')}" + (" only" if len(names) == 1 else "")

        said = ", ".join(f"heads.{key}{' is' if i == 0 else ''} for {takers(key)}" for i, key in enumerate(foreign))
        raise ConfigError(f"{said} (heads.kind={h.kind}): remove {'it' if len(foreign) == 1 else 'them'}")
    kind.check_options(kind.options_from(h))
    if h.init_from:
        need(is_heads_dir(h.init_from),
             f"heads.init_from={h.init_from} is not a heads directory (expected config.json and model.safetensors)")


def validate_data(d: DataConfig) -> None:
    need(bool(d.dataset), "data.dataset is required: a hub name, a local file, a directory or a glob")
    local_data_files(d.dataset)
    need(d.max_length >= 8, f"data.max_length must be >= 8, got {d.max_length}")
    need(d.eval_size >= 0, f"data.eval_size must be >= 0 (a fraction < 1 or a count), got {d.eval_size}")
    need(d.eval_size < 1 or float(d.eval_size).is_integer(),
         f"data.eval_size must be a fraction in (0, 1) or a whole count, got {d.eval_size}")
    need(d.max_examples >= 0, f"data.max_examples must be >= 0, got {d.max_examples}")
    need(d.num_proc >= 1, f"data.num_proc must be >= 1, got {d.num_proc}")
    need(0 <= d.max_dropped <= 1, f"data.max_dropped must be a fraction in [0, 1], got {d.max_dropped}")


def validate_train(t: TrainConfig, world_size: int) -> None:
    need(t.max_steps >= 0, f"train.max_steps must be >= 0 (0: use train.epochs), got {t.max_steps}")
    need(t.max_steps > 0 or t.epochs > 0, "train.epochs must be > 0 when train.max_steps is 0")
    need(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    need(t.batch_size % world_size == 0, f"train.batch_size={t.batch_size} does not divide across {world_size} "
         f"processes; use a multiple of {world_size}")
    need(t.process_timeout_minutes > 0, f"train.process_timeout_minutes must be > 0, got {t.process_timeout_minutes}")
    need(t.grad_accum >= 1, f"train.grad_accum must be >= 1, got {t.grad_accum}")
    need(t.lr == "auto" or t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    need(0 <= t.warmup_steps and (t.warmup_steps < 1 or float(t.warmup_steps).is_integer()),
         f"train.warmup_steps must be a whole count of steps or a fraction in [0, 1) of the run, got {t.warmup_steps}")
    for key, zero in (("weight_decay", ""), ("max_grad_norm", " (0: no clipping)"),
                      ("save_every", " (0: only at the end)"), ("heads_warmup_steps", ""), ("muon_lr", " (0: 5 x train.lr)"),
                      ("max_nonfinite_steps", " (0: never stop)")):
        need(getattr(t, key) >= 0, f"train.{key} must be >= 0{zero}, got {getattr(t, key)}")
    need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    need(t.log_every >= 1, f"train.log_every must be >= 1, got {t.log_every}")
    need(t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
    need(t.max_loss_growth == 0 or t.max_loss_growth > 1, f"train.max_loss_growth must be > 1 (0: never stop), got "
                                                          f"{t.max_loss_growth}")


def validate_loss(lo: LossConfig) -> None:
    for key in ("distill_weight", "ce_weight", "tv_weight", "confidence_weight", "lm_weight"):
        need(getattr(lo, key) >= 0, f"loss.{key} must be >= 0, got {getattr(lo, key)}")
    need(lo.distill_weight + lo.ce_weight + lo.tv_weight > 0,
         "loss.distill_weight, loss.ce_weight and loss.tv_weight cannot all be 0")
    need(0 < lo.decay <= 1, f"loss.decay must be in (0, 1], got {lo.decay}")
    need(lo.chunk_size >= 1, f"loss.chunk_size must be >= 1, got {lo.chunk_size}")


def validate_eval(cfg: Config) -> None:
    """eval.*, train.keep_best (which evaluations make), output_dir and resume."""
    need(cfg.eval.every >= 0, f"eval.every must be >= 0, got {cfg.eval.every}")
    need(cfg.eval.max_batches >= 0, f"eval.max_batches must be >= 0, got {cfg.eval.max_batches}")
    e = cfg.eval
    need(bool(e.tree_budgets) and all(isinstance(b, int) and b >= 1 for b in e.tree_budgets),
         f"eval.tree_budgets must be a list of draft-node budgets >= 1, e.g. [4, 8, 64], got {e.tree_budgets}")
    need(e.tau_budget >= 1, f"eval.tau_budget must be >= 1 draft node, got {e.tau_budget}")
    need(e.tau_every >= 0, f"eval.tau_every must be >= 0 (0: never), got {e.tau_every}")
    attn = cfg.target.attn_implementation or ""
    need(not (e.tau_every and attn.startswith(("flash_attention", "paged"))),
         f"eval.tau_every runs our engine on the target, whose tree mask target.attn_implementation={attn} cannot "
         "take: set target.attn_implementation=sdpa, or eval.tau_every=0 and measure tau after training with "
         "python -m inference.bench")
    need(e.tau_num_prompts >= 1, f"eval.tau_num_prompts must be >= 1, got {e.tau_num_prompts}")
    need(e.tau_max_new_tokens >= 1, f"eval.tau_max_new_tokens must be >= 1, got {e.tau_max_new_tokens}")
    if e.tau_prompts and (looks_local(e.tau_prompts) or Path(e.tau_prompts).exists()):
        need(Path(os.path.expanduser(e.tau_prompts)).exists(),
             f"eval.tau_prompts: file not found: {e.tau_prompts} (a prompts file or dataset; \"\" takes the held-out "
             "split's prompts)")
    held_out = cfg.data.eval_size > 0
    need(not e.tau_every or held_out or bool(e.tau_prompts),
         "eval.tau_every needs prompts: set eval.tau_prompts to a prompts file, or data.eval_size > 0 for the "
         "held-out split's")
    need(cfg.train.keep_best != "tau" or e.tau_every > 0,
         "train.keep_best=tau needs real-tau measurements: set eval.tau_every (e.g. eval.tau_every=100), or "
         "train.keep_best=expected_tau")
    need(cfg.train.keep_best in ("auto", "last") or not cfg.target.lora.r,
         f"train.keep_best={cfg.train.keep_best} keeps the best heads, but with target.lora the target's adapter "
         "trains too and is saved at the end only: use train.keep_best=last (the real tau is still logged)")
    need(cfg.train.keep_best != "expected_tau" or held_out,
         "train.keep_best=expected_tau needs a held-out split: set data.eval_size (e.g. 0.03), or train.keep_best=last")
    need(bool(cfg.output_dir), "output_dir is required")
    if cfg.resume not in ("auto", "none"):
        need(Path(cfg.resume).is_dir(), f"resume: checkpoint directory not found: {cfg.resume} "
                                        "(use auto, none, or a checkpoints/step-N path)")
