"""Shards of a dim their group does not divide (torch.chunk's pieces of
ceil(rows / n), FSDP2's and DTensor's padded shards): which rows a member
holds, and the gathers and reductions that keep every padding value out of
the plan (docs/soundness.md, "Plans traced from PyTorch", 15). Shared by
the layout family's views, slices and FSDP's copy-out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import LNode, tensor_args
from backends.torch.lowering.ir import ChunkCat, GatheredAlong, NoShard

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def padded_rows(rows: int, n: int, index: int) -> tuple[int, int]:
    """The rows [lo, hi) of a dim of ``rows`` that member ``index`` of ``n``
    holds when FSDP2 (or DTensor's ``Shard``) cuts it in chunks of
    ceil(rows / n) (``torch.chunk``; the last members may hold fewer rows,
    or none)."""
    c = -(-rows // n)
    return min(index * c, rows), min((index + 1) * c, rows)


def sliced_next(lw: Lowerer, dim: int) -> bool:
    """The first op that reads the current event's output is a slice of it
    along ``dim`` from 0 (DTensor dropping an uneven shard's padding)."""
    out = lw.trace["events"][lw.event][2][0]
    for op, (args, kwargs), *_ in lw.trace["events"][lw.event + 1:]:
        if out in tensor_args([args, kwargs]):
            return (op == "aten.slice.Tensor" and len(args) > 2
                    and int(args[1]) % len(lw.trace["shapes"][out]) == dim and not args[2])
    return False


def drops_padding(lw: Lowerer, src: GatheredAlong, rows: int, total: int) -> bool:
    """The first ``rows`` of a gather along a dim (``total`` long) are the
    pieces of an uneven shard without their padding: the gathered pieces
    are chunks of ceil(rows / n), and this rank's own piece is its chunk of
    ``rows`` (padded to the chunk when shorter)."""
    n, d = len(src.g.group), src.dim
    chunk = -(-rows // n)
    lo, hi = padded_rows(rows, n, src.g.group.index(lw.trace["rank"]))
    own = lw.shapes[src.g.x][d]
    return (rows < total == chunk * n and own == hi - lo
            and (src.g.padded or own == chunk))


def uneven_gather(lw: Lowerer, src: GatheredAlong, rows: int) -> int:
    """DTensor's all-gather of a dim of ``rows`` the group does not divide:
    each member's piece padded at the end to ceil(rows / n), gathered, the
    first ``rows`` kept. Those are the members' own pieces in group order
    (the padding lies past them): written as for FSDP2's padded parameter
    (docs/soundness.md, "Plans traced from PyTorch", 15e)."""
    g, d = src.g, src.dim
    n = len(g.group)
    full = list(lw.shapes[g.x])
    full[d] = rows
    if not g.padded and lw.shapes[g.x][d] * n == rows:
        return lw.materialize(src)
    g.written = True
    return gather_pieces(lw, g.x, tuple(full), d, g.group, "a DTensor shard")


def gather_pieces(lw: Lowerer, own: Any, full: tuple[int, ...], dim: int,
                   group: tuple[int, ...], what: str) -> int:
    """The whole of a dim that ``group`` holds in torch.chunk's pieces (this
    rank's is ``own``): each member's piece sent to every other member and
    the pieces concatenated along ``dim`` in group order (one holder: its
    piece alone)."""
    me, n = lw.trace["rank"], len(group)
    bounds = [padded_rows(full[dim], n, i) for i in range(n)]
    lo, hi = bounds[group.index(me)]

    def shape(a: int, b: int) -> tuple[int, ...]:
        return tuple(b - a if k == dim else m for k, m in enumerate(full))

    if hi > lo and (not isinstance(own, int) or lw.shapes[own] != shape(lo, hi)):
        raise LoweringError(f"{lw.name}: rank {me}'s piece of {what} is not [{lo}, {hi}) of its "
                            f"{full[dim]} along dim {dim}, as torch.chunk cuts it over {n} ranks")
    if hi > lo:
        for dst in group:
            if dst != me:
                lw.nodes.append(LNode("send", "fw", [own], [], {}, lw.name, (me, dst), lw.mb))
    pieces = []
    for src, (a, b) in zip(group, bounds):
        if b == a:
            continue
        if src == me:
            pieces.append(own)
            continue
        pieces.append(lw.emit("send_recv", [], [shape(a, b)], {"src": src, "dst": me},
                              group=(src, me))[0])
    if len(pieces) == 1:
        return pieces[0]
    return lw.emit("cat", pieces, [full], {"dim": dim})[0]


def padded_gather(lw: Lowerer, name: str, param: int, group: tuple[int, ...]) -> int:
    """FSDP2's all-gather of a parameter whose dim 0 the group does not
    divide: the gathered buffer's first rows are the members' own rows in
    group order, the padding after them. Each member's rows are sent to
    every other member and concatenated in group order, so no padding value
    enters the plan (docs/soundness.md, "Plans traced from PyTorch", 15).
    Only dim 0 is gathered whole: the other dims are the rank's own (a
    tensor-parallel shard's where another mesh axis cuts them; every member
    of a dp group sits at the same tp index, so holds the same), item 109."""
    v, full, _ = lw.trace["params"][name]
    local = lw.trace["shapes"][v]
    return gather_pieces(lw, lw.env.get(param), (full[0], *local[1:]), 0, group, name)


def padded_reduce(lw: Lowerer, src: ChunkCat, g: int, size: list[int]) -> int | NoShard:
    """A rank's shard of FSDP2's reduce-scatter of a gradient whose dim 0
    the group does not divide (each gradient padded with zero rows to a
    chunk per rank): rows [lo, hi) of the group's sum, written as the
    group's all-reduce narrowed to the rank's rows (under HSDP then summed
    over the replicas, the same rows of the other shard groups). A rank
    holding no rows still joins the all-reduce, which its peers run, and
    keeps nothing (docs/soundness.md, "Plans traced from PyTorch", 15)."""
    shape = list(lw.shapes[g])
    lo, hi = padded_rows(shape[0], len(src.group), src.group.index(lw.trace["rank"]))
    if list(size) != [hi - lo, *shape[1:]]:
        raise LoweringError(f"{lw.name}: a view of FSDP's reduce-scatter output of shape {size} "
                            f"is not this rank's rows [{lo}, {hi}) of a gradient of {shape[0]}")
    x = lw.emit("all_reduce", [g], [shape], group=src.group)[0]
    if hi == lo:
        return NoShard(g, src.group)
    if hi - lo != shape[0]:
        x = lw.emit("narrow", [x], [size], {"dim": 0, "start": lo, "length": hi - lo})[0]
        lw.row_cuts[x] = src.group
    if src.replicas is not None:
        x = lw.emit("all_reduce", [x], [size], group=src.replicas)[0]
    if src.divide != 1.0:
        x = lw.emit("div", [x], [size], {"value": src.divide})[0]
    return x
