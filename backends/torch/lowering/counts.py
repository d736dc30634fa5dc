"""Integer tensors computed from masks of the batch's ids, and lookups at
them: RoBERTa's positions, ``cumsum(ids != pad) * (ids != pad) + pad``.

A 0/1 flag (a comparison of the ids, ``masks``) is an integer; so are its
running sums, sums and products of such integers and integer constants, and
their conversions to any integer or floating type (the same numbers). Each
such value carries bounds ``[lo, hi]`` that hold for every batch, computed
from its operands' (``Lowerer.integral``). A table looked up at such a value
``v`` is looked up at its one-hot rows, ``[v == k]`` for each row k, written
as the Lagrange polynomial of the points ``lo .. hi``: ``prod_{r != k} (v -
r) / (k - r)``, which is 1 at ``v = k`` and 0 at every other integer of the
bounds (docs/soundness.md, "Plans traced from PyTorch", 45).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.context import LNode
from backends.torch.lowering.emit import einsum, pad
from backends.torch.lowering.ir import Const, Flag, pending_of
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: the widest bounds whose one-hot rows are written as a polynomial
MAX_POINTS = 64


def _bounds(lw: Lowerer, a: Any) -> tuple[int, int] | None:
    """The bounds of an integer argument: a flag (0 or 1), a value the layer
    bounded, or an integer number; None for anything else."""
    if isinstance(a, bool):
        return int(a), int(a)
    if isinstance(a, int):
        return a, a
    x = pending_of(lw, a)
    if isinstance(x, Flag):
        return 0, 1
    if isinstance(x, int) and x in lw.integral:
        return lw.integral[x]
    if not isinstance(x, (int, Const)):
        return None
    # a constant of integers (the same for every batch)
    try:
        value = constant_value(lw, a)
    except LoweringError:
        value = None
    value = None if value is None else np.asarray(value)
    if value is not None and value.size and value.dtype.kind in "biuf" \
            and np.all(np.isfinite(value)) and np.all(value == np.round(value)):
        return int(np.min(value)), int(np.max(value))
    return None


def _integer_type(dtype: str) -> bool:
    return any(t in dtype for t in ("int", "long", "bool")) and "complex" not in dtype


@refines("aten._to_copy.default", "aten.to.dtype")
def convert(base: Handler) -> Handler:
    """A bounded integer converted to an integer type is itself; a flag
    converted to one keeps its bounds (0, 1)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        bounds = _bounds(lw, args[0])
        dtype = str(kwargs.get("dtype", args[1] if len(args) > 1 else ""))
        x = pending_of(lw, args[0])
        if bounds is not None and isinstance(x, int) and _integer_type(dtype):
            return x
        out = base(lw, args, kwargs, shapes, group)
        if bounds is not None and isinstance(out, int):
            lw.integral[out] = bounds
        return out
    return lower


@refines("aten.cumsum.default")
def running_sum(base: Handler) -> Handler:
    """A running sum of bounded integers (to any type: the same numbers)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        bounds = _bounds(lw, args[0])
        if bounds is None:
            return base(lw, args, kwargs, shapes, group)
        dim = int(args[1]) if len(args) > 1 else int(kwargs["dim"])
        n = tuple(shapes[0])[dim]
        out = base(lw, args, {k: v for k, v in kwargs.items() if k != "dtype"}, shapes, group)
        lo, hi = bounds
        lw.integral[out] = (min(lo, n * lo), max(hi, n * hi))
        return out
    return lower


def _combined(op: str):
    def refine(base: Handler) -> Handler:
        """Sums and products of bounded integers (or integer numbers) are
        bounded integers."""
        def lower(lw: Lowerer, args, kwargs, shapes, group):
            a, b = _bounds(lw, args[0]), _bounds(lw, args[1]) if len(args) > 1 else None
            alpha = kwargs.get("alpha", 1)
            out = base(lw, args, kwargs, shapes, group)
            if a is None or b is None or not isinstance(out, int) or alpha != int(alpha) \
                    or not any(isinstance(pending_of(lw, x), (int, Flag)) for x in args[:2]):
                return out
            if op == "mul":
                ends = [p * q for p in a for q in b]
                lw.integral[out] = (min(ends), max(ends))
            else:
                sign = int(alpha) if op == "add" else -int(alpha)
                ends = [p + sign * q for p in a for q in b]
                lw.integral[out] = (min(ends), max(ends))
            return out
        return lower
    return refine


refines("aten.add.Tensor", "aten.add.Scalar")(_combined("add"))
refines("aten.sub.Tensor", "aten.sub.Scalar")(_combined("sub"))
refines("aten.mul.Tensor", "aten.mul.Scalar")(_combined("mul"))


def one_hot_rows(lw: Lowerer, v: int, rows: int) -> int:
    """``[v == k]`` for k in ``0 .. rows - 1`` (``[*v.shape, rows]``) of a
    bounded integer v, as Lagrange polynomials over its bounds; emitted once
    per (v, rows)."""
    key = (v, rows)
    if key in lw.integral_rows:
        return lw.integral_rows[key]
    lo, hi = lw.integral[v]
    if lo < 0 or hi >= rows:
        raise LoweringError(f"{lw.name}: a table of {rows} rows looked up at integers computed "
                            f"from the ids that may lie in [{lo}, {hi}] (outside its rows)")
    if hi - lo + 1 > MAX_POINTS:
        raise LoweringError(f"{lw.name}: a lookup at integers computed from the ids that may "
                            f"take {hi - lo + 1} values (more than {MAX_POINTS})")
    points = np.arange(lo, hi + 1, dtype=np.float64)
    shape = (*lw.shapes[v], len(points))
    column = lw.reshape(v, (*lw.shapes[v], 1))
    spread = lw.emit("expand", [column], [shape], {"shape": list(shape)})[0]
    out = None
    for r in points:
        if len(points) == 1:
            break
        # (v - r) / (k - r) in column k != r, 1 in column r
        gap = points - r
        scale = np.where(gap == 0, 0.0, 1.0 / np.where(gap == 0, 1.0, gap))
        shift = np.where(gap == 0, 1.0, -r * scale)
        factor = lw.emit("mul", [spread, constant_input(lw, scale)], [shape])[0]
        factor = lw.emit("add", [factor, constant_input(lw, shift)], [shape])[0]
        out = factor if out is None else lw.emit("mul", [out, factor], [shape])[0]
    if out is None:  # one possible value: its row is always 1
        out = lw.emit("ones", [], [shape], {"shape": list(shape)}, direction="none")[0]
    out = pad(lw, out, len(shape) - 1, lo, rows - hi - 1)
    lw.integral_rows[key] = out
    return out


def _bounded(lw: Lowerer, a: Any) -> int | None:
    x = pending_of(lw, a)
    return x if isinstance(x, int) and x in lw.integral else None


@refines("aten.embedding.default")
def lookup(base: Handler) -> Handler:
    """A table looked up at bounded integers: the one-hot rows times the table."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        v = _bounded(lw, args[1])
        if v is None:
            return base(lw, args, kwargs, shapes, group)
        table = lw.val(args[0])
        rows = one_hot_rows(lw, v, lw.shapes[table][0])
        return lw.emit("embedding", [rows, table], shapes)[0]
    return lower


@refines("aten.embedding_dense_backward.default")
def lookup_backward(base: Handler) -> Handler:
    """The table's gradient: the one-hot rows' transpose times the gradient,
    rows at ``padding_idx`` left out (as ``tokens._embedding_bw``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        v = _bounded(lw, args[1])
        if v is None:
            return base(lw, args, kwargs, shapes, group)
        if len(args) > 4 and args[4]:
            raise LoweringError(f"{lw.name}: embedding backward with scale_grad_by_freq is not "
                                f"lowered")
        rows = int(args[2])
        tokens = one_hot_rows(lw, v, rows)
        padding = args[3] if len(args) > 3 else kwargs.get("padding_idx", -1)
        if padding is not None and 0 <= int(padding) < rows:
            keep = np.ones(rows)
            keep[int(padding)] = 0.0
            tokens = lw.emit("mul", [tokens, constant_input(lw, keep)], [lw.shapes[tokens]])[0]
        out = lw.new(shapes[0])
        lw.nodes.append(LNode("embedding", "bw", [tokens, -1, lw.val(args[0])], [-1, out], {},
                              lw.name, None, lw.mb))
        return out
    return lower


@refines("aten.gather.default")
def gather(base: Handler) -> Handler:
    """``x.gather(-1, v)`` at bounded integers v (RoBERTa's token types
    picked at its positions): the sum over the last dim of x times v's
    one-hot rows; integers picked from integers keep x's bounds."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        v = _bounded(lw, args[2])
        if v is None:
            return base(lw, args, kwargs, shapes, group)
        x = lw.val(args[0])
        nd = len(lw.shapes[x])
        dim = int(args[1]) % nd
        if nd > 8 or dim != nd - 1 or lw.shapes[x][:-1] != lw.shapes[v][:-1]:
            raise LoweringError(f"{lw.name}: a gather at integers computed from the ids other "
                                f"than along the last dim of a tensor of the index's other dims")
        rows = one_hot_rows(lw, v, lw.shapes[x][-1])
        lead = "abcdefgh"[:nd - 1]
        out = einsum(lw, f"{lead}z,{lead}yz->{lead}y", x, rows)
        bounds = _bounds(lw, args[0])
        if bounds is not None:
            lw.integral[out] = bounds
        return out
    return lower


@refines("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
         "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
         "aten.squeeze.default", "aten.expand.default", "aten.slice.Tensor",
         "aten.select.int", "aten.clone.default", "aten.alias.default",
         "aten.transpose.int", "aten.t.default", "aten.permute.default")
def moved(base: Handler) -> Handler:
    """Bounded integers reshaped, repeated, cut or moved: the same numbers."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = pending_of(lw, args[0])
        bounds = _bounds(lw, args[0]) if isinstance(x, (int, Const)) else None
        out = base(lw, args, kwargs, shapes, group)
        if bounds is not None and isinstance(out, int):
            lw.integral[out] = bounds
        return out
    return lower
