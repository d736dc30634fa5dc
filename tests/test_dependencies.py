"""Dependencies run one way: verdict/ never imports backends/, gen_model/ or
harness/ (main.py wires the plan loader and the symbolic backend in)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("backends", "gen_model", "harness", "main", "scripts", "tests")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_verdict_sources_import_no_producer():
    bad = [f"{path.relative_to(ROOT)} imports {module}"
           for path in sorted((ROOT / "verdict").rglob("*.py"))
           for module in sorted(imported_modules(path))
           if module.split(".")[0] in FORBIDDEN]
    assert not bad, bad


def test_importing_verdict_loads_no_producer():
    """Every verdict module imported in a fresh interpreter pulls in none of
    the producers (an import hidden in a function body would show here once
    called; this catches the ones run at import)."""
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                     for p in (ROOT / "verdict").rglob("*.py") if p.name != "__init__.py")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


# -- the torch backend: no import circle, no private name across modules, families apart

TORCH = ROOT / "backends" / "torch"
LOWERING = TORCH / "lowering"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    """The import statements of a module that run (anywhere in it), leaving
    out those under ``if TYPE_CHECKING:``, which only type checkers read."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
               and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
               for stmt in block.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
            and id(n) not in skipped]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules under ``root`` it imports (a package's
    ``from pkg import mod`` counts as importing ``pkg.mod``)."""
    paths = {module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        found = set()
        for node in runtime_imports(path):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif node.level == 0 and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a package importing its own modules
    from its ``__init__`` is not one), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if m.startswith(n + "."):
                continue  # a module importing the package it is in
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_torch_backend_has_no_import_circle():
    assert cycle(import_graph(TORCH)) is None, cycle(import_graph(TORCH))


def test_torch_backend_imports_no_private_name_of_another_module():
    bad = [f"{path.relative_to(ROOT)} imports {a.name} from {node.module}"
           for path in sorted(TORCH.rglob("*.py")) for node in runtime_imports(path)
           if isinstance(node, ast.ImportFrom) and node.module
           and node.module.startswith("backends.") for a in node.names
           if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def registers_handlers(path: Path) -> bool:
    """A lowering family: a module that registers handlers (``lowers``,
    ``refines``)."""
    tree = ast.parse(path.read_text(), str(path))
    return path.stem != "registry" and any(
        isinstance(n, ast.Name) and n.id in ("lowers", "refines") for n in ast.walk(tree))


def test_no_lowering_family_imports_another():
    families = {module_name(p) for p in LOWERING.glob("*.py")
                if p.name != "__init__.py" and registers_handlers(p)}
    assert len(families) > 10, families
    graph = import_graph(LOWERING)
    bad = [f"{m} imports {n}" for m in sorted(families) for n in sorted(graph[m] & families)]
    assert not bad, bad


def imported_names(path: Path) -> set[str]:
    """Every module a file imports, under ``TYPE_CHECKING`` too (``from pkg
    import mod`` also counts as ``pkg.mod``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_tracer_and_lowering_import_no_zoo():
    """The rooms run one way: the zoo (models, recipes, adapters) uses the
    tracer's interfaces; the tracer and the lowering reach a model or recipe
    only by the reference the user gave, never by an import."""
    from backends.torch import OLD_PATHS

    def zoo(module: str) -> bool:
        return OLD_PATHS.get(module, module).startswith("backends.torch.zoo")
    bad = [f"{path.relative_to(ROOT)} imports {m}"
           for room in ("tracer", "lowering") for path in sorted((TORCH / room).rglob("*.py"))
           for m in sorted(imported_names(path)) if zoo(m)]
    assert not bad, bad


def test_torch_backend_imports_no_old_path():
    """The backend's own modules import the rooms' names; the old flat names
    (``backends.torch.recipes``) are kept for plans, users, scripts and tests."""
    from backends.torch import OLD_PATHS
    bad = [f"{path.relative_to(ROOT)} imports {m}" for path in sorted(TORCH.rglob("*.py"))
           for m in sorted(imported_names(path)) if m in OLD_PATHS]
    assert not bad, bad


# -- the verifier and the plan readers: no import circle, no private name across modules

VERDICT = ROOT / "verdict"
SYMMETRY = VERDICT / "symmetry"


def readers_graph() -> dict[str, set[str]]:
    """The import graph of backends/ without the torch backend (the plan
    readers and their shared checks)."""
    graph = import_graph(ROOT / "backends")
    return {m: {n for n in deps if not n.startswith("backends.torch")}
            for m, deps in graph.items() if not m.startswith("backends.torch")}


def private_imports(paths: list[Path], prefix: str) -> list[str]:
    return [f"{path.relative_to(ROOT)} imports {a.name} from {node.module}"
            for path in paths for node in runtime_imports(path)
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.startswith(prefix) for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")]


def test_verdict_has_no_import_circle():
    assert cycle(import_graph(VERDICT)) is None, cycle(import_graph(VERDICT))


def test_plan_readers_have_no_import_circle():
    """backends/planfile.py and backends/columnar.py share their checks
    through backends/plancheck.py, which imports neither."""
    graph = readers_graph()
    assert cycle(graph) is None, cycle(graph)
    assert "backends.planfile" not in graph["backends.columnar"]
    assert not graph["backends.plancheck"] & {"backends.planfile", "backends.columnar"}


def test_verdict_and_readers_import_no_private_name_of_another_module():
    paths = sorted(VERDICT.rglob("*.py")) + sorted((ROOT / "backends").glob("*.py"))
    bad = private_imports(paths, "verdict.") + private_imports(paths, "backends.")
    assert not bad, bad


def test_symmetry_modules_import_one_way():
    """The symmetry package's modules import only those listed before them
    in its docstring (verdict/symmetry/__init__.py), even under
    TYPE_CHECKING."""
    order = ["rules", "fold", "uniform", "arrays", "shards", "owned_grads", "owned", "programs",
             "glue", "blocks", "classes", "cut", "find"]
    assert sorted(order) == sorted(p.stem for p in SYMMETRY.glob("*.py") if p.stem != "__init__")
    doc = ast.get_docstring(ast.parse((SYMMETRY / "__init__.py").read_text()))
    assert [m for m in order if f"``{m}``" in doc] == order
    assert sorted(order, key=lambda m: doc.index(f"``{m}``")) == order
    bad = []
    for k, name in enumerate(order):
        tree = ast.parse((SYMMETRY / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("verdict.symmetry."):
                other = node.module.split(".")[2]
                if other not in order[:k]:
                    bad.append(f"{name} imports {other}")
    assert not bad, bad
