"""The optimizer's step on a flat range of a parameter (Megatron's
distributed optimizer: each rank's main parameter is
``param.view(-1)[start:end]``, its gradient the same range of the reduced
``main_grad``, its states fresh zeros of the range); docs/soundness.md,
"Plans traced from PyTorch", 90 (a).

Every op of torch's for-loop AdamW and SGD is elementwise: output element k
is the op of the operands' elements k (and of one-element operands
broadcast alike). So the op on ranges [lo, hi) of whole values of one
shape is, on those elements, the op on the whole values: each such op is
lowered by its usual handler (``arithmetic``: the ``adam_step`` and
``sgd_step`` folds) on the whole values, the result the same range of the
outputs (``FlatRange`` of one run for a value, ``RangeOf`` for a pending
record of the fold). The outputs' elements outside the range are computed
but bound to no memory (as item 79's). Operands of more than one element
that are not such ranges, or ranges of other places or shapes, are
refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.flat_ranges import FlatRange

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer
    from backends.torch.lowering.registry import Handler

#: torch's for-loop AdamW and SGD ops (and the fresh states' ``zeros_like``)
STEP_OPS = frozenset({
    "aten.zeros_like.default", "aten.mul_.Tensor", "aten.lerp_.Scalar", "aten.addcmul_.default",
    "aten.sqrt.default", "aten.div.Tensor", "aten.add_.Tensor", "aten.add.Tensor",
    "aten.addcdiv_.default",
})


@dataclass(frozen=True)
class RangeOf:
    """A pending record of the optimizer's fold (``Decayed``, ``Moment1``,
    ...) made on whole values, of which elements [lo, hi) are the value."""
    x: Any
    lo: int
    hi: int


def _range(lw: Lowerer, a: Any) -> tuple[Any, int, int] | None:
    """The whole record and range of an argument that is a range of one
    value (or a ``RangeOf``), else None."""
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
        return None
    x = lw.env.get(a[1])
    if isinstance(x, RangeOf):
        return x.x, x.lo, x.hi
    if isinstance(x, FlatRange) and len(x.parts) == 1 and x.source is None:
        v, lo, hi = x.parts[0]
        return v, lo, hi
    if isinstance(x, int) and x in lw.flat_of:  # a whole value flattened: all its elements
        return lw.flat_of[x], 0, math.prod(lw.shapes[x])
    return None


def applies(lw: Lowerer, op: str, args: Any) -> bool:
    """Event ``op`` is an optimizer op on a range: of a parameter, of a
    fresh state of one, or of a fold's record. An op whose only "ranges"
    are whole values flattened (plain values, nothing pending) and that
    reads a tensor of several elements that is no range is no optimizer op
    on ranges (a forward ``h + b`` of a parameter ``b`` of shape [1, n]
    squeezed, ERNIE's ``moe_statics``): its usual handler lowers it, as it
    lowers any op on plain values (item 109)."""
    if op not in STEP_OPS:
        return False
    tensors = [a for a in args if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"]
    plain = all(isinstance(lw.env.get(a[1]), int) for a in tensors)
    if plain and any(math.prod(lw.trace["shapes"][a[1]]) != 1 and _range(lw, a) is None
                     for a in tensors):
        return False
    for a in args:
        r = _range(lw, a)
        if r is not None and (isinstance(lw.env.get(a[1]), RangeOf) or r[0] in lw.params
                              or r[0] in lw.fresh_state):
            return True
    return False


def _shape_of(lw: Lowerer, x: Any) -> tuple[int, ...] | None:
    return tuple(lw.shapes[x]) if isinstance(x, int) else None


def range_step(base: Handler) -> Handler:
    """``base`` run on the whole values of its range arguments (one range
    [lo, hi) for all, of values of one shape), its outputs that range."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        keys, whole, span = [], [], set()
        for a in args:
            r = _range(lw, a)
            if r is None:
                if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
                        and math.prod(lw.trace["shapes"][a[1]]) != 1:
                    raise LoweringError(f"{lw.name}: an optimizer op on a flat range of a "
                                        f"parameter reads a tensor of several elements that is "
                                        f"no range: not lowered")
                continue
            keys.append(a[1])
            whole.append(r[0])
            span.add((r[1], r[2]))
        shapes_of = {_shape_of(lw, x) for x in whole if isinstance(x, int)}
        if len(span) != 1 or len(shapes_of) > 1:
            raise LoweringError(f"{lw.name}: an optimizer op reads flat ranges {sorted(span)} of "
                                f"values of shapes {sorted(shapes_of)}, not one range of one "
                                f"shape: not lowered")
        lo, hi = span.pop()
        full = shapes_of.pop() if shapes_of else None
        if full is None:  # only records: their whole shape is the parameter's
            full = _record_shape(lw, whole[0])
        if any(math.prod(s) != hi - lo for s in shapes):
            raise LoweringError(f"{lw.name}: an optimizer op's output is not its range's size")
        kept = {k: lw.env[k] for k in keys}
        try:
            for k, x in zip(keys, whole):
                lw.env[k] = x
            out = base(lw, args, kwargs, [full] * len(shapes), group)
        finally:
            lw.env.update(kept)
        if isinstance(out, list):
            return [_ranged(x, lo, hi) for x in out]
        return _ranged(out, lo, hi)
    return lower


def _ranged(x: Any, lo: int, hi: int) -> Any:
    if isinstance(x, int):
        return FlatRange(((x, lo, hi),))
    return RangeOf(x, lo, hi)


def _record_shape(lw: Lowerer, x: Any) -> tuple[int, ...]:
    """The whole shape of a fold's record: that of the first value it holds."""
    for name in ("p", "m", "v", "g"):
        v = getattr(x, name, None)
        if isinstance(v, int):
            return tuple(lw.shapes[v])
    inner = getattr(x, "v2", None)
    if inner is not None:
        return _record_shape(lw, inner)
    raise LoweringError(f"{lw.name}: an optimizer record on a flat range of no known shape")


def final_range(lw: Lowerer, x: Any, updated: dict) -> Any:
    """A state's or parameter's final record on a range: its final value's
    range (``updated`` maps a fold's moments to their new values)."""
    if isinstance(x, RangeOf):
        inner = updated.get(x.x, x.x)
        return FlatRange(((inner, x.lo, x.hi),)) if isinstance(inner, int) else None
    return x
