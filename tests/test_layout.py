"""The house rule (docs/design.md, "Layout"): every module of the two packages belongs to one room, a room imports
only from the rooms below it (and its own), the engine's files import only the rungs of its ladder below them, and
no two modules import each other, directly or through others. Imports inside functions count: a lazy import is a
dependency all the same; imports only for type hints (`if TYPE_CHECKING:`) do not. Read from the source (ast), so
nothing is imported to check it. And a kind is a place, not a string: outside the kinds' own modules no code
compares anything with a kind's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIND_NAMES = ("chained", "parallel", "eagle3", "dflash", "dspark")

# room -> its modules; the rooms are listed bottom up. The folders (medusa_train/base, target, kinds, data, train) say
# what a module is about; the rooms say what it may build on.
ROOMS = {
    "base": ["medusa_train.base.errors", "medusa_train.base.files", "medusa_train.base.keys"],
    "target": ["medusa_train.target.model", "medusa_train.target.weights", "medusa_train.target.states"],
    "kinds": ["medusa_train.kinds", "medusa_train.kinds.heads", "medusa_train.kinds.attention",
              "medusa_train.kinds.blocks",
              "medusa_train.kinds.speculators", "medusa_train.kinds.chained", "medusa_train.kinds.parallel",
              "medusa_train.kinds.eagle3", "medusa_train.kinds.dflash", "medusa_train.kinds.dspark"],
    "recipe": ["medusa_train.config"],
    "data": ["medusa_train.data.chat", "medusa_train.data.formats", "medusa_train.data.rows",
             "medusa_train.data.distilled",
             "medusa_train.data.prompts", "medusa_train.data.self_prompts", "medusa_train.data.batch_decode",
             "medusa_train.data.vllm_generate"],
    "engine": ["inference.engine.tree", "inference.engine.kernels", "inference.engine.kv", "inference.engine.verify",
               "inference.engine.support", "inference.engine.calibrate", "inference.engine.choice",
               "inference.engine.drafters", "inference.engine.bigram",
               "inference.engine.compiled", "inference.engine.budget", "inference.engine.generator"],
    "training": ["medusa_train.train.losses", "medusa_train.train.joint", "medusa_train.train.evaluate",
                 "medusa_train.train.checkpoints", "medusa_train.train.preflight", "medusa_train.train.metrics",
                 "medusa_train.train.optim", "medusa_train.train.processes", "medusa_train.train.divergence",
                 "medusa_train.train.tau", "medusa_train.train.best", "medusa_train.target.sharding",
                 "medusa_train.train.run", "medusa_train.train.trainer"],
    "serving": ["inference.vllm_drafts", "inference.vllm_dspark", "inference.vllm_plugin"],
    "commands": ["medusa_train.train.cli", "medusa_train.data.distill", "medusa_train.export",
                 "medusa_train.target.prepare", "medusa_train.demo", "medusa_train.target.vllm_states",
                 "medusa_train.target.vllm_extract", "medusa_train.target.vllm_cpu_connector", "inference.generate"],
    "instruments": ["inference.bench", "inference.oracle", "inference.profile_step"],
    "packages": ["medusa_train", "medusa_train.base", "medusa_train.target", "medusa_train.data", "medusa_train.train",
                 "inference", "inference.engine"],
}
BELOW = {  # what each room may import besides itself
    "base": [],
    "target": ["base"],
    "kinds": ["base", "target"],
    "recipe": ["base", "target", "kinds"],  # the recipe's heads section is made of the kinds' own keys
    "data": ["base", "target", "recipe"],
    "engine": ["base", "target", "kinds", "recipe", "data"],  # never the trainer: serving needs no training code
    "training": ["base", "target", "kinds", "recipe", "data", "engine"],  # scoring heads as the engine serves them
    # runs inside vLLM's venv: our heads and the engine's calibration and step choice (torch and NumPy), no recipe
    "serving": ["base", "target", "kinds", "engine"],
    "commands": ["base", "target", "kinds", "recipe", "data", "training", "engine"],
    "instruments": ["base", "target", "kinds", "recipe", "data", "engine", "commands", "packages"],
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
    for node in ast.walk(tree):  # type-only imports are not run: drop them before reading the rest
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            node.body = []
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
    assert "medusa_train.target.model" in g["medusa_train.kinds.heads"]  # relative imports are read
    assert "medusa_train.kinds.heads" in g["medusa_train.train.run"]
    assert "medusa_train.kinds" in g["medusa_train.config"]  # a package's own names
    assert "inference.engine.verify" in g["inference.engine.generator"]  # absolute, multi-line
    assert "inference.engine.budget" in g["inference.engine.generator"]  # `import a.b as c`
    assert "medusa_train.train.trainer" in g["medusa_train.train.cli"]  # an import inside a function
    assert "medusa_train.config" not in g["medusa_train.target.model"]  # one for type hints only
    assert "inference.engine.generator" in g["inference"]  # a lazy export named in a string
    planted = {k: set(v) for k, v in g.items()}
    planted["medusa_train.target.model"].add("medusa_train.kinds.heads")
    assert any({"medusa_train.kinds.heads", "medusa_train.target.model"} <= set(c) for c in cycles(planted))
    rooms = room_of()
    assert rooms["medusa_train.train.trainer"] not in BELOW[rooms["inference.engine.drafters"]]
    assert LADDER.index("inference.engine.generator") > LADDER.index("inference.engine.tree")


@pytest.mark.parametrize("limit_file,limit", [("medusa_train/train/trainer.py", 300)])
def test_the_loop_reads_in_one_sitting(limit_file, limit):
    """The trainer's loop file stays a loop (its rooms are beside it); no module grows past ~650 lines."""
    assert len((ROOT / limit_file).read_text().splitlines()) <= limit
    long = {str(p.relative_to(ROOT)): n for p in module_files().values()
            if (n := len(p.read_text().splitlines())) > 650}
    assert long == {}


def kind_comparisons(source: str) -> list[int]:
    """Lines where `source` compares something with a kind's name (`x == "eagle3"`, `kind in ("eagle3", "dflash")`,
    `{"eagle3": ...}.get(kind)`): a branch on the head kind."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                names = [side] if isinstance(side, ast.Constant) else getattr(side, "elts", [])
                if any(isinstance(n, ast.Constant) and n.value in KIND_NAMES for n in names):
                    lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and isinstance(node.func.value, ast.Dict)
              and any(isinstance(k, ast.Constant) and k.value in KIND_NAMES for k in node.func.value.keys)):
            lines.append(node.lineno)
    return lines


def test_no_branch_on_a_kind_outside_the_kinds():
    """The trainer, the engine, the export command and the instruments ask the heads (or `kind_class`), never a kind's
    name: a new kind is its own module and one registry line (docs/design.md, "A kind")."""
    files = {name: path for name, path in module_files().items() if not name.startswith("medusa_train.kinds")}
    files |= {str(p.relative_to(ROOT)): p for p in [*(ROOT / "scripts").glob("*.py"), ROOT / "train.py"]}
    bad = {name: lines for name, path in files.items() if (lines := kind_comparisons(path.read_text()))}
    assert bad == {}
    planted = 'def f(heads):\n    if heads.spec.kind == "dflash":\n        return 1\n    return {"eagle3": 2}.get(k)\n'
    assert kind_comparisons(planted) == [2, 4]
    assert kind_comparisons('x = kind in ("eagle3", "dflash")') == [1]


def test_old_module_names_still_work():
    """Modules that moved into the folders answer to their old names: one module object under both (never a second
    copy), and `python -m OLD` runs the new one's command."""
    import subprocess
    import sys

    import medusa_train
    import medusa_train.heads as old
    import medusa_train.kinds.heads as new

    assert old is new and old.__spec__.name == "medusa_train.kinds.heads"
    for name, moved in medusa_train.MOVED.items():
        assert moved in module_files(), f"{name} -> {moved}, which does not exist"
    out = subprocess.run([sys.executable, "-m", "medusa_train.distill", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "python -m medusa_train.data.distill" in out.stdout


def long_functions(source: str, limit: int = 100) -> dict[str, int]:
    """The functions (methods and nested ones too) of `source` longer than `limit` lines, decorators aside."""
    return {fn.name: n for fn in ast.walk(ast.parse(source)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := fn.end_lineno - fn.lineno + 1) > limit}


def test_no_function_over_100_lines():
    """A function a reader can hold: none in medusa_train/ or inference/ over 100 lines."""
    long = {f"{name}.{fn}": n for name, path in module_files().items()
            for fn, n in long_functions(path.read_text()).items()}
    assert long == {}
    planted = "def f():\n" + "    x = 1\n" * 100 + "def g():\n    return 2\n"
    assert long_functions(planted) == {"f": 101}


def test_the_readme_is_a_guide_of_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
