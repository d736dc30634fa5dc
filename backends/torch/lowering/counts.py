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
from backends.torch.lowering.emit import cat, einsum, pad
from backends.torch.lowering.integer_rows import (
    MAX_POINTS,
    bounded_value,
    integer_bounds,
    integer_points,
    integer_type,
    one_hot_rows,
    scaled_rows,
    spread,
)
from backends.torch.lowering.ir import Complex, Const, Flag, IdRows, Ids, complex_parts, pending_of
from backends.torch.lowering.onehot import id_rows
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

@refines("aten._to_copy.default", "aten.to.dtype")
def convert(base: Handler) -> Handler:
    """A bounded integer converted to an integer type is itself; a flag
    converted to one keeps its bounds (0, 1)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        bounds = integer_bounds(lw, args[0])
        dtype = str(kwargs.get("dtype", args[1] if len(args) > 1 else ""))
        x = pending_of(lw, args[0])
        if bounds is not None and isinstance(x, int) and integer_type(dtype):
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
        bounds = integer_bounds(lw, args[0])
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
            a, b = integer_bounds(lw, args[0]), integer_bounds(lw, args[1]) if len(args) > 1 else None
            alpha = kwargs.get("alpha", 1)
            out = base(lw, args, kwargs, shapes, group)
            if a is None or b is None or not isinstance(out, int) or alpha != int(alpha) \
                    or not any(isinstance(pending_of(lw, x), (int, Flag)) for x in args[:2]):
                return out
            sign = int(alpha) if op == "add" else -int(alpha)

            def made_of(p: int, q: int) -> int:
                return p * q if op == "mul" else p + sign * q

            ends = [made_of(p, q) for p in a for q in b]
            lw.integral[out] = (min(ends), max(ends))
            pa, pb = integer_points(lw, args[0]), integer_points(lw, args[1])
            if pa is not None and pb is not None and len(pa) * len(pb) <= MAX_POINTS ** 2:
                made = {made_of(p, q) for p in pa for q in pb}
                if len(made) < lw.integral[out][1] - lw.integral[out][0] + 1:
                    lw.integral_sets[out] = tuple(sorted(made))
            return out
        return lower
    return refine


refines("aten.add.Tensor", "aten.add.Scalar")(_combined("add"))
refines("aten.sub.Tensor", "aten.sub.Scalar")(_combined("sub"))
refines("aten.mul.Tensor", "aten.mul.Scalar")(_combined("mul"))


@refines("aten.embedding.default")
def lookup(base: Handler) -> Handler:
    """A table looked up at bounded integers: the one-hot rows times the table."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        v = bounded_value(lw, args[1])
        ids = pending_of(lw, args[1])
        if isinstance(ids, IdRows) and lw.shapes[ids.x][-1] > lw.vocab:
            # ids joined with constant ids past the vocabulary (``joined``):
            # their rows widened to the table's
            table = lw.val(args[0])
            rows, width = lw.shapes[table][0], lw.shapes[ids.x][-1]
            if width > rows:
                raise LoweringError(f"{lw.name}: a table of {rows} rows looked up at ids up to "
                                    f"{width - 1}")
            onehot = pad(lw, ids.x, len(lw.shapes[ids.x]) - 1, 0, rows - width)
            return lw.emit("embedding", [onehot, table], shapes)[0]
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
        v = bounded_value(lw, args[1])
        ids = pending_of(lw, args[1])
        wide = isinstance(ids, IdRows) and lw.shapes[ids.x][-1] > lw.vocab
        if v is None and not wide:
            return base(lw, args, kwargs, shapes, group)
        if len(args) > 4 and args[4]:
            raise LoweringError(f"{lw.name}: embedding backward with scale_grad_by_freq is not "
                                f"lowered")
        rows = int(args[2])
        if wide:  # ids joined with constant ids past the vocabulary (``joined``)
            width = lw.shapes[ids.x][-1]
            if width > rows:
                raise LoweringError(f"{lw.name}: a table of {rows} rows looked up at ids up to "
                                    f"{width - 1}")
            tokens = pad(lw, ids.x, len(lw.shapes[ids.x]) - 1, 0, rows - width)
        else:
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
    """``x.gather(d, v)`` at bounded integers v (RoBERTa's token types
    picked at its positions along the last dim; torchtitan's rotary table
    gathered at a rank's positions along the sequence): the sum over dim d
    of x times v's one-hot rows, v's other dims those of x; integers
    picked from integers keep x's bounds."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        v = bounded_value(lw, args[2])
        if v is None:
            return base(lw, args, kwargs, shapes, group)
        nd = len(shapes[0])
        dim = int(args[1]) % nd
        others = [k for k in range(nd) if k != dim]
        parts = complex_parts(lw, args[0])
        x = parts[0] if parts is not None else lw.val(args[0])
        if nd > 8 or len(lw.shapes[v]) != nd or \
                [lw.shapes[x][k] for k in others] != [lw.shapes[v][k] for k in others]:
            raise LoweringError(f"{lw.name}: a gather at integers computed from the ids of an "
                                f"index whose other dims are not the tensor's")
        rows = one_hot_rows(lw, v, lw.shapes[x][dim])
        letters = "abcdefgh"[:nd]
        at = lambda c: letters[:dim] + c + letters[dim + 1:]  # noqa: E731
        spec = f"{at('z')},{at('y')}z->{at('y')}"
        parts = complex_parts(lw, args[0])
        if parts is not None and parts[1] is not None:  # a complex table: each part gathered
            return Complex(einsum(lw, spec, parts[0], rows), einsum(lw, spec, parts[1], rows))
        out = einsum(lw, spec, x, rows)
        bounds = integer_bounds(lw, args[0])
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
    """Bounded integers reshaped, repeated, cut or moved: the same numbers;
    a flag so moved, a flag (its recorded booleans the op's recorded output)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = pending_of(lw, args[0])
        bounds = integer_bounds(lw, args[0]) if isinstance(x, (int, Const)) else None
        out = base(lw, args, kwargs, shapes, group)
        recorded = _recorded(lw)
        if isinstance(x, Flag) and not isinstance(out, Flag) and recorded is not None:
            return Flag(lw.materialize(out), np.asarray(recorded, dtype=bool))
        if bounds is not None and isinstance(out, int):
            lw.integral[out] = bounds
        return out
    return lower


# -- sums, selections and comparisons of bounded integers ------------------------------

def _computed(lw: Lowerer, a: Any) -> int | None:
    """The lowered value of a bounded integer or a flag argument (a flag's
    0/1 value bounded by [0, 1]); None for a number, a constant or anything
    else."""
    x = pending_of(lw, a)
    if isinstance(x, Flag):
        lw.integral.setdefault(x.x, (0, 1))
        return x.x
    return x if isinstance(x, int) and x in lw.integral else None


@refines("aten.sum.dim_IntList")
def summed(base: Handler) -> Handler:
    """A sum over some dims of a flag or of bounded integers (``(ids !=
    pad).sum(-1)``, each row's length): n entries in [lo, hi] sum to an
    integer in [n lo, n hi]. A whole flag summed to one number stays the
    recorded count (``masks.count``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        v = _computed(lw, args[0])
        if v is None or tuple(shapes[0]) == ():
            return base(lw, args, kwargs, shapes, group)
        lo, hi = lw.integral[v]
        out = base(lw, args, {k: x for k, x in kwargs.items() if k != "dtype"}, shapes, group)
        n = int(np.prod(lw.shapes[v])) // max(int(np.prod(shapes[0])), 1)
        if isinstance(out, int):
            lw.integral[out] = (min(lo, n * lo), max(hi, n * hi))
        return out
    return lower


@refines("aten.where.self")
def selected(base: Handler) -> Handler:
    """``where(flag, a, b)`` between bounded integers (or integer numbers or
    constants): ``b + flag (a - b)``, an integer taking a's or b's values
    (``where(ids != 0, 2, 0)`` is 0 or 2)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        cond = pending_of(lw, args[0])
        pa, pb = integer_points(lw, args[1]), integer_points(lw, args[2])
        bounds = [integer_bounds(lw, a) for a in args[1:3]]
        integral = [isinstance(a, (int, bool)) or _computed(lw, a) is not None
                    or isinstance(pending_of(lw, a), Const) for a in args[1:3]]
        if not isinstance(cond, Flag) or None in bounds or not all(integral) \
                or (pa is None or pb is None) and not any(_computed(lw, a) for a in args[1:3]):
            return base(lw, args, kwargs, shapes, group)
        shape = tuple(shapes[0])
        if all(isinstance(a, (int, bool)) for a in args[1:3]):
            out = base(lw, args, kwargs, shapes, group)
        else:
            m = spread(lw, cond.x, shape)
            a, b = (spread(lw, _operand(lw, x), shape) for x in args[1:3])
            gap = lw.emit("sub", [a, b], [shape])[0]
            out = lw.emit("add", [b, lw.emit("mul", [m, gap], [shape])[0]], [shape])[0]
        if isinstance(out, int):
            ends = [e for bound in bounds for e in bound]
            lw.integral[out] = (min(ends), max(ends))
            if pa is not None and pb is not None:
                taken = tuple(sorted(set(pa) | set(pb)))
                if len(taken) < taken[-1] - taken[0] + 1:
                    lw.integral_sets[out] = taken
            if not all(isinstance(a, (int, bool)) for a in args[1:3]):
                branches = [_computed(lw, a) if _computed(lw, a) is not None else
                            a if isinstance(a, (int, bool)) else a for a in args[1:3]]
                lw.integral_where[out] = (cond.x, *branches)
        return out
    return lower


def _recorded(lw: Lowerer) -> np.ndarray | None:
    """The recorded value of the current op's first output, when the
    recorder kept it (a small integer or boolean tensor)."""
    events = lw.trace.get("events", [])
    outs = events[lw.event][2] if 0 <= lw.event < len(events) else []
    return lw.trace.get("int_values", {}).get(outs[0]) if outs else None


def _operand(lw: Lowerer, a: Any) -> int:
    """A number or tensor argument as a lowered value."""
    if isinstance(a, (int, float, bool)):
        return constant_input(lw, np.asarray(float(a)))
    return lw.val(a)


#: a comparison's truth at two integers, and the comparison with its sides swapped
COMPARISONS = {"eq": (np.equal, "eq"), "ne": (np.not_equal, "ne"), "lt": (np.less, "gt"),
               "le": (np.less_equal, "ge"), "gt": (np.greater, "lt"), "ge": (np.greater_equal, "le")}


def _compared(op: str):
    def refine(base: Handler | None) -> Handler:
        """``a op b`` where a or b is a bounded integer (or a flag) and the
        other a bounded integer, an integer number or a constant: the flag
        ``sum_j [a == j] [j op b]`` over a's one-hot rows (``value_rows``),
        with b's rows too when b is computed (``sum_jk [a == j] [b == k]
        [j op k]``). Exact wherever a and b take the integers their bounds
        say (docs/soundness.md, "Plans traced from PyTorch",
        51). cpmant's ``arange(S) < length[:, None]``, its equal
        segments."""
        def lower(lw: Lowerer, args, kwargs, shapes, group):
            a, b = args[0], args[1]
            name = op
            if _computed(lw, a) is None and _computed(lw, b) is not None:
                a, b, name = b, a, COMPARISONS[op][1]
            v = _computed(lw, a)
            if v is None or integer_points(lw, b) is None:
                if base is None:
                    raise LoweringError(f"{lw.name}: a comparison ({op}) of two computed "
                                        f"tensors other than integers counted from the ids "
                                        f"(bounded) or the backward of torch.maximum/minimum is "
                                        f"not lowered")
                return base(lw, args, kwargs, shapes, group)
            shape = tuple(shapes[0])
            truth = COMPARISONS[name][0]
            lo, hi = lw.integral[v]
            columns = np.arange(lo, hi + 1)
            first, common = scaled_rows(lw, v)
            rows = spread(lw, first, (*shape, len(columns)))
            w = _computed(lw, b)
            if w is None:
                other = np.asarray(b if isinstance(b, (int, float, bool)) else constant_value(lw, b))
                table = truth(columns, np.broadcast_to(other, shape)[..., None]).astype(np.float64)
                picked = lw.emit("mul", [rows, constant_input(lw, table)], [(*shape, len(columns))])[0]
            else:
                lo2, hi2 = lw.integral[w]
                second = np.arange(lo2, hi2 + 1)
                table = truth(columns[:, None], second[None, :]).astype(np.float64)
                lead = "abcdefgh"[:len(shape)]
                through = einsum(lw, f"{lead}j,jk->{lead}k", rows, constant_input(lw, table))
                second_rows, scale = scaled_rows(lw, w)
                common *= scale
                other_rows = spread(lw, second_rows, (*shape, len(second)))
                picked = lw.emit("mul", [through, other_rows], [(*shape, len(second))])[0]
            x = lw.emit("sum", [picked], [shape], {"dim": len(shape), "keepdim": False})[0]
            if common != 1:
                x = lw.emit("div", [x], [shape], {"value": float(common)})[0]
            recorded = _recorded(lw)
            if recorded is None:
                raise LoweringError(f"{lw.name}: a comparison ({op}) of integers counted from the "
                                    f"ids whose recorded value is missing")
            return Flag(x, np.asarray(recorded, dtype=bool).reshape(shape))
        return lower
    return refine


for _op in COMPARISONS:
    refines(f"aten.{_op}.Tensor", f"aten.{_op}.Scalar", absent=lambda op: None)(_compared(_op))


@refines("aten.cat.default")
def joined(base: Handler) -> Handler:
    """A ``cat`` of the batch's ids with constant ids (CPM-Ant's prompt ids
    before its tokens): one-hot rows as wide as the largest id needs, each
    part's rows (ids padded with zero columns, constants as constant rows)
    joined; of flags and constant masks: a flag; of bounded integers and
    integer constants: a bounded integer (the hull of the bounds, the union
    of the sets)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        parts = list(args[0]) if isinstance(args[0], (list, tuple)) else []
        dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
        found = [pending_of(lw, p) for p in parts]
        if not parts or not any(isinstance(x, (Ids, IdRows, Flag)) or _computed(lw, p) is not None
                                for p, x in zip(parts, found)):
            return base(lw, args, kwargs, shapes, group)
        consts = [np.asarray(constant_value(lw, p)) if isinstance(x, Const) else None
                  for p, x in zip(parts, found)]
        if any(x is not None and not isinstance(x, Const) and c is None
               for x, c in zip(found, consts)) and not all(
                isinstance(x, (Ids, IdRows, Flag, Const)) or _computed(lw, p) is not None
                for p, x in zip(parts, found)):
            return base(lw, args, kwargs, shapes, group)
        if any(isinstance(x, (Ids, IdRows)) for x in found):
            return _joined_ids(lw, parts, found, consts, dim)
        if all(isinstance(x, Flag) or c is not None and c.dtype == bool
               for x, c in zip(found, consts)):
            flags = [x if isinstance(x, Flag) else None for x in found]
            d = dim % len(shapes[0])
            values = np.concatenate([f.value if f is not None else c
                                     for f, c in zip(flags, consts)], axis=d)
            xs = [f.x if f is not None else constant_input(lw, c.astype(np.float64))
                  for f, c in zip(flags, consts)]
            return Flag(cat(lw, xs, d), values)
        bounds = [integer_bounds(lw, p) for p in parts]
        if None in bounds:
            return base(lw, args, kwargs, shapes, group)
        out = base(lw, args, kwargs, shapes, group)
        if isinstance(out, int):
            ends = [e for bound in bounds for e in bound]
            lw.integral[out] = (min(ends), max(ends))
            points = [integer_points(lw, p) for p in parts]
            if None not in points:
                taken = tuple(sorted(set().union(*points)))
                if len(taken) < taken[-1] - taken[0] + 1:
                    lw.integral_sets[out] = taken
        return out
    return lower


def _joined_ids(lw: Lowerer, parts: list, found: list, consts: list, dim: int) -> IdRows:
    """Ids and constant ids joined along ``dim`` as one-hot rows."""
    values = []
    for p, x, c in zip(parts, found, consts):
        if isinstance(x, (Ids, IdRows)):
            values.append(np.asarray(id_rows(lw, p).ids))
        elif c is not None and c.dtype.kind in "iu":
            values.append(c)
        else:
            raise LoweringError(f"{lw.name}: the batch's ids joined (cat) with other than "
                                f"constant integer ids")
    if any(np.any(v < 0) for v in values):
        raise LoweringError(f"{lw.name}: the batch's ids joined (cat) with negative ids")
    width = max(lw.vocab, *(int(v.max()) + 1 for v in values if v.size))
    d = dim % values[0].ndim
    rows = []
    for p, x, v in zip(parts, found, values):
        if isinstance(x, (Ids, IdRows)):
            r = id_rows(lw, p).x
            rows.append(pad(lw, r, len(lw.shapes[r]) - 1, 0, width - lw.shapes[r][-1]))
        else:
            rows.append(constant_input(lw, (v[..., None] == np.arange(width)).astype(np.float64)))
    return IdRows(cat(lw, rows, d), np.concatenate(values, axis=d))


# -- rows of a table at a constant index of several dims -------------------------------

def _constant_index(lw: Lowerer, indices: Any, rows: int) -> np.ndarray | None:
    """The one index of ``x[idx]`` when it is a constant of integers of two
    or more dims (positions ``[1, S]`` looked up in a table: Whisper's), its
    negative entries counted from the end; None otherwise (a 1-d index keeps
    the lowering of recorded rows)."""
    if not isinstance(indices, (list, tuple)) or len(indices) != 1:
        return None
    if not isinstance(pending_of(lw, indices[0]), Const):
        return None
    value = constant_value(lw, indices[0])
    if value is None or value.dtype.kind not in "iu" or value.ndim < 2:
        return None
    value = np.where(value < 0, value + rows, value).astype(np.int64)
    if value.size and (value.min() < 0 or value.max() >= rows):
        raise LoweringError(f"{lw.name}: a table of {rows} rows indexed at a constant outside them")
    return value


@refines("aten.index.Tensor")
def rows_at_constant(base: Handler) -> Handler:
    """``x[idx]`` with a constant integer index of several dims: the constant
    one-hot rows of idx times x's rows (an ``embedding`` of x seen as a
    table), repeated rows included."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = pending_of(lw, args[0])
        table_shape = lw.shapes.get(x) if isinstance(x, int) else None
        index = _constant_index(lw, args[1], table_shape[0]) if table_shape else None
        if index is None:
            return base(lw, args, kwargs, shapes, group)
        rows, width = table_shape[0], int(np.prod(table_shape[1:]))
        table = lw.reshape(x, (rows, width))
        onehot = constant_input(lw, (index[..., None] == np.arange(rows)).astype(np.float64))
        out = lw.emit("embedding", [onehot, table], [(*index.shape, width)])[0]
        return lw.reshape(out, tuple(shapes[0]))
    return lower


@refines("aten.index_put.default", "aten.index_put_.default")
def rows_put_at_constant(base: Handler) -> Handler:
    """The backward of ``rows_at_constant``: ``index_put`` with
    ``accumulate`` into zeros at the same constant index, the rows' gradient
    summed into each row they came from (the ``embedding`` rule's backward)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        zeros = type(pending_of(lw, args[0])).__name__ == "NewZeros"
        shape = tuple(shapes[0])
        index = _constant_index(lw, args[1], shape[0]) if accumulate and zeros else None
        if index is None:
            return base(lw, args, kwargs, shapes, group)
        rows, width = shape[0], int(np.prod(shape[1:]))
        onehot = constant_input(lw, (index[..., None] == np.arange(rows)).astype(np.float64))
        grad = lw.reshape(lw.val(args[2]), (*index.shape, width))
        out = lw.new((rows, width))
        lw.nodes.append(LNode("embedding", "bw", [onehot, -1, grad], [-1, out], {}, lw.name,
                              None, lw.mb))
        return lw.reshape(out, shape)
    return lower
