"""Unknown recipe keys: the key a user most likely meant ("did you mean train.lr?"), for the config's one-line error."""

from __future__ import annotations

import dataclasses
import difflib
import typing

from .errors import ConfigError


def all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys.append(prefix + f.name)
            keys += all_keys(hint, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


# Names other trainers use for our keys (HF TrainingArguments, torchtune, Medusa's own scripts): a key typed
# from habit, or misspelled from one, is pointed at ours.
_ALIASES = {
    "learning_rate": "train.lr", "per_device_train_batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum", "num_train_epochs": "train.epochs",
    "logging_steps": "train.log_every", "save_steps": "train.save_every", "save_total_limit": "train.keep_checkpoints",
    "gradient_clipping": "train.max_grad_norm", "clip_grad_norm": "train.max_grad_norm", "steps": "train.max_steps",
    "max_seq_length": "data.max_length", "max_seq_len": "data.max_length", "seq_len": "data.max_length",
    "dataset_name": "data.dataset", "model_name_or_path": "target.model", "torch_dtype": "target.dtype",
    "medusa_num_heads": "heads.num_heads", "medusa_num_layers": "heads.layers_per_head",
    "eval_steps": "eval.every", "kl_weight": "loss.distill_weight", "report_to": "tracking.backend",
    "wandb_project": "tracking.project",
}


def nearest_key(key: str, root: type) -> str | None:
    """The key of the config dataclass `root` that `key` most likely meant: its last part matched against the keys'
    last parts and the aliases above, a key in the same section (or the section it most likely meant) winning a tie."""
    hints = typing.get_type_hints(root)
    sections = [name for name, hint in hints.items() if dataclasses.is_dataclass(hint)]
    section, _, leaf = key.rpartition(".")
    section = (difflib.get_close_matches(section, sections, n=1, cutoff=0.6) or [section])[0]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in all_keys(root) if k not in sections} | _ALIASES
    score, best = max((difflib.SequenceMatcher(None, leaf, name).ratio()
                       + (0.05 if k.rpartition(".")[0] == section else 0.0), k) for name, k in by_leaf.items())
    return best if score >= 0.6 else None


def unknown_key_error(key: str, root: type) -> ConfigError:
    near = nearest_key(key, root)
    return ConfigError(f"unknown config key: {key}" + (f"; did you mean {near}?" if near else ""))
