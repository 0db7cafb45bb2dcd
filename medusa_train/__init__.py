"""medusa-train: train draft heads on a frozen Hugging Face causal LM. The folders are the pipeline:

    base/     errors and atomic file writes, which every room uses
    target/   the frozen target: loading, hidden states, their cache, sharding, states from vLLM
    kinds/    the draft head kinds (chained, parallel, eagle3, dflash), each one module behind one interface
    config    the recipe: typed dataclasses the YAML mirrors (each kind's own keys come from its module)
    data/     training rows: formats, chat templates, prompt pools, self-written prompts, distillation
    train/    the run: setup, the loop, losses, evaluation, checkpoints, the real tau, processes
    export    trained heads in the formats serving engines load
    demo      the main job end to end on the offline default

Modules that lived at the top before the folders (`medusa_train.heads`, `python -m medusa_train.distill`, ...) are
still found under their old names: `MOVED` maps each to its new home. Only the standard library is imported here, as
vLLM's own venv runs `medusa_train.target.vllm_extract` with nothing else of ours installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

MOVED = {f"medusa_train.{old}": f"medusa_train.{new}" for old, new in {
    "errors": "base.errors", "files": "base.files",
    "target_states": "target.states", "sharding": "target.sharding", "prepare": "target.prepare",
    "vllm_states": "target.vllm_states", "vllm_extract": "target.vllm_extract",
    "vllm_cpu_connector": "target.vllm_cpu_connector",
    "chat": "data.chat", "formats": "data.formats", "prompts": "data.prompts", "self_prompts": "data.self_prompts",
    "batch_decode": "data.batch_decode", "distill": "data.distill",
    "heads": "kinds.heads", "eagle3": "kinds.eagle3", "dflash": "kinds.dflash",
    "losses": "train.losses", "joint": "train.joint", "evaluate": "train.evaluate", "checkpoints": "train.checkpoints",
    "preflight": "train.preflight", "metrics": "train.metrics", "optim": "train.optim", "processes": "train.processes",
    "divergence": "train.divergence", "tau": "train.tau", "best": "train.best", "run": "train.run",
    "trainer": "train.trainer", "cli": "train.cli",
}.items()}
"""Old module name -> where it lives now. (`medusa_train.target` and `medusa_train.data` are the new folders' names:
the modules they were are `medusa_train.target.model` and `medusa_train.data.rows`.)"""


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Imports an old name as the module itself (one module object under both names, never a second copy), and runs
    `python -m OLD` as `python -m NEW`."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self._own_spec = module.__spec__  # the import system sets __spec__ to ours: put its own back below
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_spec

    def get_source(self, name):  # `python -m OLD`: run the new module as __main__, with the same arguments
        return f"import runpy\nrunpy.run_module({MOVED[name]!r}, run_name='__main__', alter_sys=True)\n"


if not any(isinstance(f, _OldNames) for f in sys.meta_path):
    sys.meta_path.append(_OldNames())
