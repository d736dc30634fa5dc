"""Canaries: plans known to be wrong, made from any base plan.

The mutation harness (scripts/mutate.py) runs them on every unfolded base
before its mutants: the oracle must judge each wrong and the verifier must
fail it (or refuse it, as main.py does with exit 2, when the plan does not
describe the model). A canary the oracle judges right means the oracle has
gone blind (a comparison removed, an operator it runs wrongly); one the
verifier proves means a rule or the solver has gone wrong. Each canary
strikes through another path: a gradient only, the gradient map, the loss
only, a collective, the accumulation of microbatches.
"""

from __future__ import annotations

from collections.abc import Callable

from harness.mutations import _add_tensor, _reroute, copy_plan, drop_orphans
from verdict.plan import Node, Plan

Canary = Callable[[Plan], Plan | None]


def _final_gradient(plan: Plan) -> int:
    """The last write of the first gradient buffer on the lowest rank."""
    last = plan.last_writes()
    buf = plan.grads[min(plan.grads)]
    return min((t for (tid, _), t in last.items() if tid == buf),
               key=lambda t: plan.tensors[t].rank)


def _rewrite_after(plan: Plan, t: int, op: str, kwargs: dict) -> None:
    """A node ``op`` right after the producer of ``t`` writes a new version
    of it (same claim); every later reader reads that version."""
    prod = next(i for i, n in enumerate(plan.nodes) if t in n.outputs)
    new = _add_tensor(plan, t)
    _reroute(plan, t, new, prod + 1)
    x = plan.tensors[t]
    plan.nodes.insert(prod + 1, Node(x.rank, x.mb, op, "none", (t,), (new,), kwargs, "canary"))


def gradient_doubled(plan: Plan) -> Plan:
    """One rank's final gradient buffer of one parameter times 2: only the
    gradient comparison can see it (the loss is untouched)."""
    p = copy_plan(plan)
    _rewrite_after(p, _final_gradient(p), "mul_scalar", {"value": 2.0})
    return p


def gradient_left_out_of_the_map(plan: Plan) -> Plan:
    """The plan's own gradient map without that parameter, its gradient
    doubled as above: an oracle that read the plan's map would not look."""
    p = gradient_doubled(plan)
    del p.grads[min(p.grads)]
    return p


def loss_halved(plan: Plan) -> Plan:
    """The last loss tensor of one rank divided by 2 (the gradients are
    untouched): only the loss comparison can see it."""
    p = copy_plan(plan)
    t = min((t for (tid, _), t in p.last_writes().items() if tid == p.loss),
            key=lambda t: p.tensors[t].rank)
    _rewrite_after(p, t, "div", {"value": 2.0})
    return p


def reducer_of_one(plan: Plan) -> Plan | None:
    """The first cross-replica gradient reduction run on a group of one."""
    i = next((i for i, n in enumerate(plan.nodes) if n.op == "reducer" and len(n.inputs) > 1),
             None)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    own = next(t for t in n.inputs if p.tensors[t].rank == n.rank)
    p.nodes[i] = n._replace(inputs=(own,), kwargs={"index": 0})
    return p


def last_accumulation_overwrites(plan: Plan) -> Plan | None:
    """The last accumulation of one buffer adds to the zeroed buffer, not to
    the running one: only the last microbatch's gradient survives. A
    buffer's chain is one block of it (a strided shard's or a distributed
    optimizer's blocks each start from their own zeros)."""
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    for i, n in enumerate(plan.nodes):
        if n.op == "local_grad_accumulation" and n.mb >= 0:
            out = plan.tensors[n.outputs[0]]
            key = (n.rank, out.tid, out.slices)
            first.setdefault(key, i)
            last[key] = i
    key = min((k for k in last if last[k] != first[k]), default=None)
    if key is None:
        return None
    p = copy_plan(plan)
    i = last[key]
    zeroed = p.nodes[first[key]].inputs[0]
    p.nodes[i] = p.nodes[i]._replace(inputs=(zeroed, p.nodes[i].inputs[1]))
    return drop_orphans(p)


CANARIES: dict[str, Canary] = {
    "gradient_doubled": gradient_doubled,
    "gradient_left_out_of_the_map": gradient_left_out_of_the_map,
    "loss_halved": loss_halved,
    "reducer_of_one": reducer_of_one,
    "last_accumulation_overwrites": last_accumulation_overwrites,
}
