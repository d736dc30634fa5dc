"""Lowering of the backward of ``torch.amax`` (max pooling written as
``x.amax(dim)``), which autograd writes as four ops comparing with the
result: ``hit = (amax(x) == x)``, ``count = hit.sum(dim, keepdim=True)``,
``g / count``, times ``hit``. Together they are the ``max`` rule's
backward (ties share the gradient evenly): each op is kept pending until
the product completes the pattern, which is emitted as one ``max``
backward node. A pending value read any other way is refused.

``torch.maximum(a, b)`` is ``b + relu(a - b)`` and ``torch.minimum(a, b)``
``a - relu(a - b)``, a and b first expanded to the output's shape when
they broadcast (torch's backward sums the gradient back over the expanded
dims with its own ``sum``); their backward, ``where(a == b, g / 2,
g).masked_fill_(a > b, 0)`` (or ``a < b``), is ``g / 2 + (g / 2) step(b -
a) - (g / 2) step(a - b)`` (or a and b swapped), with ``step`` the ``relu``
rule's backward: g where the fill does not apply, g / 2 at ties, 0 where
it does.

``x.max(dim)`` (values and indices) and max pooling are ``argmax``'s.

Registered by ``lowering/`` over its own table: each handler takes its own
cases and hands every other on to the handler it wraps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.ir import MaxCount, MaxHit, Pending, RowMax, refuse_max_read
from backends.torch.lowering.registry import Handler, lowers, not_lowered, refines
from backends.torch.lowering.shapes import dim_set

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: reshapes a maximum may pass through before autograd compares it with its input
_RESHAPES = ("flatten", "unflatten")


@dataclass(frozen=True)
class MaxShare(Pending):
    """``g / count``: each maximum's share of the gradient."""
    g: int
    hit: MaxHit

    def materialize(self, lw: Lowerer) -> int:
        refuse_max_read(lw)


@dataclass(frozen=True)
class Tie(Pending):
    """``a == b`` of two lowered values broadcast to ``shape``."""
    a: int
    b: int
    shape: tuple[int, ...]
    recorded: tuple[Any, Any]  # the compared tensors' recorded ids

    def materialize(self, lw: Lowerer) -> int:
        _refuse_tie(lw)


@dataclass(frozen=True)
class Order(Pending):
    """``a > b`` or ``a < b`` of two lowered values broadcast to ``shape``."""
    op: str
    a: int
    b: int
    shape: tuple[int, ...]
    recorded: tuple[Any, Any]

    def materialize(self, lw: Lowerer) -> int:
        _refuse_tie(lw)


@dataclass(frozen=True)
class TieSplit(Pending):
    """``where(a == b, g / 2, g)``: the gradient halved at ties."""
    tie: Tie
    g: int

    def materialize(self, lw: Lowerer) -> int:
        _refuse_tie(lw)


def _refuse_tie(lw: Lowerer) -> None:
    raise LoweringError(f"{lw.name}: a comparison of two computed tensors (==, >, <) other than "
                        f"in the backward of torch.maximum/minimum is not lowered")


def _env(lw: Lowerer, a: Any) -> Any:
    return lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        else None


def _operands(lw: Lowerer, args) -> tuple[Any, Any]:
    """The two compared values, pending ones (a constant, a row maximum, a
    slice) materialized: no other handler compares computed tensors."""
    a, b = _env(lw, args[0]), _env(lw, args[1])
    return tuple(lw.materialize(v) if v is not None and not isinstance(v, int) else v
                 for v in (a, b))


def _recorded(args) -> tuple[Any, Any]:
    return tuple(a[1] if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" else a
                 for a in args[:2])


def _producer(lw: Lowerer, v: int):
    for node in reversed(lw.nodes):
        if v in node.outs:
            return node
    return None


def _maximum_of(lw: Lowerer, top: Any, x: Any) -> MaxHit | None:
    """MaxHit when ``top`` is the ``max`` of ``x`` along some dims (seen
    through reshapes) and x a lowered value."""
    if isinstance(top, RowMax):  # amax(x, dim, keepdim=True), pending for a MAX all-reduce
        top = lw.materialize(top)
    if not isinstance(top, int) or not isinstance(x, int):
        return None
    node = _producer(lw, top)
    while node is not None and node.op in _RESHAPES and len(node.ins) == 1:
        node = _producer(lw, node.ins[0])
    if _negated(node):  # a minimum, -max(-x): x is minimal where -x is maximal
        node = _producer(lw, node.ins[0])
        neg = _producer(lw, node.ins[0]) if node is not None and node.op == "max" else None
        if not _negated(neg) or neg.ins[0] != x:
            return None
        x = neg.outs[0]
    if node is None or node.op != "max" or node.ins[0] != x:
        return None
    return MaxHit(x, node.outs[0], (node.kwargs["dim"], node.kwargs["keepdim"]))


def _negated(node: Any) -> bool:
    return node is not None and node.op == "mul_scalar" and node.kwargs.get("value") == -1.0


@refines("aten.eq.Tensor", absent=not_lowered)
def equal(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        hit = _maximum_of(lw, a, b) or _maximum_of(lw, b, a)
        if hit is None:
            a, b = _operands(lw, args)
        if hit is not None:
            if tuple(shapes[0]) != tuple(lw.shapes[hit.x]):
                raise LoweringError(f"{lw.name}: a comparison with a maximum that broadcasts x "
                                    f"is not lowered")
            return hit
        if _broadcastable(lw, a, b, shapes[0]):
            return Tie(a, b, tuple(shapes[0]), _recorded(args))
        return base(lw, args, kwargs, shapes, group)
    return lower


def order(op: str, base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = _operands(lw, args)
        if _broadcastable(lw, a, b, shapes[0]):
            return Order(op, a, b, tuple(shapes[0]), _recorded(args))
        return base(lw, args, kwargs, shapes, group)
    return lower


def _halved(lw: Lowerer, half: Any, g: Any) -> bool:
    """half is ``g / 2`` (a ``div`` node of g by 2)."""
    node = _producer(lw, half) if isinstance(half, int) else None
    return node is not None and node.op == "div" and node.ins == [g] \
        and node.kwargs.get("value") == 2.0


@refines("aten.where.self")
def split_ties(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        tie = _env(lw, args[0])
        if not isinstance(tie, Tie):
            return base(lw, args, kwargs, shapes, group)
        g = lw.val(args[2])
        if not _halved(lw, lw.val(args[1]), g) or lw.shapes[g] != tie.shape:
            _refuse_tie(lw)
        return TieSplit(tie, g)
    return lower


def _step_times(lw: Lowerer, a: int, b: int, t: int) -> int:
    """``t * step(a - b)``: the relu rule's backward node."""
    y = lw.emit("sub", [a, b], [lw.shapes[a]])[0]
    return lw.emit("relu", [y, t], [lw.shapes[t]], direction="bw")[0]


@refines("aten.masked_fill_.Scalar")
def fill_losing_side(base: Handler) -> Handler:
    """``where(a == b, g / 2, g).masked_fill_(a > b, 0)``: g where a < b,
    g / 2 at ties, 0 where a > b (``a < b``: the mirror)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        split, cmp = _env(lw, args[0]), _env(lw, args[1])
        if not isinstance(split, TieSplit):
            return base(lw, args, kwargs, shapes, group)
        a, b = split.tie.a, split.tie.b
        if not isinstance(cmp, Order) or cmp.recorded != split.tie.recorded \
                or lw.const(args[2]) != 0:
            _refuse_tie(lw)
        a, b = _expand(lw, a, split.tie.shape), _expand(lw, b, split.tie.shape)
        if cmp.op == "lt":
            a, b = b, a
        shape = lw.shapes[split.g]
        half = lw.emit("div", [split.g], [shape], {"value": 2.0})[0]
        kept = lw.emit("add", [half, _step_times(lw, b, a, half)], [shape])[0]
        return lw.emit("sub", [kept, _step_times(lw, a, b, half)], [shape])[0]
    return lower


def _broadcastable(lw: Lowerer, a: Any, b: Any, shape: Any) -> bool:
    """a and b are lowered values that broadcast to ``shape`` (torch's rule:
    trailing dims aligned, each 1 or the output's)."""
    if not (isinstance(a, int) and isinstance(b, int)):
        return False
    shape = tuple(shape)
    return all(len(lw.shapes[v]) <= len(shape) and all(
        s in (1, o) for s, o in zip(reversed(lw.shapes[v]), reversed(shape))) for v in (a, b))


def _expand(lw: Lowerer, x: int, shape: tuple[int, ...]) -> int:
    """x broadcast to shape: leading dims of 1 added, then ``expand``."""
    if lw.shapes[x] == shape:
        return x
    x = lw.reshape(x, (1,) * (len(shape) - len(lw.shapes[x])) + tuple(lw.shapes[x]))
    if lw.shapes[x] == shape:
        return x
    return lw.emit("expand", [x], [shape], {"shape": list(shape)})[0]


def _relu_of_difference(lw: Lowerer, args, shape: tuple[int, ...]) -> tuple[int, int, int]:
    a, b = lw.val(args[0]), lw.val(args[1])
    if not _broadcastable(lw, a, b, shape):
        raise LoweringError(f"{lw.name}: torch.maximum/minimum of shapes {list(lw.shapes[a])} "
                            f"and {list(lw.shapes[b])} is not lowered")
    a, b = _expand(lw, a, shape), _expand(lw, b, shape)
    d = lw.emit("sub", [a, b], [lw.shapes[a]])[0]
    return a, b, lw.emit("relu", [d], [lw.shapes[a]])[0]


@lowers("aten.maximum.default")
def maximum(lw: Lowerer, args, kwargs, shapes, group):
    """``b + relu(a - b)``."""
    _, b, r = _relu_of_difference(lw, args, tuple(shapes[0]))
    return lw.emit("add", [b, r], [lw.shapes[b]])[0]


@lowers("aten.minimum.default")
def minimum(lw: Lowerer, args, kwargs, shapes, group):
    """``a - relu(a - b)``."""
    a, _, r = _relu_of_difference(lw, args, tuple(shapes[0]))
    return lw.emit("sub", [a, r], [lw.shapes[a]])[0]


@refines("aten.sum.dim_IntList")
def count(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        hit = _env(lw, args[0])
        if not isinstance(hit, MaxHit):
            return base(lw, args, kwargs, shapes, group)
        ndim = len(lw.shapes[hit.x])
        dims = dim_set(args[1] if len(args) > 1 else kwargs.get("dim"), ndim)
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if dims != dim_set(hit.kwargs[0], ndim) or not keepdim:
            refuse_max_read(lw)
        return MaxCount(hit)
    return lower


@refines("aten.div.Tensor")
def share(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        c = _env(lw, args[1])
        if not isinstance(c, MaxCount):
            return base(lw, args, kwargs, shapes, group)
        return MaxShare(lw.val(args[0]), c.hit)
    return lower


@refines("aten.mul.Tensor")
def spread(base: Handler) -> Handler:
    """``share * hit``: the ``max`` rule's backward of the share's gradient."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        s, hit = (a, b) if isinstance(a, MaxShare) else (b, a)
        if not isinstance(s, MaxShare):
            if any(isinstance(v, (MaxHit, MaxCount)) for v in (a, b)):
                refuse_max_read(lw)
            return base(lw, args, kwargs, shapes, group)
        if hit != s.hit:
            refuse_max_read(lw)
        g = lw.reshape(s.g, lw.shapes[hit.top])
        dim, keepdim = hit.kwargs
        return lw.emit("max", [hit.x, g], [lw.shapes[hit.x]], {"dim": dim, "keepdim": keepdim},
                       direction="bw")[0]
    return lower




@refines("aten.gt.Tensor", absent=not_lowered)
def order_gt(base: Handler) -> Handler:
    return order("gt", base)


@refines("aten.lt.Tensor", absent=not_lowered)
def order_lt(base: Handler) -> Handler:
    return order("lt", base)
