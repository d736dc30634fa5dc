"""Emit the single-device plan (dp = tp = pp = ep = nm = 1) of a logical graph."""

from __future__ import annotations

from gen_model.graph import LogicalGraph, Value
from verdict.plan import INPUT_KINDS, Node, Plan, Tensor


def whole(g: LogicalGraph, v: Value, rank: int = 0, mb: int = 0) -> Tensor:
    """The plan tensor holding all of logical value ``v``."""
    shape = g.shape(v[0])
    return Tensor(rank, mb, v[0], v[1], shape, v[1], tuple((0, n) for n in shape), (0, 1, 1))


def single_plan(g: LogicalGraph, world: dict) -> Plan:
    plan = Plan(world=dict(world), logical=list(g.tensors), loss=g.loss, grads=dict(g.grads))
    index: dict[Value, int] = {}

    def ref(v: Value, mb: int) -> int:
        if v[0] < 0:
            return -1
        if v not in index:
            kind = g.tensors[v[0]].kind
            mb = -1 if kind in ("param", "buffer") else mb
            index[v] = len(plan.tensors)
            plan.tensors.append(whole(g, v, mb=mb))
        return index[v]

    for lop in g.ops:
        mb = -1 if lop.dir == "none" and lop.op == "zeros" else 0
        inputs = tuple(ref(v, 0) for v in lop.inputs)
        outputs = tuple(ref(v, mb) for v in lop.outputs)
        plan.nodes.append(Node(0, mb, lop.op, lop.dir, inputs, outputs, dict(lop.kwargs), lop.name))
    for tid, t in enumerate(g.tensors):
        if t.kind in INPUT_KINDS:
            ref((tid, 0), 0)
    return plan
