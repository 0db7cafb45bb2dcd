"""The house rule (docs/design.md, "Layout"): every module of the two packages belongs to one room, a room imports
only from the rooms below it (and its own), the engine's files import only the rungs of its ladder below them, and
no two modules import each other, directly or through others. Imports inside functions count: a lazy import is a
dependency all the same. Read from the source (ast), so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> its modules; the rooms are listed bottom up
ROOMS = {
    "base": ["medusa_train.errors", "medusa_train.files", "medusa_train.config"],
    "target and data": ["medusa_train.target", "medusa_train.chat", "medusa_train.formats", "medusa_train.data",
                        "medusa_train.prompts", "medusa_train.self_prompts", "medusa_train.batch_decode"],
    "heads": ["medusa_train.dflash", "medusa_train.eagle3", "medusa_train.heads", "medusa_train.losses",
              "medusa_train.target_states"],
    "engine": ["inference.engine.tree", "inference.engine.kernels", "inference.engine.kv", "inference.engine.verify",
               "inference.engine.support", "inference.engine.calibrate", "inference.engine.choice",
               "inference.engine.drafters", "inference.engine.bigram",
               "inference.engine.compiled", "inference.engine.budget", "inference.engine.generator"],
    "training": ["medusa_train.joint", "medusa_train.evaluate", "medusa_train.checkpoints", "medusa_train.preflight",
                 "medusa_train.metrics", "medusa_train.optim", "medusa_train.processes", "medusa_train.divergence",
                 "medusa_train.tau", "medusa_train.best", "medusa_train.sharding", "medusa_train.run",
                 "medusa_train.trainer"],
    "commands": ["medusa_train.cli", "medusa_train.distill", "medusa_train.export", "medusa_train.prepare",
                 "medusa_train.demo", "medusa_train.vllm_states", "medusa_train.vllm_extract",
                 "medusa_train.vllm_cpu_connector", "inference.generate"],
    "instruments": ["inference.bench", "inference.oracle", "inference.profile_step"],
    "packages": ["medusa_train", "inference", "inference.engine"],
}
BELOW = {  # what each room may import besides itself
    "base": [],
    "target and data": ["base"],
    "heads": ["base", "target and data"],
    "engine": ["base", "target and data", "heads"],  # never the trainer: serving needs no training code
    "training": ["base", "target and data", "heads", "engine"],  # scoring heads as the engine serves them
    "commands": ["base", "target and data", "heads", "training", "engine"],
    "instruments": ["base", "target and data", "heads", "engine", "commands", "packages"],
    "packages": ["engine"],  # `inference` names the engine's public classes
}
LADDER = ROOMS["engine"]  # bottom up: a rung imports only the rungs below it


def module_files() -> dict[str, Path]:
    files = {}
    for package in ("medusa_train", "inference"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its source, lazy imports and string-named lazy exports
    (`inference/__init__.py`) included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif (path.name == "__init__.py" and isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value.startswith("inference.")):
            targets = [node.value.rstrip(".")]
        for t in targets:
            while t and t not in known:  # `from inference.engine.kv import new_cache` -> inference.engine.kv
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    # importing `a.b.c` runs the packages `a` and `a.b` too, which every module does; they are not edges
    return {t for t in found if not name.startswith(t + ".")}


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def room_of() -> dict[str, str]:
    return {m: room for room, modules in ROOMS.items() for m in modules}


def test_every_module_has_a_room():
    """A new file must be placed: an unplaced module would escape the rules below."""
    rooms = room_of()
    assert sorted(set(graph()) - set(rooms)) == [], "add the module to a room in tests/test_layout.py and design.md"
    assert sorted(set(rooms) - set(graph())) == [], "a room names a module that does not exist"


def test_no_upward_import():
    rooms, bad = room_of(), []
    for name, deps in graph().items():
        for dep in deps:
            if rooms[dep] != rooms[name] and rooms[dep] not in BELOW[rooms[name]]:
                bad.append(f"{name} ({rooms[name]}) imports {dep} ({rooms[dep]})")
    assert bad == []


def test_the_engine_is_a_ladder():
    bad = [f"{name} imports {dep}, a rung above it" for name, deps in graph().items() if name in LADDER
           for dep in deps if dep in LADDER and LADDER.index(dep) > LADDER.index(name)]
    assert bad == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_circle():
    assert cycles(graph()) == []


def test_the_checks_see_what_they_check():
    """The checks above fail on the faults they exist for: a planted circle, an upward import and an engine rung
    reaching up are each seen (so an import reader that saw nothing would not pass them)."""
    g = graph()
    assert "medusa_train.target" in g["medusa_train.heads"]  # relative imports are read
    assert "medusa_train.heads" in g["medusa_train.run"]
    assert "inference.engine.verify" in g["inference.engine.generator"]  # absolute, multi-line
    assert "inference.engine.budget" in g["inference.engine.generator"]  # `import a.b as c`
    assert "medusa_train.eagle3" in g["medusa_train.heads"]  # an import inside a function
    assert "inference.engine.generator" in g["inference"]  # a lazy export named in a string
    planted = {k: set(v) for k, v in g.items()}
    planted["medusa_train.target"].add("medusa_train.heads")
    assert any({"medusa_train.heads", "medusa_train.target"} <= set(c) for c in cycles(planted))
    rooms = room_of()
    assert rooms["medusa_train.trainer"] not in BELOW[rooms["inference.engine.drafters"]]
    assert LADDER.index("inference.engine.generator") > LADDER.index("inference.engine.tree")


@pytest.mark.parametrize("limit_file,limit", [("medusa_train/trainer.py", 300)])
def test_the_loop_reads_in_one_sitting(limit_file, limit):
    """The trainer's loop file stays a loop (its rooms are beside it); no module grows past ~650 lines."""
    assert len((ROOT / limit_file).read_text().splitlines()) <= limit
    long = {str(p.relative_to(ROOT)): n for p in module_files().values()
            if (n := len(p.read_text().splitlines())) > 650}
    assert long == {}
