"""Derive the backward graph and the training step from the forward graph.

Three passes over a traced LogicalGraph:

1. fan-out: every value that needs a gradient and is read by more than one
   differentiable input gets a ``multiref`` op, so each value has exactly
   one gradient producer; the multiref's backward sums the copies' grads;
2. backward: one bw op per fw op, in reverse order, consuming the output
   gradients and the forward inputs its rule saves;
3. step: per parameter a zero gradient buffer and one local accumulation.
"""

from __future__ import annotations

from collections import Counter

from gen_model.graph import ABSENT, LogicalGraph, LOp, Value
from verdict.ops import get_op


def _diff_positions(g: LogicalGraph, lop: LOp) -> list[int]:
    rule = get_op(lop.op)
    return [p for p in rule.differentiable_inputs(len(lop.inputs))
            if g.requires_grad[lop.inputs[p][0]]]


def insert_multiref(g: LogicalGraph) -> None:
    uses = Counter(lop.inputs[p] for lop in g.ops for p in _diff_positions(g, lop))
    shared = {v for v, n in uses.items() if n > 1}
    copies: dict[Value, list[Value]] = {}
    forward, g.ops = g.ops, []
    for lop in forward:
        inputs = list(lop.inputs)
        for p in _diff_positions(g, lop):
            v = inputs[p]
            if v not in shared:
                continue
            if v not in copies:
                name = f"{g.tensors[v[0]].name}.multiref"
                copies[v] = list(g.add_op("multiref", "fw", [v], {"times": uses[v]}, name).outputs)
            inputs[p] = copies[v].pop(0)
        lop.inputs = tuple(inputs)
        g.ops.append(lop)


def _grad_tensor(g: LogicalGraph, v: Value) -> Value:
    t = g.tensors[v[0]]
    return (g.new_tensor(f"{t.name}.grad", t.shape, "grad"), 0)


def add_backward(g: LogicalGraph) -> dict[Value, Value]:
    """Append the backward ops; returns the gradient value of every value."""
    seed = g.add_op("ones", "bw", [], {"shape": []}, "loss.grad", kinds="grad")
    grads: dict[Value, Value] = {(g.loss, 0): seed.outputs[0]}
    for i in reversed(range(len(g.ops))):
        lop = g.ops[i]
        if lop.dir != "fw":
            continue
        diff = _diff_positions(g, lop)
        if not diff:
            continue
        rule = get_op(lop.op)
        out_grads = []
        for o in lop.outputs:
            if o not in grads:
                t = g.tensors[o[0]]
                grads[o] = g.add_op("zeros", "bw", [], {"shape": list(t.shape)},
                                    f"{t.name}.grad", kinds="grad").outputs[0]
            out_grads.append(grads[o])
        saved = [v if p in rule.saves else ABSENT for p, v in enumerate(lop.inputs)]
        outputs = [_grad_tensor(g, v) if p in diff else ABSENT for p, v in enumerate(lop.inputs)]
        g.ops.append(LOp(lop.op, "bw", (*saved, *out_grads), tuple(outputs), dict(lop.kwargs),
                         lop.name, fw=i))
        for p in diff:
            grads[lop.inputs[p]] = outputs[p]
    return grads


def add_step(g: LogicalGraph, grads: dict[Value, Value]) -> None:
    """Gradient buffers: zeros (version 0) then one accumulation (version 1)."""
    params = [tid for tid, t in enumerate(g.tensors) if t.kind == "param"]
    for tid in params:
        name = f"{g.tensors[tid].name}.grad_buffer"
        buf = g.add_op("zeros", "none", [], {"shape": list(g.shape(tid))}, name,
                       kinds="gradbuf").outputs[0]
        g.grads[tid] = buf[0]
        if (tid, 0) in grads:
            g.ops.append(LOp("local_grad_accumulation", "none", (buf, grads[(tid, 0)]),
                             ((buf[0], 1),), {}, name))


#: The optimizer step each --optimizer adds, and its hyperparameters (one step, t = 1).
OPTIMIZER_KWARGS: dict[str, tuple[str, dict]] = {
    "sgd": ("sgd_step", {"lr": 0.01, "weight_decay": 0.1}),
    "adam": ("adam_step", {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                           "weight_decay": 0.1, "decoupled": False, "step": 1}),
    "adamw": ("adam_step", {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                            "weight_decay": 0.1, "decoupled": True, "step": 1}),
}


def add_optimizer(g: LogicalGraph, optimizer: str) -> None:
    """Per parameter, the update after its final gradient: a new version of
    the parameter (and of Adam's two state tensors, inputs of kind buffer)."""
    if optimizer == "none":
        return
    op, kwargs = OPTIMIZER_KWARGS[optimizer]
    final = {lop.outputs[0][0]: lop.outputs[0] for lop in g.ops
             if lop.op == "local_grad_accumulation"}
    for tid, buf in list(g.grads.items()):
        name = g.tensors[tid].name
        shape = g.shape(tid)
        inputs = [(tid, 0), final.get(buf, (buf, 0))]
        outputs = [(tid, 1)]
        if op == "adam_step":
            states = [g.new_tensor(f"{name}.{s}", shape, "buffer") for s in ("exp_avg",
                                                                              "exp_avg_sq")]
            inputs += [(s, 0) for s in states]
            outputs += [(s, 1) for s in states]
        g.ops.append(LOp(op, "none", tuple(inputs), tuple(outputs), dict(kwargs),
                         f"{name}.{optimizer}"))


def derive_training_step(g: LogicalGraph, optimizer: str = "none") -> LogicalGraph:
    insert_multiref(g)
    add_step(g, add_backward(g))
    add_optimizer(g, optimizer)
    return g
