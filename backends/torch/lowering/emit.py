"""Small emitters shared by the families: elementwise nodes, argument
readers, and the cuts and joins of a value along a dim (``narrow``, ``pad``
as narrow's backward, ``cat``, ``put_block``, a two-operand ``einsum``, a permutation as
transposes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def arg(args, kwargs, i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def number(lw: Lowerer, a: Any, what: str) -> float:
    value = lw.const(a)
    if value is None:
        raise LoweringError(f"{lw.name}: {what} is not a number")
    return value


def scaled(lw: Lowerer, x: int, c: float) -> int:
    if c == 1.0:
        return x
    return lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": float(c)})[0]


def shifted(lw: Lowerer, x: int, c: float) -> int:
    if c == 0.0:
        return x
    return lw.emit("add_scalar", [x], [lw.shapes[x]], {"value": float(c)})[0]


def emit_binary(lw: Lowerer, op: str, a: int, b: int) -> int:
    return lw.emit(op, [a, b], [lw.shapes[a]])[0]


def emit_unary(lw: Lowerer, op: str, x: int) -> int:
    return lw.emit(op, [x], [lw.shapes[x]])[0]


def step_times(lw: Lowerer, y: int, t: int) -> int:
    """``t * step(y)``: the relu rule's backward node."""
    return lw.emit("relu", [y, t], [lw.shapes[t]], direction="bw")[0]


def expand_to(lw: Lowerer, w: int, shape: tuple[int, ...]) -> int:
    if tuple(lw.shapes[w]) == tuple(shape):
        return w
    return lw.emit("expand", [w], [tuple(shape)], {"shape": list(shape)})[0]


def narrow(lw: Lowerer, x: int, dim: int, start: int, length: int) -> int:
    shape = list(lw.shapes[x])
    if start == 0 and length == shape[dim]:
        return x
    shape[dim] = length
    return lw.emit("narrow", [x], [tuple(shape)], {"dim": dim, "start": start, "length": length})[0]


def pad(lw: Lowerer, x: int, dim: int, before: int, after: int) -> int:
    """x with ``before`` and ``after`` zeros along dim: the ``narrow`` rule's
    backward (its input's gradient, zero outside the slice), so that the
    zeros are laid out and scaled as x is on every rank."""
    if not before and not after:
        return x
    shape = list(lw.shapes[x])
    length = shape[dim]
    shape[dim] += before + after
    return lw.emit("narrow", [-1, x], [tuple(shape)],
                   {"dim": dim, "start": before, "length": length}, direction="bw")[0]


def cat(lw: Lowerer, parts: list[int], dim: int) -> int:
    if len(parts) == 1:
        return parts[0]
    shape = list(lw.shapes[parts[0]])
    shape[dim] = sum(lw.shapes[p][dim] for p in parts)
    return lw.emit("cat", parts, [tuple(shape)], {"dim": dim})[0]


def runs(idxs: list[int]) -> list[tuple[int, int, int]]:
    """(first output, first source, length) of each run of consecutive sources."""
    found: list[tuple[int, int, int]] = []
    for j, i in enumerate(idxs):
        if found and found[-1][1] + found[-1][2] == i:
            found[-1] = (found[-1][0], found[-1][1], found[-1][2] + 1)
        else:
            found.append((j, i, 1))
    return found


def take(lw: Lowerer, x: int, dim: int, idxs: list[int]) -> int:
    """x's positions ``idxs`` along dim, in order (copies)."""
    return cat(lw, [narrow(lw, x, dim, i, n) for _, i, n in runs(idxs)], dim)


def put(lw: Lowerer, g: int, dim: int, idxs: list[int], size: int) -> int | None:
    """The adjoint of ``take``: g's positions added at their sources (repeats
    adding), zeros elsewhere along dim; None when idxs is empty."""
    total: int | None = None
    for j, i, n in runs(idxs):
        piece = pad(lw, narrow(lw, g, dim, j, n), dim, i, size - i - n)
        total = piece if total is None else lw.emit("add", [total, piece], [lw.shapes[piece]])[0]
    return total


def put_block(lw: Lowerer, x: int, starts: list[int], block: int) -> int:
    """``x`` with the block at ``starts`` (of ``block``'s shape) replaced by ``block``."""
    return put_region(lw, x, starts, [1] * len(starts), block)


def einsum(lw: Lowerer, eq: str, a: int, b: int) -> int:
    """The einsum ``eq`` of values a and b (its output shape from theirs)."""
    ins, out = eq.split("->")
    sizes: dict[str, int] = {}
    for sub, v in zip(ins.split(","), (a, b)):
        sizes.update(zip(sub, lw.shapes[v]))
    return lw.emit("einsum", [a, b], [tuple(sizes[c] for c in out)], {"eq": eq})[0]


def permuted(lw: Lowerer, x: int, order: list[int]) -> int:
    """``x.permute(order)`` as transposes."""
    current = list(range(len(order)))
    for k, want in enumerate(order):
        j = current.index(want)
        if j != k:
            dims = list(lw.shapes[x])
            dims[j], dims[k] = dims[k], dims[j]
            x = lw.emit("transpose", [x], [tuple(dims)], {"dim0": k, "dim1": j})[0]
            current[j], current[k] = current[k], current[j]
    return x


def every(lw: Lowerer, x: int, dim: int, start: int, step: int, count: int) -> int:
    """The values of x at ``start + k step`` along dim, k < count: x narrowed
    to ``[start, start + (count - 1) step + 1)``, padded with ``step - 1``
    zeros at the end, seen as ``(count, step)`` along dim and the first of
    each row kept (docs/soundness.md, "Plans traced from PyTorch", 24)."""
    if step == 1 or count <= 1:
        return narrow(lw, x, dim, start, count)
    shape = lw.shapes[x]
    if count * step == shape[dim]:
        # one entry of each row of ``step``: the dim seen as (count, step),
        # no cut of it (a rank's piece of a sharded dim is whole rows)
        rows = lw.reshape(x, (*shape[:dim], count, step, *shape[dim + 1:]))
        return lw.reshape(narrow(lw, rows, dim + 1, start, 1),
                          (*shape[:dim], count, *shape[dim + 1:]))
    x = narrow(lw, x, dim, start, (count - 1) * step + 1)
    x = pad(lw, x, dim, 0, step - 1)
    shape = lw.shapes[x]
    x = lw.reshape(x, (*shape[:dim], count, step, *shape[dim + 1:]))
    return lw.reshape(narrow(lw, x, dim + 1, 0, 1), (*shape[:dim], count, *shape[dim + 1:]))


def spread(lw: Lowerer, g: int, dim: int, start: int, step: int, size: int) -> int:
    """The adjoint of ``every``: g's values at ``start + k step`` of ``size``
    positions along dim, zeros elsewhere."""
    shape = lw.shapes[g]
    count = shape[dim]
    span = (count - 1) * step + 1
    if step > 1 and count > 1 and count * step == size:
        g = pad(lw, lw.reshape(g, (*shape[:dim], count, 1, *shape[dim + 1:])), dim + 1, start,
                step - 1 - start)
        return lw.reshape(g, (*shape[:dim], size, *shape[dim + 1:]))
    if step > 1 and count > 1:
        g = pad(lw, lw.reshape(g, (*shape[:dim], count, 1, *shape[dim + 1:])), dim + 1, 0, step - 1)
        g = narrow(lw, lw.reshape(g, (*shape[:dim], count * step, *shape[dim + 1:])), dim, 0, span)
    else:
        span = count
    return pad(lw, g, dim, start, size - start - span)


def take_region(lw: Lowerer, x: int, starts: list[int], lengths: list[int],
                 steps: list[int]) -> int:
    """The entries of x at ``starts[d] + k steps[d]``, k < ``lengths[d]``,
    along every dim d (a block when every step is 1)."""
    for d, (start, length, step) in enumerate(zip(starts, lengths, steps)):
        x = every(lw, x, d, start, step, length)
    return x


def put_region(lw: Lowerer, x: int | None, starts: list[int], steps: list[int], block: int,
               shape: tuple[int, ...] | None = None) -> int:
    """``x`` with its entries at ``starts[d] + k steps[d]`` (k below
    ``block``'s length along d) replaced by ``block``'s; ``x`` None (or made
    by a ``zeros`` node): zeros of ``shape``, each part of which is emitted as a ``zeros`` node of its own
    (no cut of a zeros node: a part of zeros is zeros by its making, which
    its readers' claims may take at any factor, docs/soundness.md, "Plans
    traced from PyTorch", 40). Along a dim with a step s > 1 and n > 1
    values, the span from the start is padded with ``s - 1`` zeros and seen
    as ``(n, s)``: the written entries are then the block at column 0 of
    that dim pair, and the padding is cut off again (docs/soundness.md,
    "Plans traced from PyTorch", 50)."""
    shape = tuple(lw.shapes[x]) if x is not None else tuple(shape)
    if x in lw.zeros_made:
        x = None
    lengths = list(lw.shapes[block])
    d = next((d for d, (s, n) in enumerate(zip(steps, lengths)) if s > 1 and n > 1), None)
    if d is None:
        d = next((d for d, n in enumerate(lengths) if n != shape[d]), None)
        if d is None:
            return block
        start, length = starts[d], lengths[d]
        inner = put_region(lw, _cut(lw, x, shape, d, start, length),
                           [0] * (d + 1) + list(starts[d + 1:]), [1] * len(shape), block,
                           _sized(shape, d, length))
        return _around(lw, x, shape, d, start, length, inner)
    step, count, start = steps[d], lengths[d], starts[d]
    span = (count - 1) * step + 1
    pair = (*shape[:d], count, step, *shape[d + 1:])
    block = lw.reshape(block, (*lengths[:d], count, 1, *lengths[d + 1:]))
    if count * step == shape[d]:
        # the dim seen as (count, step) as it is, the block at column start
        # of it (no cut: a rank's piece of a sharded dim is whole rows)
        rows = None if x is None else lw.reshape(x, pair)
        rows = put_region(lw, rows, [*starts[:d], 0, start, *starts[d + 1:]],
                          [*steps[:d], 1, 1, *steps[d + 1:]], block, pair)
        return lw.reshape(rows, shape)
    mid = _cut(lw, x, shape, d, start, span)
    if mid is not None:
        mid = lw.reshape(pad(lw, mid, d, 0, step - 1), pair)
    mid = put_region(lw, mid, [*starts[:d], 0, 0, *starts[d + 1:]],
                     [*steps[:d], 1, 1, *steps[d + 1:]], block, pair)
    mid = narrow(lw, lw.reshape(mid, (*shape[:d], count * step, *shape[d + 1:])), d, 0, span)
    return _around(lw, x, shape, d, start, span, mid)


def _sized(shape: tuple[int, ...], d: int, length: int) -> tuple[int, ...]:
    return (*shape[:d], length, *shape[d + 1:])


def _cut(lw: Lowerer, x: int | None, shape: tuple[int, ...], d: int, start: int,
         length: int) -> int | None:
    """``x`` narrowed along d (None, standing for zeros, stays None)."""
    return None if x is None else narrow(lw, x, d, start, length)


def _zeros_or_cut(lw: Lowerer, x: int | None, shape: tuple[int, ...], d: int, start: int,
                  length: int) -> int:
    if x is not None:
        return narrow(lw, x, d, start, length)
    part = _sized(shape, d, length)
    return lw.emit("zeros", [], [part], {"shape": list(part)}, direction="none")[0]


def _around(lw: Lowerer, x: int | None, shape: tuple[int, ...], d: int, start: int, length: int,
            inner: int) -> int:
    """``inner`` (``length`` entries along d) with x's entries before
    ``start`` and after ``start + length`` joined on either side."""
    parts = [_zeros_or_cut(lw, x, shape, d, 0, start)] if start else []
    parts.append(inner)
    if start + length < shape[d]:
        parts.append(_zeros_or_cut(lw, x, shape, d, start + length, shape[d] - start - length))
    return cat(lw, parts, d)


def region_dims(region: list) -> list[tuple[int, int, int, int]]:
    """``(start, length, kept, step)`` of each dim of a recorded region
    (``tracer/record.py``, ``_region``: entries without a step have step 1)."""
    return [(int(e[0]), int(e[1]), int(e[2]), int(e[3]) if len(e) > 3 else 1) for e in region]
