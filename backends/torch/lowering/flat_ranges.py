"""What a flat gradient bucket reduce-scattered into equal ranges goes through
(Megatron-Core's distributed optimizer: ``reduce_scatter_tensor`` of each
bucket inside ``_coalescing_manager``, recorded as c10d's
``reduce_scatter_tensor_coalesced_``), and of the views read from the
ranges after it; docs/soundness.md, "Plans traced from PyTorch", 56 and 57.

- the reduce-scatter of a bucket (``ir.Bucket``, its pieces side by side)
  over a group of n members gives member i elements [i S, (i + 1) S) of
  the members' buckets summed, S = numel / n: written as item 19's
  all-reduce of every piece (the same nodes on every member, so the
  members' collectives pair by order), of which the member keeps the
  elements of its range (``FlatRange``: a run of (value, lo, hi), the
  flattened elements [lo, hi) of a value, in memory order);
- a view read from such a range, or a flat part of a value (what a write
  into part of a buffer leaves of a region, ``mem.slice``), is a
  ``FlatRange`` again, or, when its elements are exactly a block of one
  value seen with the block's shape, that ``Block``: the value's elements
  at ``starts`` + [0, shape) per dim, which a final gradient may be.

Another reader gets either built: the elements themselves (``narrow`` of
the flattened values, concatenated), or, for a view of a bucket that is
not whole pieces, the elements of the bucket built, as ``bucket_view``
reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import narrow
from backends.torch.lowering.ir import Bucket, Pending, numel

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class FlatRange(Pending):
    """Elements side by side in memory order: for each part (value, lo, hi),
    the elements [lo, hi) of the value flattened (row-major). ``source``:
    the bucket and offset they were read at, if any."""
    parts: tuple[tuple[int, int, int], ...]
    source: tuple[Bucket, int] | None = None
    #: the ranks of the group whose reduce-scatter cut the range
    group: tuple[int, ...] | None = None

    def materialize(self, lw: Lowerer) -> int:
        n = sum(hi - lo for _, lo, hi in self.parts)
        if self.source is not None:
            return narrow(lw, lw.materialize(self.source[0]), 0, self.source[1], n)
        flat = [narrow(lw, lw.reshape(v, (numel(lw, v),)), 0, lo, hi - lo)
                for v, lo, hi in self.parts]
        return flat[0] if len(flat) == 1 else lw.emit("cat", flat, [(n,)], {"dim": 0})[0]


@dataclass(frozen=True)
class Block(Pending):
    """The elements of ``value`` at ``starts[d] + [0, shape[d])`` along each
    dim d, with the value's number of dims. ``source``: as ``FlatRange``'s."""
    value: int
    starts: tuple[int, ...]
    shape: tuple[int, ...]
    source: tuple[Bucket, int] | None = None

    def materialize(self, lw: Lowerer) -> int:
        if self.source is not None:
            n = math.prod(self.shape)
            flat = narrow(lw, lw.materialize(self.source[0]), 0, self.source[1], n)
            return lw.reshape(flat, self.shape)
        x = self.value
        for d, (s, n) in enumerate(zip(self.starts, self.shape)):
            x = narrow(lw, x, d, s, n)
        return x


def block_of(full: tuple[int, ...], lo: int, hi: int,
             shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The starts of the block of a row-major tensor of shape ``full`` whose
    flattened elements are exactly [lo, hi) and whose shape is ``shape``
    (as many dims as ``full``), or None when they are no such block. A
    block is contiguous in row-major order when the dims after its first
    of more than one index are whole."""
    if len(shape) != len(full) or math.prod(shape) != hi - lo or hi <= lo:
        return None
    starts, rest = [], lo
    for d in range(len(full)):
        inner = math.prod(full[d + 1:])
        starts.append(rest // inner)
        rest %= inner
    first = next((d for d, n in enumerate(shape) if n > 1), len(shape))
    if any(starts[d] != 0 or shape[d] != full[d] for d in range(first + 1, len(full))):
        return None
    if any(s + n > f for s, n, f in zip(starts, shape, full)):
        return None
    return tuple(starts)


def flat_blocks(full: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flattened elements [lo, hi) of a row-major tensor of shape
    ``full`` as blocks (starts, shape) in memory order: at most 2 ndim - 1
    of them (a partial leading row, whole rows, a partial trailing row,
    recursively along the dims)."""
    if hi <= lo:
        return []
    if len(full) <= 1:
        return [((lo,), (hi - lo,))] if full else [((), ())]
    inner = math.prod(full[1:])
    r0, r1 = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0:
        return [((r0,) + (0,) * (len(full) - 1), (r1 - r0 + 1,) + tuple(full[1:]))]
    if r0 == r1:
        return [((r0,) + s, (1,) + n) for s, n in flat_blocks(full[1:], lo % inner, hi - r0 * inner)]
    out = []
    a = lo
    if lo % inner:
        a = (r0 + 1) * inner
        out += flat_blocks(full, lo, a)
    b = hi - hi % inner
    if b > a:
        out += flat_blocks(full, a, b)
    if hi > b:
        out += flat_blocks(full, b, hi)
    return out


def parts_of(lw: Lowerer, src: Any) -> list[tuple[int, int, int]] | None:
    """The (value, lo, hi) parts of a flat source in memory order: a range's,
    a bucket's whole pieces, a value whole; None for anything else."""
    if isinstance(src, FlatRange):
        return list(src.parts)
    if isinstance(src, Block) and src.value >= 0:
        n, full = math.prod(src.shape), tuple(lw.shapes[src.value])
        lo = sum(s * math.prod(full[d + 1:]) for d, s in enumerate(src.starts))
        return [(src.value, lo, lo + n)] if block_of(full, lo, lo + n, src.shape) else None
    if isinstance(src, Bucket):
        return [(p, 0, numel(lw, p)) for p in src.pieces]
    if isinstance(src, int):
        return [(src, 0, numel(lw, src))]
    return None


def pick(parts: list[tuple[int, int, int]], offset: int, n: int) -> list[tuple[int, int, int]]:
    """Elements [offset, offset + n) of parts (value, lo, hi) side by side:
    the parts of them there, in order."""
    at, picked = 0, []
    for v, lo, hi in parts:
        a, b = max(offset, at), min(offset + n, at + hi - lo)
        if a < b:
            picked.append((v, lo + a - at, lo + b - at))
        at += hi - lo
    return picked


def read_flat(lw: Lowerer, src: Any, offset: int, shape: tuple[int, ...]) -> Any:
    """Elements [offset, offset + prod(shape)) of a flat source seen with
    ``shape``: a whole value (reshaped), a ``Block`` of one value, or
    else, for a 1-d view, a ``FlatRange``; anything else is refused."""
    if isinstance(src, (FlatRange, Block)) and src.source is not None:
        return read_flat(lw, src.source[0], src.source[1] + offset, shape)  # the same elements
    source = (src, offset) if isinstance(src, Bucket) else None
    parts = parts_of(lw, src)
    if parts is None:
        raise LoweringError(f"{lw.name}: a view of part of a buffer at offset {offset} is not "
                            f"lowered")
    picked = pick(parts, offset, math.prod(shape))
    if sum(b - a for _, a, b in picked) != math.prod(shape):
        raise LoweringError(f"{lw.name}: a view past the end of a reduced range")
    if len(picked) == 1:
        v, a, b = picked[0]
        full = tuple(lw.shapes[v])
        if (a, b) == (0, math.prod(full)):
            if len(shape) == 1 and len(full) > 1 and (isinstance(src, FlatRange)
                                                       or v in lw.params):
                # a whole value's elements, flat: kept a range, so that an
                # elementwise op or a norm of it is the op on the value (79,
                # 80), a parameter's the optimizer's step on it (90)
                return FlatRange(tuple(picked), source, getattr(src, "group", None))
            return lw.reshape(v, shape) if tuple(shape) != full else v
        starts = block_of(full, a, b, tuple(shape))
        if starts is not None:
            return Block(v, starts, tuple(shape), source)
    if len(shape) == 1:
        return FlatRange(tuple(picked), source, getattr(src, "group", None))
    if source is not None:
        return Block(-1, (), tuple(shape), source)  # no block of a value: the bucket's elements
    return mixed(lw, picked, tuple(shape))


def mixed(lw: Lowerer, picked: list[tuple[int, int, int]], shape: tuple[int, ...]) -> int:
    """A view of a range whose elements are no block of one value (a
    collective that wrote another range than the one the step reads): the
    elements themselves, in row-major order. Each row of the last dim is
    its runs' blocks (``flat_blocks``) cut from their values (a padding's
    zeros as zeros), each seen as one row piece, joined; the rows are then
    joined along each dim in turn. Exact by the definition of a row-major
    view; the rows and their joins have the view's number of dims and fit
    in its shape. They are no single-device piece: the alignment leaves them
    loose, and a stage that reads them recomputes them (docs/soundness.md,
    "Plans traced from PyTorch", 91 (b))."""
    start, width, k = len(lw.nodes), shape[-1], len(shape)
    rows = [_row(lw, pick(picked, r * width, width), k, width)
            for r in range(math.prod(shape[:-1]))]
    for d in range(k - 2, -1, -1):
        n = shape[d]
        joined = []
        for i in range(0, len(rows), n):
            part = rows[i:i + n]
            out = list(lw.shapes[part[0]])
            out[d] = n
            joined += part if n == 1 else lw.emit("cat", part, [tuple(out)], {"dim": d})
        rows = joined
    mark_mixed(lw, start)
    return rows[0]


def _row(lw: Lowerer, runs: list[tuple[int, int, int]], k: int, width: int) -> int:
    """One row of ``mixed``'s view, of shape (1, ..., 1, width): the
    runs' elements side by side along the last dim."""
    lead = (1,) * (k - 1)
    segs: list[int] = []
    for v, lo, hi in runs:
        if v in lw.zeros_made:  # a padding's zeros: as many zeros
            segs += lw.emit("zeros", [], [lead + (hi - lo,)], {"shape": [*lead, hi - lo]}, "none")
            continue
        for starts, bshape in flat_blocks(tuple(lw.shapes[v]), lo, hi):
            segs.append(lw.reshape(Block(v, starts, bshape).materialize(lw),
                                   lead + (math.prod(bshape),)))
    if len(segs) == 1:
        return segs[0]
    return lw.emit("cat", segs, [lead + (width,)], {"dim": k - 1})[0]


def mark_mixed(lw: Lowerer, start: int) -> None:
    """The outputs of the nodes emitted since node ``start``: values the
    alignment leaves loose (``Lowered.mixed``)."""
    lw.mixed.update((o, None) for node in lw.nodes[start:] for o in node.outs if o >= 0)


def whole_pieces(lw: Lowerer, bucket: Bucket, offset: int, shape: tuple[int, ...]) -> bool:
    """Elements [offset, offset + prod(shape)) of the bucket are a run of its
    whole pieces (``bucket_view`` returns them as they are)."""
    end, at, starts = offset + math.prod(shape), 0, set()
    for p in bucket.pieces:
        starts.add(at)
        at += numel(lw, p)
    starts.add(at)
    return offset in starts and end in starts and end > offset


def per_block(lw: Lowerer, handler: Any, args: Any, kwargs: dict, out_shapes: list,
              group: Any) -> Any:
    """An elementwise op whose first argument is a ``FlatRange`` and whose
    other tensor arguments hold one element each (a clip coefficient, a
    0-dim tensor): the op on each run's whole value, the result the same
    runs of the outputs. Exact: with every other operand one element
    broadcast alike, output element k of a value is the op of its element
    k alone, so the outputs' elements [lo, hi) are the op's output on the
    range's; the outputs' elements outside the range are computed but
    bound to no memory, as item 56 (a)'s all-reduced elements outside a
    rank's range (docs/soundness.md, "Plans traced from PyTorch", 79).
    With any other operand the range is built and the op runs on it."""
    key = args[0][1]
    rng = lw.env[key]
    others = [a for a in [*args[1:], *(v for k, v in kwargs.items() if k != "out")]
              if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"]
    if any(math.prod(lw.trace["shapes"][a[1]]) != 1 for a in others):
        return handler(lw, args, kwargs, out_shapes, group)
    done: dict[int, int] = {}
    try:
        for v, _, _ in rng.parts:
            if v not in done:
                lw.env[key] = v
                done[v] = lw.materialize(handler(lw, args, kwargs, [lw.shapes[v]], group))
    finally:
        lw.env[key] = rng
    return FlatRange(tuple((done[v], lo, hi) for v, lo, hi in rng.parts), None, rng.group)


def range_blocks(lw: Lowerer, rng: FlatRange) -> list[int]:
    """The blocks of a ``FlatRange``'s values (``flat_blocks`` of each run),
    each cut from its value, in memory order."""
    return [Block(v, starts, shape).materialize(lw)
            for v, lo, hi in rng.parts for starts, shape in flat_blocks(tuple(lw.shapes[v]), lo, hi)]
