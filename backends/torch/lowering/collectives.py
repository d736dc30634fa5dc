"""Collectives on lowered values: functional and in-place all-reduce,
all-gather, reduce-scatter, send and receive, and ``copy_``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.torch.errors import LoweringError
from backends.torch.lowering.bucket_pieces import all_reduce_bucket, all_reduce_runs
from backends.torch.lowering.context import LNode, pg
from backends.torch.lowering.flat_ranges import FlatRange
from backends.torch.lowering.ir import (
    Bucket,
    ChunkCat,
    Gathered,
    Norm,
    NormStack,
    Stacked,
    ZeroPadded,
)
from backends.torch.lowering.reduce_ops import premul_factor
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@lowers("aten.copy_.default")
def _copy(lw: Lowerer, args, kwargs, shapes, group):
    src = lw.env.get(args[1][1])
    if isinstance(src, ChunkCat) and src.chunks == 1:
        return src  # FSDP's gradient buffer of a one-rank shard group, copied out
    if isinstance(src, Bucket):
        return src
    if isinstance(src, FlatRange) and tuple(shapes[0]) == (sum(b - a for _, a, b in src.parts),):
        return src  # a flat range's elements copied into a flat view of as many (item 79)
    return lw.val(args[1])


#: c10d reduce ops as the rule table's collectives (sum, or the group's mean)
REDUCE_OPS = {"sum": "", "avg": "_avg"}


def _all_reduce(lw: Lowerer, args, kwargs, shapes, group):
    if args[1] not in REDUCE_OPS:
        raise LoweringError(f"{lw.name}: all_reduce with op {args[1]} is not lowered")
    return lw.emit("all_reduce" + REDUCE_OPS[args[1]], [lw.val(args[0])], shapes, group=group)[0]


@lowers(
        "_c10d_functional.all_gather_into_tensor.default",
        "_c10d_functional_autograd.all_gather_into_tensor.default",)
def _all_gather(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.env.get(args[0][1])
    if isinstance(x, ZeroPadded):
        return lw.reserve(Gathered(x.x, group, padded=True))
    return lw.reserve(Gathered(lw.val(args[0]), group))


@lowers(
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional_autograd.reduce_scatter_tensor.default",)
def _reduce_scatter(lw: Lowerer, args, kwargs, shapes, group):
    if args[1] not in REDUCE_OPS:
        raise LoweringError(f"{lw.name}: reduce_scatter with op {args[1]} is not lowered")
    x = lw.env.get(args[0][1])
    if isinstance(x, Stacked):
        if x.parts != len(group):
            raise LoweringError(f"{lw.name}: reduce_scatter of a buffer split {x.parts} ways "
                                f"over a group of {len(group)}")
        src, dim = x.x, x.dim
    else:
        src, dim = lw.val(args[0]), 0
    return lw.emit("reduce_scatter" + REDUCE_OPS[args[1]], [src], shapes, {"dim": dim},
                   group=group)[0]


@lowers("c10d.send.default")
def _send(lw: Lowerer, args, kwargs, shapes, group):
    ranks = pg(lw, args[1])
    (x,) = args[0]
    me = lw.trace["rank"]
    lw.nodes.append(LNode("send", "fw", [lw.val(x)], [], {}, lw.name, (me, ranks[int(args[2])]),
                          lw.mb))
    return []


@lowers("c10d.recv_.default")
def _recv(lw: Lowerer, args, kwargs, shapes, group):
    ranks = pg(lw, args[1])
    src, me = ranks[int(args[2])], lw.trace["rank"]
    return lw.emit("send_recv", [], shapes, {"src": src, "dst": me}, group=(src, me))


@lowers("c10d.allreduce_.default")
def _allreduce_inplace(lw: Lowerer, args, kwargs, shapes, group):
    """``dist.all_reduce(t)`` of one tensor with SUM, AVG or PREMUL_SUM(f)
    (c10d's in-place all-reduce); of FSDP's reduced buffer (HSDP's all-reduce across
    replicas, SUM or AVG), recorded on the buffer and emitted per gradient."""
    tensors, op = args[0], args[2]
    buf = lw.env.get(tensors[0][1]) if len(tensors) == 1 else None
    if isinstance(buf, Bucket):
        return [all_reduce_bucket(lw, buf, op, pg(lw, args[1]))]
    if isinstance(buf, FlatRange) and buf.source is None:
        # a distributed optimizer's grad buffer all-reduced after its reduce-scatter
        # (the tied embedding's, between the first and the last stage): item 108 (b)
        return [FlatRange(all_reduce_runs(lw, buf.parts, op, pg(lw, args[1])), None, buf.group)]
    if isinstance(buf, ChunkCat) and (buf.group is not None or buf.chunks == 1):
        if buf.replicas is not None:
            raise LoweringError(f"{lw.name}: FSDP's reduced buffer all-reduced twice")
        if op not in (["redop", 0], ("redop", 0), ["redop", 1], ("redop", 1)):
            raise LoweringError(f"{lw.name}: all-reduce of FSDP's buffer with reduce op {op} "
                                f"is not lowered")
        replicas = pg(lw, args[1])
        divide = buf.divide * (float(len(replicas)) if op[1] == 1 else 1.0)
        return [ChunkCat(buf.grads, buf.chunks, buf.group, divide, replicas)]
    kind = _C10D_REDUCES.get(int(op[1])) if len(op) == 2 and op[0] == "redop" else None
    factor = premul_factor(op)
    if len(tensors) != 1 or kind is None and factor is None:
        raise LoweringError(f"{lw.name}: c10d allreduce_ other than a SUM, an AVG or a "
                            f"PREMUL_SUM of one tensor is not lowered")
    x = lw.val(tensors[0])
    if factor is not None:  # the sum of f * x
        x, kind = lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": factor})[0], "all_reduce"
    return [lw.emit(kind, [x], shapes[:1], group=pg(lw, args[1]))[0]]


#: c10d's ``ReduceOp`` numbers lowered by the in-place all-reduce: SUM, AVG
#: (the sum divided by the group's size; docs/soundness.md, "Plans traced
#: from PyTorch", 120)
_C10D_REDUCES = {0: "all_reduce", 1: "all_reduce_avg"}


@lowers("_c10d_functional.all_reduce.default")
def _all_reduce_pending(lw: Lowerer, args, kwargs, shapes, group):
    """DTensor's reduction of partial norms: the squared stack summed over the
    group. A square sum that is a partial sum over the group is all-reduced;
    a replicated one, divided by the group size on each of its ranks, sums
    back to itself (the n shares of s / n are s), so it is kept."""
    x = lw.env.get(args[0][1])
    if not isinstance(x, NormStack) or not x.squared:
        return _all_reduce(lw, args, kwargs, shapes, group)
    if args[1] != "sum":
        raise LoweringError(f"{lw.name}: all_reduce of norms with op {args[1]} is not lowered")
    out = []
    for norm in x.norms:
        if norm.share == 1:
            s = lw.emit("all_reduce", [norm.s], [lw.shapes[norm.s]], group=group)[0]
        elif norm.share == len(group):
            s = norm.s
        else:
            raise LoweringError(f"{lw.name}: a norm shared {norm.share} ways reduced over "
                                f"{len(group)} ranks")
        out.append(Norm(s))
    return NormStack(tuple(out), squared=True)
