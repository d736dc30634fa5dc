"""A strided parameter in the parallel plan (docs/soundness.md, "Plans
traced from PyTorch", 87): loaded as its k blocks of the single-device
parameter joined by a ``cat`` (each block a load the loaded-value check
confirms: ``check.check_loaded``), its final gradient the k blocks of the
rank's own local gradient cut by ``narrow`` nodes, each claimed as the
single-device gradient's block at the parameter's and accumulated into its
zeroed block of the gradient buffer (the plan's world says ``grad_blocks``:
the final check reads each block and requires the ranks' blocks to cover
every parameter, ``verdict/final.py``)."""

from __future__ import annotations

from typing import Any

from backends.torch.lowering import LoweringError
from backends.torch.tracer.align.claim import scope, strided
from verdict.plan import Node, Tensor


def _pieces(r: Any, v: int, name: str) -> list:
    pieces = r.strided_pieces(v)
    if not pieces:
        raise LoweringError(f"rank {r.low.rank}: {name} of shape {list(r.low.shapes[v])} is "
                            f"placed as a strided shard its sizes do not divide into equal "
                            f"parts (claim {r.claim[v].dims}): not lowered")
    return pieces


def strided_input(writer: Any, r: Any, v: int) -> int:
    """The plan tensor of a loaded strided parameter v of rank r: the
    ``cat`` of its k blocks, each a load of the single-device parameter."""
    b, rank = writer.b, r.low.rank
    name = r.low.inputs[v][1]
    tid, lver = b.s.tid[r.sv[v]], b.s.lver.get(r.sv[v], 0)
    d = strided(r.claim[v].dims)[0]
    like = Tensor(rank, -1, tid, 0, (), 0, (), (0, 1, 1))
    loads = tuple(writer.plain_tensor(like, tid, -1, shape, lver, slices)
                  for slices, shape, _ in _pieces(r, v, name))
    out = writer.tensor(r, v, -1)
    writer.plan.nodes.append(Node(rank, -1, "cat", "none", loads, (out,), {"dim": d},
                                  f"{scope(name)}.load"))
    return out


def rejoin(writer: Any, r: Any, o: int, name: str) -> None:
    """A strided value o that rank r's node just wrote (a loose tensor: its
    claim names k ranges, no block), cut into its k blocks by ``narrow``
    nodes, each claimed as the block of the single-device value it is, and
    joined again by a ``cat`` (loose) that the value's readers read
    instead: the same values, so the rank's program is unchanged, and each
    reader's stage starts from blocks of its single-device node's inputs,
    as a loose value's stage must (the stage of a value computed from loose
    values is its single-device node's alone: docs/soundness.md, "Plans
    traced from PyTorch", 87). A value whose claim names its ranges out of
    form is left as it is (loose: no reader of it is ever claimed a piece
    of anything but what its stage proves)."""
    pieces = r.strided_pieces(o)
    if not pieces:
        return
    b, rank = writer.b, r.low.rank
    src = writer.t_of[(rank, o)]
    t = writer.plan.tensors[src]
    f = r.claim[o].scale
    d = strided(r.claim[o].dims)[0]
    size = r.low.shapes[o][d] // len(pieces)
    blocks = []
    for j, (slices, shape, parts) in enumerate(pieces):
        like = Tensor(rank, t.mb, t.tid, 0, (), 0, (), parts, (f.numerator, f.denominator))
        block = writer.plain_tensor(like, t.tid, t.mb, shape, t.lver, slices)
        writer.plan.nodes.append(Node(rank, max(t.mb, 0), "narrow", "none", (src,), (block,),
                                      {"dim": d, "start": j * size, "length": size}, name))
        blocks.append(block)
    joined = Tensor(rank, t.mb, t.tid, 0, (), 0, (), (0, 1, -(b.loose_number() + 1)))
    out = writer.plain_tensor(joined, t.tid, t.mb, t.shape, t.lver, t.slices)
    writer.plan.nodes.append(Node(rank, max(t.mb, 0), "cat", "none", tuple(blocks), (out,),
                                  {"dim": d}, name))
    writer.t_of[(rank, o)] = out
    writer.strided_blocks[(rank, o)] = blocks


def strided_grads(writer: Any, r: Any, name: str, param: int, buf: int) -> None:
    """The final gradient of rank r's strided parameter ``name`` (its
    loaded value ``param``): the rank's own local gradient cut into the
    parameter's k blocks, each claimed as the single-device gradient's
    block there (the verifier proves it), accumulated into its zeroed block
    of the gradient buffer ``buf``."""
    b, rank = writer.b, r.low.rank
    g = r.low.grads.get(name)
    if g is None:
        raise LoweringError(f"rank {rank} ends with no gradient for {name}")
    s_grad = b.s.low.grads.get(name)
    if s_grad is None or s_grad not in b.s.tid:
        raise LoweringError(f"the single-device step ends with no gradient for {name}")
    if tuple(r.low.shapes[g]) != tuple(r.low.shapes[param]):
        raise LoweringError(f"rank {rank}: the gradient of {name} of shape "
                            f"{list(r.low.shapes[g])} is not the shape of its strided shard "
                            f"{list(r.low.shapes[param])}")
    # a step's updates of it are listed as their claimed blocks (``final_blocks``)
    writer.plan.world["grad_blocks"] = 1
    tid, lver = b.s.tid[s_grad], b.s.lver.get(s_grad, 0)
    d = strided(r.claim[param].dims)[0]
    pieces = _pieces(r, param, name)
    src = writer.t_of[(rank, g)]
    size = r.low.shapes[param][d] // len(pieces)
    where = f"{name}.grad_buffer"
    for j, (slices, shape, _) in enumerate(pieces):
        block = writer.plain_tensor(Tensor(rank, 0, tid, 0, (), 0, (), (0, 1, 1)), tid, 0,
                                    shape, lver, slices)
        writer.plan.nodes.append(Node(rank, 0, "narrow", "none", (src,), (block,),
                                      {"dim": d, "start": j * size, "length": size}, where))
        like = Tensor(rank, -1, buf, 0, (), 0, (), (0, 1, 1))
        zero = writer.plain_tensor(like, buf, -1, shape, 0, slices)
        writer.plan.nodes.append(Node(rank, -1, "zeros", "none", (), (zero,),
                                      {"shape": list(shape)}, where))
        final = writer.plain_tensor(like, buf, 0, shape, 1, slices)
        writer.plan.nodes.append(Node(rank, 0, "local_grad_accumulation", "none",
                                      (zero, block), (final,), {}, where))
