"""Lowering of ``torch.roll``, whose every output position is a copy of one
input position: a ``cat`` of ``narrow``s (docs/soundness.md, "Plans traced
from PyTorch", 17: exact rules). Its backward is recorded as the same op
(``roll`` by the opposite shifts), lowered alike. ``torch.flip`` is lowered
by ``scan`` (a product with the anti-identity along each dim).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import cat, narrow
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _ints(value: Any) -> list[int]:
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


@lowers("aten.roll.default")
def roll(lw: Lowerer, args, kwargs, shapes, group):
    """``torch.roll(x, shifts, dims)``: along each dim, the last ``s``
    positions then the first ``n - s``."""
    x = lw.val(args[0])
    shifts = _ints(args[1] if len(args) > 1 else kwargs["shifts"])
    dims = _ints(args[2] if len(args) > 2 else kwargs.get("dims", []))
    if len(dims) != len(shifts) or not dims:
        raise LoweringError(f"{lw.name}: torch.roll without a dim for each shift (a roll of the "
                            f"flattened tensor) is not lowered")
    for shift, d in zip(shifts, dims):
        d %= len(lw.shapes[x])
        n = lw.shapes[x][d]
        s = shift % n if n else 0
        if s:
            x = cat(lw, [narrow(lw, x, d, n - s, s), narrow(lw, x, d, 0, n - s)], d)
    return x
