"""Structural checks of one plan, before any stage: every node's output
shapes follow from its inputs by its operator's shape rule, and a node reads
tensors of other ranks only if it is a communication operator."""

from __future__ import annotations

from verdict.lineage import StructureError
from verdict.ops import ShapeError, get_op
from verdict.plan import Node, Plan
from verdict.progress import progress


def node_label(plan: Plan, i: int) -> str:
    n = plan.nodes[i]
    return f"Node(rank={n.rank}, mb={n.mb}, cid={i}, op='{n.op}', dir='{n.dir}', name='{n.name}')"


def fw_shapes(plan: Plan, node: Node, shape_of=None) -> tuple[list, list]:
    """Shapes of the forward inputs and outputs a node stands for (None where
    unknown): its own for a forward node; for a backward node, the kept
    inputs or their gradients, and the gradients of the outputs.
    ``shape_of(tensor index)`` gives the shapes (default: the plan's)."""
    rule = get_op(node.op)

    def shape(i: int):
        if i < 0:
            return None
        return plan.tensors[i].shape if shape_of is None else shape_of(i)

    if node.dir != "bw" or rule.backward is None:
        return [shape(i) for i in node.inputs], [shape(o) for o in node.outputs]
    n = len(node.outputs)
    ins = [shape(s) if s >= 0 else shape(g) for s, g in zip(node.inputs[:n], node.outputs)]
    return ins, [shape(g) for g in node.inputs[n:]]


def check_node_shapes(plan: Plan, which: str) -> None:
    for i, node in enumerate(progress(plan.nodes, f"shapes of {which}")):
        rule = get_op(node.op)
        if node.dir == "bw" and rule.backward is not None:
            n = len(node.outputs)
            for k, (s, g) in enumerate(zip(node.inputs[:n], node.outputs)):
                if s >= 0 and g >= 0 and plan.tensors[s].shape != plan.tensors[g].shape:
                    raise StructureError("shape", (
                        f"Tensor shape mismatch in {which}. Expect: {list(plan.tensors[s].shape)}, "
                        f"Result: {list(plan.tensors[g].shape)} (gradient {k}), "
                        f"Node: {node_label(plan, i)}"))
            ins, outs = fw_shapes(plan, node)
            if any(s is None for s in ins):
                continue
            want = outs
        else:
            ins = [plan.tensors[t].shape for t in node.inputs]
            want = [plan.tensors[o].shape if o >= 0 else None for o in node.outputs]
        try:
            got = rule.shape(ins, **node.kwargs)
        except (ShapeError, TypeError, ValueError, IndexError, KeyError) as e:
            raise StructureError("shape", (
                f"Shape constraints of {node.op} unsatisfiable in {which}: {e}. "
                f"Node: {node_label(plan, i)}")) from None
        for w, g in zip(want, got):
            if w is not None and tuple(w) != tuple(g):
                raise StructureError("shape", (
                    f"Tensor shape mismatch in {which}. Expect: {list(w)}, Result: {list(g)}, "
                    f"Node: {node_label(plan, i)}"))
        if len(got) != len(want):
            raise StructureError("shape", (
                f"{node.op} makes {len(got)} outputs, the plan has {len(want)}. "
                f"Node: {node_label(plan, i)}"))


def check_ranks(plan: Plan, which: str) -> None:
    for i, node in enumerate(plan.nodes):
        group = get_op(node.op).group
        for t in node.outputs if group else (*node.inputs, *node.outputs):
            if t >= 0 and plan.tensors[t].rank != node.rank:
                raise StructureError("rank", (
                    f"{which}: node on rank {node.rank} touches a tensor of rank "
                    f"{plan.tensors[t].rank} without communication. Node: {node_label(plan, i)}"))


def check_structure(plan: Plan, which: str) -> None:
    check_ranks(plan, which)
    check_node_shapes(plan, which)
