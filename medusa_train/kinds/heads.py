"""What every kind of draft heads is: the interface a kind implements, the registry of kinds, the saved spec, the
target check, save and load.

Notation (docs/design.md): h_t is the target's final post-norm hidden state; head k (1-based) predicts x_{t+1+k}. In
code heads are indexed 0-based (`k = 0..K-1` is head k+1).

A kind is one module of this package: a `DraftHeads` subclass registered by name (`@register`), which says
everything about itself (docs/design.md, "A kind"):

- its recipe keys: `Options`, a dataclass of its own `heads.*` keys (the recipe's `HeadsConfig` is made of every
  kind's), checked by `check_options`, resolved for a target by `resolve` (an `auto` or unset value made concrete)
  and saved, resolved, in the heads' config.json;
- how it is built for a target: `__init__(spec)`, `layer_config` (the transformers config of its layers, if any) and
  `init_from_target` (what it starts as: copies of the target's rows);
- what it reads of the target: `target_layers` (layers whose states follow h_t in its input, `feature_size` wide);
- its training forward: `forward` (teacher-forced states at every position) and `training_states` (those a step
  trains: every position, or some of them);
- how it scores: `scoring_weight`, `owns_lm_head`, `score`;
- its drafter for the engine: `drafting` returns a `Drafting`, which the engine's `HeadsDrafter` asks for each level
  of the tree;
- its exports: `exports`, the formats it can be written in, each with what it needs and its writer;
- its identity: `describe` (in refusals), and the options a warm start must match (all but `training_options`).

Everything else (the trainer, the engine, the export command, the preflight) asks the heads or `kind_class(name)`,
never a kind's name. By default heads use the target's frozen embedding and LM head, passed in at call time (never
stored here, so checkpoints hold only head weights).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..base.errors import ConfigError, ExportError
from ..base.files import CONFIG_NAME, WEIGHTS_NAME, atomic_write, atomic_write_text, is_heads_dir
from ..target.model import decoder_layers, fingerprint_difference, target_fingerprint, text_config

FORMAT_VERSION = 1

KINDS: dict[str, type[DraftHeads]] = {}
"""heads.kind -> its class, in the order the kinds were registered (`medusa_train.kinds` imports them all)."""


def register(cls: type[DraftHeads]) -> type[DraftHeads]:
    """Class decorator: make `cls` the kind named `cls.kind`."""
    if not cls.kind or cls.kind in KINDS:
        raise ValueError(f"a kind needs a name of its own, got {cls.kind!r}")
    KINDS[cls.kind] = cls
    return cls


def kind_class(name: str) -> type[DraftHeads]:
    """The class of heads.kind `name`; ConfigError (one line, the kinds listed) for an unknown one."""
    if name not in KINDS:
        raise ConfigError(f"heads.kind must be one of {' | '.join(repr(k) for k in KINDS)}, got {name!r}")
    return KINDS[name]


class HeadsMismatchError(ValueError):
    """Heads were trained for another target (hidden size, vocab size or weights differ)."""


def check_fingerprint(expected: dict[str, Any], target: nn.Module, target_name: str = "") -> None:
    """Raise HeadsMismatchError naming the first property in which `target` differs from `expected`."""
    diff = fingerprint_difference(expected, target_fingerprint(target), target)
    if diff is not None:
        where = f" (heads were trained for {target_name})" if target_name else ""
        raise HeadsMismatchError(f"heads do not fit this target: {diff}{where}")


# ---------------------------------------------------------------------------------------------------
# The spec: what rebuilds the heads, saved as config.json next to the weights


@dataclass
class HeadsSpec:
    """Everything needed to rebuild the heads: the fields every kind has, and the kind's own `options` (resolved), which
    config.json keeps beside them (flat) and which read as fields here (`spec.aux_layers`)."""

    kind: str
    num_heads: int
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int = 0
    layer_config: dict[str, Any] = field(default_factory=dict)
    """The transformers config of the kind's own decoder layers (eagle3: a LlamaConfig, dflash: a Qwen3Config), as the
    diff dict speculators writes; {} for kinds without such layers."""
    target_name: str = ""
    target_fingerprint: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    options: Any = None
    """The kind's `Options`, resolved (no `auto` left)."""

    def __post_init__(self) -> None:
        if self.options is None:
            self.options = kind_class(self.kind).Options()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "options":  # copies and unpickling look these up before they exist
            raise AttributeError(name)
        try:
            return getattr(self.options, name)
        except AttributeError:
            raise AttributeError(f"{self.kind} heads have no {name!r}") from None

    @property
    def scored_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    def to_json(self) -> dict[str, Any]:
        """config.json's content: the common fields, then the kind's options."""
        common = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return common | dataclasses.asdict(self.options)


def make_spec(kind: str, **fields: Any) -> HeadsSpec:
    """A spec from flat fields, as config.json holds them: the common ones, and the kind's options (the rest). Fields of
    other kinds (heads saved before the kinds had options of their own kept every kind's) are passed over."""
    cls = kind_class(kind)
    common = {f.name for f in dataclasses.fields(HeadsSpec)} - {"kind", "options"}
    own = {f.name for f in dataclasses.fields(cls.Options)}
    options = cls.saved_options({k: v for k, v in fields.items() if k in own})
    return HeadsSpec(kind=kind, options=options, **{k: v for k, v in fields.items() if k in common})


def load_spec(directory: str | os.PathLike) -> HeadsSpec:
    """The heads' config.json; FileNotFoundError if `directory` is not a heads directory."""
    if not is_heads_dir(directory):
        raise FileNotFoundError(f"{directory} is not a heads directory: expected {CONFIG_NAME} and {WEIGHTS_NAME} "
                                "(written by train.py)")
    raw = json.loads((Path(directory) / CONFIG_NAME).read_text())
    if raw.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{directory} was written by a newer medusa-train (format {raw['format_version']})")
    missing = [k for k in ("kind", "num_heads", "hidden_size", "vocab_size") if k not in raw]
    if missing:
        raise ValueError(f"{Path(directory) / CONFIG_NAME} is not a draft heads config (no {', '.join(missing)}): "
                         "is this a model directory? Name the directory train.py wrote the heads to")
    if raw["kind"] not in KINDS:
        raise ValueError(f"{Path(directory) / CONFIG_NAME} holds {raw['kind']!r} heads, which this medusa-train does "
                         f"not know (it knows {', '.join(KINDS)})")
    adapter = (raw.get("target_fingerprint") or {}).get("adapter")
    if adapter and not Path(os.path.expanduser(adapter["path"])).is_absolute():  # saved next to the heads (target.lora)
        adapter["path"] = str(Path(directory).resolve() / adapter["path"])
    return make_spec(**raw)


# ---------------------------------------------------------------------------------------------------
# What the engine and the export command ask of a kind


class Drafting:
    """A kind's drafting, as the engine's `HeadsDrafter` (inference.engine.drafters) asks for it: the tree is built
    level by level, and level k's candidates come from `step(k, ...)`.

    `per_node`: a level's candidates depend on each node's own token and state (chained, eagle3); False: every node of
    a level shares one distribution (parallel, dflash), computed once a step. `needs_history`: the engine passes every
    committed position to `observe` (after the prefill with the whole prompt, then after every step). `score(k, s)` is
    the engine's scorer: head k's logits over the scored vocabulary for states s [M, d], on the fastest kernel it has.
    """

    per_node = True
    needs_history = False

    def __init__(self, heads: DraftHeads, embed: nn.Module, score: Callable[[int, torch.Tensor], torch.Tensor],
                 dtype: torch.dtype):
        self.heads, self.embed, self.score, self.dtype = heads, embed, score, dtype

    def reset(self) -> None:
        """A new sequence starts: drop what `observe` kept."""

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """n newly committed positions, in order: hidden [n, feature_size] (h, then the states at `target_layers`),
        next_tokens [n] the token that follows each (the last one is the next root)."""

    def root(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """The root's drafting state [1, ...] (None for none) from its token [1] and h at its predecessor [d]."""
        raise NotImplementedError

    def step(self, k: int, tokens: torch.Tensor, states: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Level k+1 from M nodes at depth k (their tokens [M], states [M, ...]): (logits [M, V'] over the scored
        vocabulary, or [1, V'] when every node shares them, and the children's states [M, ...] or None)."""
        raise NotImplementedError

    def confidence(self, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor | None:
        """The step's tree (nodes' tokens, parents, depths [N]) -> each node's chance of acceptance given its parent's
        [N] (the root's NaN), as a confidence head predicts it for the parent's best child; None for kinds without one.
        Called after `step`s of the same tree."""
        return None


@dataclass
class ExportSource:
    """What an export writer may read besides the heads, each read only when asked: `embedding()` and `lm_head()` the
    target's weights [V, d] (checked against the heads; read from its checkpoint where it can be, without loading the
    model), `architectures()` its config's architectures, `verifier` its name on the serving machine, `embed` whether
    to include its embedding."""

    embedding: Callable[[], torch.Tensor]
    lm_head: Callable[[], torch.Tensor]
    architectures: Callable[[], list[str]]
    verifier: str
    embed: bool = True


@dataclass(frozen=True)
class Export:
    """A format a kind's heads are written in. `needs`: the spec values it holds (recipe keys: a value, or a tuple of
    values); `refuse(spec)`: any further reason it cannot hold them (None: it can); `write(heads, source)`: its
    config.json content and tensors."""

    serves: str
    write: Callable[[DraftHeads, ExportSource], tuple[dict[str, Any], dict[str, torch.Tensor]]]
    needs: dict[str, Any] = field(default_factory=dict)
    refuse: Callable[[HeadsSpec], str | None] | None = None


# ---------------------------------------------------------------------------------------------------
# The interface


@dataclass
class NoOptions:
    """A kind with no recipe keys of its own."""


class DraftHeads(nn.Module):
    """K draft heads on a frozen target, of one kind (the subclass `kind_class(spec.kind)`: `DraftHeads(spec)` builds
    it). Holds only head weights; target modules are passed in."""

    kind: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    training_options: ClassVar[tuple[str, ...]] = ()
    """Options that shape training only: a warm start takes them from the recipe instead of matching them."""
    exports: ClassVar[dict[str, Export]] = {}
    served_by_plugin: ClassVar[bool] = False
    """Whether our vLLM plugin (`inference/vllm_plugin.py`) serves the kind: heads that read the target's last state
    h_t alone, as vLLM hands a custom proposer; the others are exported and served by vLLM's own method."""
    recomputes: ClassVar[bool] = False
    """Whether `train.activation_checkpointing` applies: the kind has draft layers whose activations `checkpointed`
    recomputes in backward (set on the heads as `recompute` for a training run)."""
    recompute: bool = False
    loss_defaults: ClassVar[dict[str, float]] = {}
    """`loss.*` values the kind trains with where the recipe does not set them (dspark: its paper's objective)."""
    train_defaults: ClassVar[dict[str, float]] = {}
    """`train.*` values the kind trains with where the recipe does not set them (chained: its warm-up, chosen on the
    panel)."""

    @classmethod
    def default_lr(cls, hidden_size: int) -> float:
        """`train.lr: auto` for a target of this width."""
        return 1e-3

    def __new__(cls, spec: HeadsSpec | None = None, *args: Any, **kwargs: Any):
        if cls is DraftHeads and spec is not None:  # (copies and unpickling pass no spec: they name the subclass)
            cls = kind_class(spec.kind)
        return super().__new__(cls)

    def __init__(self, spec: HeadsSpec):
        super().__init__()
        self.spec = spec
        # draft id -> target id; an identity map (length 0) when the heads score the full vocabulary.
        self.register_buffer("draft_ids", torch.zeros(spec.draft_vocab_size, dtype=torch.long))

    # -- the recipe -----------------------------------------------------------------------------------

    @classmethod
    def options_from(cls, heads_config: Any) -> Any:
        """This kind's `Options` as the recipe's heads section writes them (auto values kept)."""
        return cls.Options(**{f.name: copy.deepcopy(getattr(heads_config, f.name))
                              for f in dataclasses.fields(cls.Options)})

    @classmethod
    def check_options(cls, options: Any) -> None:
        """ConfigError (one line, naming the key) for options out of range, read from the recipe alone."""

    @classmethod
    def check_target(cls, options: Any, target_config: Any, trust_remote_code: bool = False) -> None:
        """ConfigError for options this target cannot take, from its config alone (before it loads)."""

    @classmethod
    def resolve(cls, options: Any, target_config: Any, embedding: torch.Tensor | None = None, tokenizer: Any = None
                ) -> Any:
        """`options` with every auto or unset value made concrete for a target of this config (its embedding
        [V, d] and tokenizer when loaded; without them, placeholders of the same size)."""
        return options

    @classmethod
    def saved_options(cls, saved: dict[str, Any]) -> Any:
        """The options of heads saved with these values (config.json; keys missing from older files take their
        default)."""
        return cls.Options(**saved)

    @classmethod
    def layer_config(cls, options: Any, target_config: Any) -> dict[str, Any]:
        """The transformers config of the kind's own layers for a target of this config ({}: none)."""
        return {}

    # -- construction ---------------------------------------------------------------------------------

    @classmethod
    def for_target(cls, target: nn.Module, kind: str = "chained", num_heads: int = 4,
                   layers_per_head: int | None = None, *, draft_ids: torch.Tensor | None = None,
                   target_name: str = "", tokenizer: Any = None, **options: Any) -> DraftHeads:
        """Fresh heads of `kind` sized for `target`, `options` being the kind's own (`Options`; unset or auto ones
        resolved for this target, as the trainer does). `draft_ids`: the target ids of a draft vocabulary.
        `layers_per_head`: the kind's blocks or layers per head. As in a recipe, another kind's option at its default is
        passed over (so one call can make heads of every kind)."""
        heads_cls = kind_class(kind)
        own = {f.name for f in dataclasses.fields(heads_cls.Options)}
        if layers_per_head is not None:
            options["layers_per_head"] = layers_per_head
        for name in sorted(set(options) - own):
            if options.pop(name) != _option_default(name):
                raise ValueError(f"{kind} heads take no option {name!r} (theirs: {', '.join(sorted(own)) or 'none'})")
        emb = target.get_input_embeddings().weight
        resolved = heads_cls.resolve(heads_cls.Options(**options), target.config, emb, tokenizer)
        spec = HeadsSpec(kind=kind, num_heads=num_heads, hidden_size=emb.shape[1],
                         vocab_size=target.get_output_embeddings().weight.shape[0],
                         draft_vocab_size=0 if draft_ids is None else len(draft_ids),
                         layer_config=heads_cls.layer_config(resolved, target.config), target_name=target_name,
                         target_fingerprint=target_fingerprint(target), options=resolved)
        heads = heads_cls(spec)
        with torch.no_grad():
            heads.init_from_target(target, draft_ids)
        return heads

    def init_from_target(self, target: nn.Module, draft_ids: torch.Tensor | None) -> None:
        """What fresh heads start as, from the target (no grad): here, the draft vocabulary's ids."""
        if draft_ids is not None:
            self.draft_ids.copy_(draft_ids)

    # -- what it reads, and how it scores --------------------------------------------------------------

    @property
    def target_layers(self) -> list[int]:
        """Target layers whose states follow h_t in the heads' input (layer i: the input of decoder layer i)."""
        return []

    @property
    def feature_size(self) -> int:
        """Width of the target states the heads read per position: h_t, then the `target_layers`' states."""
        return self.spec.hidden_size * (1 + len(self.target_layers))

    @property
    def owns_lm_head(self) -> bool:
        """Whether the heads score with LM heads of their own (else the target's, passed in at call time)."""
        return False

    def scoring_weight(self, k: int, lm_head: nn.Module | None = None) -> torch.Tensor:
        """The [V_scored, d] matrix head k's logits come from: the target's LM head (rows of the draft vocabulary if
        set), unless the kind has its own. Callers that score often may gather it once and keep it."""
        if lm_head is None:
            raise ValueError("these heads use the target's LM head: pass lm_head=target.get_output_embeddings()")
        return lm_head.weight[self.draft_ids] if self.spec.draft_vocab_size else lm_head.weight

    def logits(self, k: int, states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Head k's logits over the scored vocabulary (the draft vocab if set): [..., V_draft]."""
        return F.linear(states, self.scoring_weight(k, lm_head))

    def score(self, k: int, states: torch.Tensor) -> torch.Tensor:
        """Head k's logits from the states its drafting passes on, for kinds that own their LM head (the engine
        scores the others with the target's)."""
        return self.logits(k, states)

    def extra_scoring_weight(self) -> torch.Tensor | None:
        """[V_scored, r]: a matrix of the kind's own scoring the r columns its training states carry past
        `hidden_size` (a logit bias added to the LM head's: dspark's Markov head); None: states are hidden_size wide."""
        return None

    @property
    def has_confidence(self) -> bool:
        """Whether the heads predict their own acceptance (`confidence`)."""
        return False

    def confidence(self, k: int, states: torch.Tensor) -> torch.Tensor | None:
        """Head k's predicted log-odds [n] that its token at training states [n, ...] is accepted (a confidence head,
        trained to the acceptance rate sum_v min(p_v, q_v)); None for kinds without one."""
        return None

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Map indices into the scored vocabulary back to target token ids."""
        return self.draft_ids[ids] if self.spec.draft_vocab_size else ids

    def embed_tokens(self, token_ids: torch.Tensor, embed: nn.Module | None) -> torch.Tensor:
        if getattr(self, "embed", None) is not None:
            return self.embed(token_ids)
        if embed is None:
            raise ValueError("these heads use the target's embedding: pass embed=target.get_input_embeddings()")
        return embed(token_ids)

    # -- training -------------------------------------------------------------------------------------

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module | None = None) -> torch.Tensor:
        """Teacher-forced states [K, B, T, d] for the target's features h [B, T, feature_size]: states[k, :, t] is head
        k+1's state at position t, having read tokens up to x_{t+k+1}, which its scoring turns into logits for
        x_{t+k+2} (positions past the end see padding; mask them)."""
        raise NotImplementedError

    def checkpointed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), keeping only its inputs and outputs for backward (which runs it again) when `recompute` is on
        and gradients are being recorded."""
        if self.recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def training_states(self, h: torch.Tensor, input_ids: torch.Tensor, supervised: torch.Tensor,
                        attention_mask: torch.Tensor | None, embed: nn.Module | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What a training step scores: (states [K, B, N, d], their positions [B, N] and which are real [B, N]), or
        (states at every position [K, B, T, d], None, None). `supervised` [B, T] marks tokens with a label."""
        return self(h, input_ids, embed), None, None

    # -- the engine -----------------------------------------------------------------------------------

    def drafting(self, embed: nn.Module, score: Callable[[int, torch.Tensor], torch.Tensor], dtype: torch.dtype
                 ) -> Drafting:
        """The engine's view of these heads (`Drafting`)."""
        raise NotImplementedError

    # -- identity -------------------------------------------------------------------------------------

    @classmethod
    def describe(cls, spec: HeadsSpec) -> str:
        """The heads' kind and what sets them apart, as recipe keys (`distinctions`)."""
        extra = cls.distinctions(spec)
        return f"{spec.kind} heads" + (f" ({', '.join(extra)})" if extra else "")

    @classmethod
    def distinctions(cls, spec: HeadsSpec) -> list[str]:
        """`heads.key=value` for the options set away from a default of their own (not from an `auto` one, which every
        target resolves differently), and the draft vocabulary where one of the kind's formats cares."""
        defaults = cls.Options()
        extra = [f"heads.{f.name}={key_value(getattr(spec.options, f.name))}" for f in dataclasses.fields(cls.Options)
                 if f.name not in cls.training_options and getattr(defaults, f.name) not in (None, "auto", [])
                 and getattr(spec.options, f.name) != getattr(defaults, f.name)]
        if spec.draft_vocab_size and any("draft_vocab_size" in e.needs for e in cls.exports.values()):
            extra.append(f"heads.draft_vocab_size={spec.draft_vocab_size}")
        return extra

    # -- save / load ----------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """Write config.json and model.safetensors (heads only). Both are written to temp files first and
        renamed, so a crash never leaves a half-written file under the final name."""
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        config = self.spec.to_json() | (extra or {})
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
        atomic_write_text(path / CONFIG_NAME, json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, target: nn.Module | None = None,
                        device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> DraftHeads:
        """Load heads; with `target`, first check they were trained for it (HeadsMismatchError if not)."""
        from safetensors.torch import load_file

        path = Path(directory)
        spec = load_spec(path)
        if target is not None:
            check_fingerprint(spec.target_fingerprint, target, spec.target_name)
        heads = DraftHeads(spec)
        try:
            state = load_file(str(path / WEIGHTS_NAME))
        except Exception as e:  # noqa: BLE001 - safetensors reports a damaged file in several error types
            raise ValueError(f"{path / WEIGHTS_NAME} cannot be read ({str(e).splitlines()[0][:120]}): the file is "
                             "damaged or incomplete; train again or use a checkpoint") from None
        bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise ValueError(f"{path / WEIGHTS_NAME} holds non-finite weights ({bad[0]}): these heads diverged in "
                             "training; use an earlier checkpoint or retrain with a lower train.lr")
        heads.load_state_dict(state)
        return heads.to(device=device, dtype=dtype) if (device or dtype) else heads


def _option_default(name: str) -> Any:
    """The default of the option `name` in the kinds that have it (a sentinel where none has it)."""
    for kind in KINDS.values():
        for f in dataclasses.fields(kind.Options):
            if f.name == name:
                return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return object()


def key_value(value: Any) -> str:
    """A recipe value as a dotted override writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


# ---------------------------------------------------------------------------------------------------
# Kinds that read the target's layers (eagle3, dflash)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default layers [2, L//2, L-3] (a layer id i is the input of decoder layer i, as vLLM and speculators
    count), or, for targets too shallow for those to be distinct, up to three evenly spaced distinct ids in [1, L]."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 1:
        return ids
    n = min(3, num_layers)
    return sorted({round(1 + i * (num_layers - 1) / max(n - 1, 1)) for i in range(n)})


@dataclass
class TargetLayersOptions:
    aux_layers: list[int] = field(default_factory=list)
    """eagle3 and dflash: the target layers they read (layer i: the input of decoder layer i, as vLLM counts for
    eagle3 and speculators' dflash configs). Empty: EAGLE-3's default [2, L//2, L-3] for a target of L layers."""


def check_aux_layers(aux_layers: list[int]) -> None:
    if not (all(i >= 0 for i in aux_layers) and len(set(aux_layers)) == len(aux_layers)):
        raise ConfigError(f"heads.aux_layers must be distinct layer ids >= 0, got {aux_layers}")


def check_target_layers(kind: str, aux_layers: list[int], target_config: Any, trust_remote_code: bool = False
                        ) -> None:
    """ConfigError unless the target has the layers `aux_layers` name and they can be found in its module tree (built
    on the meta device: no memory), so heads that read them never fail after an hour of training."""
    from transformers import AutoModelForCausalLM

    layers = getattr(text_config(target_config), "num_hidden_layers", None)
    if aux_layers and layers is not None and max(aux_layers) > layers:
        raise ConfigError(f"heads.aux_layers={aux_layers}: the target has {layers} layers, so ids go from 0 to "
                          f"{layers}; pick ids in that range (or leave it empty for EAGLE-3's default)")
    try:
        with torch.device("meta"):
            decoder_layers(AutoModelForCausalLM.from_config(target_config, trust_remote_code=trust_remote_code))
    except ValueError as e:
        raise ConfigError(f"heads.kind={kind}: {e}; use heads.kind=chained for this target") from None


def resolved_aux_layers(aux_layers: list[int], target_config: Any) -> list[int]:
    return list(aux_layers or default_aux_layers(text_config(target_config).num_hidden_layers))


__all__ = ["KINDS", "DraftHeads", "Drafting", "Export", "ExportError", "ExportSource", "HeadsMismatchError",
           "HeadsSpec", "check_fingerprint", "default_aux_layers", "kind_class", "load_spec", "make_spec", "register"]
