"""Values that are zeros by the algebra of the ops that made them.

The backward of a slice of no entries (``x[:0]``) is zeros of x's shape:
the gradient of a value no reader read. transformers' expert-parallel path
(``AllToAllEP``) runs a rank's experts on one placeholder row when they
receive no token and keeps ``[:0]`` of the result, so that the backward's
exchanges still run; the backward of that placeholder is the chain of ops
from those zeros to the experts' weights. Each op of the chain is linear
in the zeros it reads (a view, a product, a pick of rows, an activation's
backward at its gradient, a sum), so its result is zeros too, entry for
entry, whatever its other inputs are: ``op(0, y) = 0``. Such results are
``Zeros``: a pending value that emits a ``zeros`` node where another op
reads it (docs/soundness.md, "Plans traced from PyTorch", 125 b).

The values are found on the trace (``zero_values``), before the walk:
only chains that start at such a backward are taken, so every other
lowering stays as it was. The events that make them read nothing
(``context.live_events``): the values the placeholder's forward saved for
its backward are not read there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.lowering.ir import Empty, Pending

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class Zeros(Pending):
    """Zeros of ``shape``, by the algebra of the ops that made them."""
    shape: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        return lw.emit("zeros", [], [self.shape], {"shape": list(self.shape)},
                       direction="none")[0]


#: the backward of a slice: its gradient's entries placed in zeros
SLICE_BACKWARD = "aten.slice_backward.default"
#: ops linear in their first tensor (a view, a pick or cut of its entries,
#: a reduction, a backward at its incoming gradient, a division of it)
LINEAR_IN_FIRST = frozenset(f"aten.{op}" for op in (
    "view.default", "_unsafe_view.default", "reshape.default", "t.default", "transpose.int",
    "permute.default", "expand.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims",
    "squeeze.default", "select.int", "slice.Tensor", "narrow.default", "index_select.default",
    "index.Tensor", "clone.default", "alias.default", "detach.default", "_to_copy.default",
    "select_backward.default", "slice_backward.default", "neg.default", "sum.dim_IntList",
    "sum.default", "div.Tensor", "split.Tensor", "split_with_sizes.default", "unbind.int",
    "silu_backward.default", "threshold_backward.default", "sigmoid_backward.default",
    "tanh_backward.default", "gelu_backward.default", "repeat.default",
    "as_strided.default"))
#: ops whose result is zero where any one factor is
PRODUCTS = frozenset(("aten.mul.Tensor", "aten.mm.default", "aten.bmm.default"))
#: ops whose result is zero where every tensor they read is (a sum, a join)
ALL_ZERO = frozenset(("aten.add.Tensor", "aten.cat.default", "aten.stack.default",
                      "fsdp.chunk_cat.default"))
#: a copy into a buffer of its own shape: its result is its source
COPIES = frozenset(("aten.copy_.default", "aten.copy.default"))
#: writes of zeros into zeros at an index: (target, values) positions
WRITES = {"aten.index_put.default": (0, 2), "aten.index_put_.default": (0, 2),
          "aten.index_add.default": (0, 3), "aten.index_add_.default": (0, 3)}


def _ref(a: Any) -> int | None:
    return a[1] if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        and isinstance(a[1], int) else None


def _tensors(args: Any) -> list:
    out: list = []
    for a in args:
        if _ref(a) is not None:
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensors(a))
    return out


def _makes_zeros(op: str, args: list, kwargs: dict, zero: Any, zero_or_const: Any,
                 same_shape: Any) -> bool:
    if op in LINEAR_IN_FIRST:
        return bool(args) and zero(args[0])
    if op in PRODUCTS:
        return any(zero(a) for a in args[:2])
    if op in ALL_ZERO:
        reads = _tensors(list(args) + list(kwargs.values()))
        return any(zero(a) for a in reads) and all(zero_or_const(a) for a in reads)
    if op in COPIES:
        return len(args) > 1 and zero(args[1]) and same_shape(args[0], args[1])
    if op in WRITES:
        target, values = WRITES[op]
        return len(args) > values and zero(args[values]) and zero_or_const(args[target])
    return False


def zero_values(trace: dict) -> set[int]:
    """The recorded values that are zeros by the algebra of the ops that
    made them: the backward of a slice whose gradient has no entry, and
    what ops linear in zeros make of them (``LINEAR_IN_FIRST``,
    ``PRODUCTS``, ``ALL_ZERO``, ``WRITES``: zeros written into a constant
    of zeros)."""
    shapes = trace.get("shapes", [])  # a hand-made trace may record none
    constants = trace.get("constants", ())
    values = trace.get("constvals", {})
    zeros: set[int] = set()

    def zero(a: Any) -> bool:
        return _ref(a) in zeros

    def zero_or_const(a: Any) -> bool:
        v = _ref(a)
        if v in zeros:
            return True
        value = values.get(v) if v in constants else None
        return value is not None and value.dtype.kind in "fiu" and not value.any()

    def shape_of(a: Any) -> tuple[int, ...] | None:
        v = _ref(a)
        return tuple(shapes[v]) if v is not None and 0 <= v < len(shapes) else None

    def same_shape(a: Any, b: Any) -> bool:
        return shape_of(a) is not None and shape_of(a) == shape_of(b)

    for op, (args, kwargs), outs, *_ in trace["events"]:
        if not outs:
            continue
        seed = op == SLICE_BACKWARD and bool(args) and 0 in (shape_of(args[0]) or ())
        if seed or _makes_zeros(op, args, kwargs, zero, zero_or_const, same_shape):
            zeros.update(outs)
    return zeros


def zeros_of(shape: tuple[int, ...]) -> Zeros | Empty:
    """The record of zeros of ``shape`` (of no entries: ``Empty``)."""
    return Empty(tuple(shape)) if 0 in tuple(shape) else Zeros(tuple(shape))
