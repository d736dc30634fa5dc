"""Lowering of the backward of ``torch.amax`` (max pooling written as
``x.amax(dim)``), which autograd writes as four ops comparing with the
result: ``hit = (amax(x) == x)``, ``count = hit.sum(dim, keepdim=True)``,
``g / count``, times ``hit``. Together they are the ``max`` rule's
backward (ties share the gradient evenly): each op is kept pending until
the product completes the pattern, which is emitted as one ``max``
backward node. A pending value read any other way is refused.

``x.max(dim)`` (values and indices) sends the gradient to the first
maximum's index, which no rule of the table computes: refused in one line.

Registered by ``lower.py`` over its own table: each handler takes its own
cases and hands every other on to the handler it wraps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.torch.errors import LoweringError
from backends.torch.lower_vocab_parallel import RowMax

Handler = Callable[..., Any]

#: reshapes a maximum may pass through before autograd compares it with its input
_RESHAPES = ("flatten", "unflatten")


def _refuse(lw: Any) -> None:
    raise LoweringError(f"{lw.name}: a comparison with a maximum (amax(x) == x) read other than "
                        f"by amax's backward is not lowered")


@dataclass(frozen=True)
class MaxHit:
    """``amax(x) == x``: where x is maximal along the reduced dims."""
    x: int
    top: int  # the max node's output
    kwargs: tuple  # the max node's (dim, keepdim)

    def emit_into(self, lw: Any) -> int:
        _refuse(lw)


@dataclass(frozen=True)
class MaxCount:
    """The number of maxima along the dims, ``hit.sum(dims, keepdim=True)``."""
    hit: MaxHit

    def emit_into(self, lw: Any) -> int:
        _refuse(lw)


@dataclass(frozen=True)
class MaxShare:
    """``g / count``: each maximum's share of the gradient."""
    g: int
    hit: MaxHit

    def emit_into(self, lw: Any) -> int:
        _refuse(lw)


def _env(lw: Any, a: Any) -> Any:
    return lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        else None


def _producer(lw: Any, v: int):
    for node in reversed(lw.nodes):
        if v in node.outs:
            return node
    return None


def _maximum_of(lw: Any, top: Any, x: Any) -> MaxHit | None:
    """MaxHit when ``top`` is the ``max`` of ``x`` along some dims (seen
    through reshapes) and x a lowered value."""
    if isinstance(top, RowMax):  # amax(x, dim, keepdim=True), pending for a MAX all-reduce
        top = lw.materialize(top)
    if not isinstance(top, int) or not isinstance(x, int):
        return None
    node = _producer(lw, top)
    while node is not None and node.op in _RESHAPES and len(node.ins) == 1:
        node = _producer(lw, node.ins[0])
    if node is None or node.op != "max" or node.ins[0] != x:
        return None
    return MaxHit(x, node.outs[0], (node.kwargs["dim"], node.kwargs["keepdim"]))


def equal(base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        hit = _maximum_of(lw, a, b) or _maximum_of(lw, b, a)
        if hit is not None:
            if tuple(shapes[0]) != tuple(lw.shapes[hit.x]):
                raise LoweringError(f"{lw.name}: a comparison with a maximum that broadcasts x "
                                    f"is not lowered")
            return hit
        return base(lw, args, kwargs, shapes, group)
    return lower


def count(base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        hit = _env(lw, args[0])
        if not isinstance(hit, MaxHit):
            return base(lw, args, kwargs, shapes, group)
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = [int(d) % len(lw.shapes[hit.x]) for d in
                (dims if isinstance(dims, (list, tuple)) else [dims])]
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        reduced = hit.kwargs[0]
        reduced = sorted(int(d) % len(lw.shapes[hit.x]) for d in
                         (reduced if isinstance(reduced, (list, tuple)) else [reduced]))
        if sorted(dims) != reduced or not keepdim:
            _refuse(lw)
        return MaxCount(hit)
    return lower


def share(base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        c = _env(lw, args[1])
        if not isinstance(c, MaxCount):
            return base(lw, args, kwargs, shapes, group)
        return MaxShare(lw.val(args[0]), c.hit)
    return lower


def spread(base: Handler) -> Handler:
    """``share * hit``: the ``max`` rule's backward of the share's gradient."""
    def lower(lw: Any, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        s, hit = (a, b) if isinstance(a, MaxShare) else (b, a)
        if not isinstance(s, MaxShare):
            if any(isinstance(v, (MaxHit, MaxCount)) for v in (a, b)):
                _refuse(lw)
            return base(lw, args, kwargs, shapes, group)
        if hit != s.hit:
            _refuse(lw)
        g = lw.reshape(s.g, lw.shapes[hit.top])
        dim, keepdim = hit.kwargs
        return lw.emit("max", [hit.x, g], [lw.shapes[hit.x]], {"dim": dim, "keepdim": keepdim},
                       direction="bw")[0]
    return lower


def max_dim(lw: Any, args, kwargs, shapes, group):
    raise LoweringError(f"{lw.name}: x.max(dim) (values and indices) is not lowered: its backward "
                        f"sends the gradient to the first maximum's index, which depends on the "
                        f"values; torch.amax(x, dim) (ties share the gradient) is lowered")


def max_handlers(table: dict[str, Handler]) -> dict[str, Handler]:
    """The entries this module adds to or wraps in ``table`` (lower.py's)."""
    return {
        "aten.eq.Tensor": equal(table.get("aten.eq.Tensor", _unlowered("aten.eq.Tensor"))),
        "aten.sum.dim_IntList": count(table["aten.sum.dim_IntList"]),
        "aten.div.Tensor": share(table["aten.div.Tensor"]),
        "aten.mul.Tensor": spread(table["aten.mul.Tensor"]),
        "aten.max.dim": max_dim,
    }


def _unlowered(op: str) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        raise LoweringError(f"aten op {op} (at {lw.name or 'top level'}) is not lowered onto the "
                            f"rule table")
    return lower
