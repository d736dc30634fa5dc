"""Print the lowering's dispatch table: for every recorded op, the chain of
handler functions that see it, outermost first.

    .venv/bin/python scripts/dump_handlers.py > handlers.txt

A handler that refines another holds it in its closure; the listing follows
those cells, so it shows each layer an op passes (``module:qualname``, a
short hash of the function's bytecode, and the plain values it was made
with). Two listings that agree op by op dispatch alike, whatever the modules
are called: compare them with the module names mapped.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PLAIN = (str, int, float, bool, type(None), tuple)


def table() -> dict[str, Any]:
    try:
        from backends.torch.lowering.registry import handlers
    except ImportError:
        from backends.torch.lower import HANDLERS  # the layout before backends/torch/lowering/
        return HANDLERS
    return handlers()


def describe(fn: Any, depth: int = 0) -> list[str]:
    """One line per function in ``fn``'s chain, indented by depth."""
    pad = "  " * depth
    code = getattr(fn, "__code__", None)
    if code is None:
        return [f"{pad}{fn!r}"]
    digest = hashlib.sha256(code.co_code).hexdigest()[:10]
    cells = zip(code.co_freevars, fn.__closure__ or ())
    values, inner = [], []
    for name, cell in cells:
        value = cell.cell_contents
        if callable(value) and hasattr(value, "__code__"):
            inner.append((name, value))
        elif isinstance(value, PLAIN):
            values.append(f"{name}={value!r}")
    head = f"{pad}{fn.__module__}:{fn.__qualname__} {digest}" + (f" [{', '.join(values)}]" if values else "")
    lines = [head]
    for name, value in inner:
        lines.append(f"{pad}  <{name}>")
        lines.extend(describe(value, depth + 2))
    return lines


def main() -> int:
    for op, fn in sorted(table().items()):
        print(op)
        print("\n".join(describe(fn, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
