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
