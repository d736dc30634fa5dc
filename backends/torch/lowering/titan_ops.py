"""torchtitan's own custom ops, each given its meaning once as the aten op
it computes (docs/soundness.md, "Plans traced from PyTorch", 112).

- ``torchtitan::deterministic_scatter_add(out, index, src)`` runs
  ``out.scatter_add(0, index, src)`` with deterministic algorithms on
  (torchtitan/ops/scatter_add.py): the same sums, added in a fixed order.
  It is lowered by the whole chain of ``aten.scatter_add.default``'s rules
  with ``dim = 0``. Its autograd formula (the output's gradient for
  ``out``, ``gather(grad, 0, index)`` for ``src``) runs as recorded aten
  ops, lowered by their own rules.

This is the last layer of ``registry.LAYERS``, so the chain it hands the
op to is the complete one of ``aten.scatter_add.default``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.registry import refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]

#: torchtitan's op and the aten op whose rules lower it
DETERMINISTIC_SCATTER_ADD = "torchtitan.deterministic_scatter_add.default"
SCATTER_ADD = "aten.scatter_add.default"


@refines(DETERMINISTIC_SCATTER_ADD, base=SCATTER_ADD)
def deterministic_scatter_add(scatter_add: Handler | None) -> Handler:
    """``deterministic_scatter_add(out, index, src)`` is
    ``out.scatter_add(0, index, src)``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        named = {"out": None, "index": None, "src": None}
        for key, a in zip(named, args):
            named[key] = a
        for key in named:
            if key in kwargs:
                named[key] = kwargs[key]
        if scatter_add is None or any(a is None for a in named.values()):
            raise LoweringError(f"{lw.name}: {DETERMINISTIC_SCATTER_ADD} with arguments "
                                f"{sorted(k for k, a in named.items() if a is None)} missing")
        return scatter_add(lw, [named["out"], 0, named["index"], named["src"]], {}, shapes, group)
    return lower
