"""Megatron's parameter buffer around the distributed optimizer's step:
the buffer read as the values its regions hold side by side, views of it,
and ``start_param_sync``'s all-gather of every rank's updated range back
into it; docs/soundness.md, "Plans traced from PyTorch", 90 (b), (c).

- ``mem.cat`` of regions one of which is a ``FlatRange`` (a range written
  into part of a parameter's region, or a gradient's region cut by a
  reduce-scatter) is the ``FlatRange`` of all their elements in memory
  order (before, each region was built first, a range as a narrow of a
  flattened value); a view or a 1-d slice of a ``FlatRange`` is its
  elements there (``flat_ranges.read_flat``).
- ``allgather_into_tensor_coalesced_`` over a group of n members, of an
  input of S elements into an output of n S: member j's elements are
  [j S, (j + 1) S) of the output. The rank's own are its input's
  (``Gathered.mine``); a view of the output is ``Assembled``: for each
  member whose elements it holds, the rank's own elements, or the
  member's input there, which the plan writer takes from that member's
  lowering (``walk.resolve_gathers``) and sends to the rank, block by
  block (``tracer.build``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import pg
from backends.torch.lowering.flat_ranges import Block, FlatRange, parts_of, pick, read_flat
from backends.torch.lowering.ir import Bucket, numel
from backends.torch.lowering.registry import Handler, lowers, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: a run of a parameter's final elements: ("own", value, lo, hi) on this
#: rank, or ("member", rank, group, k, offset, n): elements [offset, offset
#: + n) of that member's input to its k-th all-gather over the group
Run = tuple


@dataclass(frozen=True)
class Gathered:
    """The output of an all-gather of flat ranges (not Pending: only views
    of it are read)."""
    ranks: tuple[int, ...]
    k: int
    size: int
    mine: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Assembled:
    """A view of a gathered buffer: its runs in memory order (``Run``), read
    only as a final parameter."""
    runs: tuple[Run, ...]
    shape: tuple[int, ...]


def _env(lw: Lowerer, a: Any) -> Any:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v":
        return lw.env.get(a[1])
    return None


def _flat_parts(lw: Lowerer, x: Any) -> list[tuple[int, int, int]]:
    parts = parts_of(lw, x)
    if parts is None:
        v = lw.materialize(x)
        parts = [(v, 0, numel(lw, v))]
    return parts


@refines("mem.cat")
def mem_cat_ranges(base: Handler) -> Handler:
    """Regions side by side, one of them a flat range: their elements."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        items = [_env(lw, a) for a in args[0]]
        if not any(isinstance(x, FlatRange) for x in items):
            return base(lw, args, kwargs, shapes, group)
        parts: list[tuple[int, int, int]] = []
        for x in items:
            parts += _flat_parts(lw, x)
        return FlatRange(tuple(parts))
    return lower


@refines("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
def view_range(base: Handler) -> Handler:
    """A view of a flat range: its elements with the view's shape."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, FlatRange) and x.source is None:
            return read_flat(lw, x, 0, tuple(shapes[0]))
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.slice.Tensor")
def slice_range(base: Handler) -> Handler:
    """``flat[a:b]`` of a 1-d flat range: its elements there."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if not (isinstance(x, FlatRange) and x.source is None):
            return base(lw, args, kwargs, shapes, group)
        dim = int(args[1]) if len(args) > 1 else 0
        start = int(args[2]) if len(args) > 2 and args[2] is not None else 0
        step = int(args[4]) if len(args) > 4 else 1
        if dim != 0 or step != 1 or len(shapes[0]) != 1:
            raise LoweringError(f"{lw.name}: a strided or multi-dim slice of a flat range is "
                                f"not lowered")
        total = sum(hi - lo for _, lo, hi in x.parts)
        start = start + total if start < 0 else start
        return read_flat(lw, x, start, tuple(shapes[0]))
    return lower


@lowers("c10d.allgather_into_tensor_coalesced_.default")
def gather_ranges(lw: Lowerer, args, kwargs, shapes, group) -> list:
    """Each input (this rank's range of a buffer) all-gathered into its
    output (the whole buffer) over the group: a ``Gathered`` per output."""
    outs, ins, ranks = args[0], args[1], pg(lw, args[2])
    me = lw.trace["rank"]
    if me not in ranks:
        raise LoweringError(f"{lw.name}: an all-gather over a group without this rank")
    result = []
    for out, inp in zip(outs, ins):
        size = math.prod(lw.trace["shapes"][inp[1]])
        if math.prod(lw.trace["shapes"][out[1]]) != size * len(ranks):
            raise LoweringError(f"{lw.name}: an all-gather of {size} elements into "
                                f"{math.prod(lw.trace['shapes'][out[1]])} over {len(ranks)} ranks")
        x = _env(lw, inp)
        if x is None:
            raise LoweringError(f"{lw.name}: all-gathers a tensor no recorded op produced")
        parts = tuple(_flat_parts(lw, x))
        k = lw.range_gathers.setdefault(tuple(ranks), [])
        k.append(parts)
        result.append(Gathered(tuple(ranks), len(k) - 1, size, parts))
    return result


@refines("mem.slice")
def slice_gathered(base: Handler) -> Handler:
    """A view of a gathered buffer (a parameter after ``start_param_sync``):
    for each member whose range it crosses, the rank's own elements or the
    member's there."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        src = _env(lw, args[0])
        if not isinstance(src, Gathered):
            return base(lw, args, kwargs, shapes, group)
        offset, shape = int(args[1]), tuple(args[2])
        end, runs = offset + math.prod(shape), []
        me = src.ranks.index(lw.trace["rank"])
        for j, member in enumerate(src.ranks):
            a, b = max(offset, j * src.size), min(end, (j + 1) * src.size)
            if a >= b:
                continue
            if j == me:
                runs += [("own", v, lo, hi) for v, lo, hi in pick(list(src.mine), a - j * src.size,
                                                                  b - a)]
            else:
                runs.append(("member", member, src.ranks, src.k, a - j * src.size, b - a))
        return Assembled(tuple(runs), shape)
    return lower


def own_runs(lw: Lowerer, x: Any) -> tuple[Run, ...] | None:
    """A final parameter or state that is elements of values side by side
    (a flat range, a block, a gathered view): its runs; None for a value."""
    if isinstance(x, Assembled):
        return x.runs
    if isinstance(x, FlatRange) and x.source is None:
        return tuple(("own", v, lo, hi) for v, lo, hi in x.parts)
    if isinstance(x, (Block, Bucket)):
        parts = parts_of(lw, x)
        return None if parts is None else tuple(("own", v, lo, hi) for v, lo, hi in parts)
    return None
