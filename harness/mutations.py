"""Mutation operators and semantics-preserving rewrites over plan data.

    MUTATIONS[name](plan, rng) -> (Plan, where) | None
    REWRITES[name](plan, rng)  -> (Plan, where) | None

A mutation makes one small change of the kind a parallelizer gets wrong: a
collective dropped, replaced or run on the wrong group, a wrong peer, a
constant changed on one rank, swapped operands, an inserted transpose, a
stale version or another microbatch's tensor read, an accumulation dropped,
a reducer run early, a rank ending with another shard's gradient or with
none, a loss left partial, a node deleted, a group listed in another order,
a chunk index changed, a world layout that calls tensor-parallel peers
replicas. New tensors claim the view the
tensor they stand for claims, as a parallelizer would write it; whether the
mutant is wrong is for an oracle to say (harness/oracle.py), not for the
claims. A rewrite changes the plan without changing what any rank computes.

Each operator picks its target with ``rng`` among the places it applies to
and returns a new plan (the input is not changed) with a short description
of where it struck, or None when the plan has no such place.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from fractions import Fraction

from gen_model.config import ConfigError
from gen_model.parallelize import number_versions
from harness.bugs import scatter_gather
from verdict.ops import get_op
from verdict.plan import INPUT_KINDS, UNIT, Node, Plan

Result = tuple[Plan, str] | None
COLLECTIVES = ("all_reduce", "all_reduce_max", "all_gather", "reduce_scatter", "all_to_all",
               "broadcast")


def copy_plan(plan: Plan) -> Plan:
    """A copy whose lists can be edited (nodes and tensors are immutable)."""
    return Plan(world=dict(plan.world), logical=list(plan.logical), tensors=list(plan.tensors),
                nodes=list(plan.nodes), loss=plan.loss, grads=dict(plan.grads))


def where(plan: Plan, i: int) -> str:
    n = plan.nodes[i]
    return f"{n.op} ({n.dir}) {n.name} on rank {n.rank} mb {n.mb}"


def _pick(rng: random.Random, items: list):
    return rng.choice(items) if items else None


def _own(plan: Plan, i: int) -> int:
    node = plan.nodes[i]
    return next(t for t in node.inputs if t >= 0 and plan.tensors[t].rank == node.rank)


def _add_tensor(plan: Plan, like: int) -> int:
    """A new tensor with the shape and claim of ``like`` (a later version)."""
    t = plan.tensors[like]
    later = max(u.version for u in plan.tensors
                if (u.rank, u.mb, u.tid) == (t.rank, t.mb, t.tid))
    plan.tensors.append(t._replace(version=later + 1))
    return len(plan.tensors) - 1


def _reroute(plan: Plan, old: int, new: int, start: int) -> int:
    """Nodes from ``start`` on read ``new`` instead of ``old``; how many."""
    count = 0
    for k in range(start, len(plan.nodes)):
        n = plan.nodes[k]
        if old in n.inputs:
            plan.nodes[k] = n._replace(inputs=tuple(new if t == old else t for t in n.inputs))
            count += 1
    return count


def _insert_after_producer(plan: Plan, t: int, make: Callable[[int, int], list[Node]]) -> bool:
    """Insert nodes right after the producer of ``t`` that read ``t`` and
    write a stand-in ``t'``; every later reader reads ``t'``. ``make(t, t')``
    builds the nodes (their last output is ``t'``)."""
    prod = next(i for i, n in enumerate(plan.nodes) if t in n.outputs)
    stand_in = _add_tensor(plan, t)
    new = make(t, stand_in)
    if not _reroute(plan, t, stand_in, prod + 1):
        plan.tensors.pop()
        return False
    plan.nodes[prod + 1:prod + 1] = new
    return True


def drop_orphans(plan: Plan) -> Plan:
    """Remove computed tensors that no node reads or writes any more (what a
    parallelizer that never made them would have written)."""
    used = {t for n in plan.nodes for t in (*n.inputs, *n.outputs) if t >= 0}
    keep = [i for i, t in enumerate(plan.tensors)
            if i in used or plan.logical[t.tid].kind in INPUT_KINDS]
    index = {old: new for new, old in enumerate(keep)}
    plan.tensors = [plan.tensors[i] for i in keep]
    plan.nodes = [n._replace(inputs=tuple(index.get(t, -1) for t in n.inputs),
                             outputs=tuple(index.get(t, -1) for t in n.outputs))
                  for n in plan.nodes]
    return plan


def _computed(plan: Plan) -> list[int]:
    """Tensors some node writes, in a stable order."""
    return sorted({o for n in plan.nodes for o in n.outputs if o >= 0})


# ---------------------------------------------------------------- mutations


def drop_collective(plan: Plan, rng: random.Random) -> Result:
    """A collective run on a group of one: the rank keeps its own piece."""
    sites = [i for i, n in enumerate(plan.nodes) if n.op in ("all_reduce", "all_reduce_max",
                                                             "reducer") and len(n.inputs) > 1]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    p.nodes[i] = p.nodes[i]._replace(inputs=(_own(p, i),), kwargs={"index": 0})
    return p, where(plan, i)


def replace_collective(plan: Plan, rng: random.Random) -> Result:
    """An all_reduce (or max all-reduce) emitted as another collective of the
    same group; a max all-reduce may also become a sum."""
    sites = [i for i, n in enumerate(plan.nodes) if n.op in ("all_reduce", "all_reduce_max")
             and len(n.inputs) > 1]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    shape = p.tensors[n.inputs[0]].shape
    choices = [("broadcast", {"src": 0})]
    if n.op == "all_reduce_max":
        choices.append(("all_reduce", {}))
    for d, size in enumerate(shape):
        choices.append(("all_gather", {"dim": d}))
        if size % len(n.inputs) == 0:
            choices.append(("reduce_scatter", {"dim": d}))
    op, kw = rng.choice(choices)
    if op == "broadcast":
        p.nodes[i] = n._replace(op=op, inputs=(n.inputs[0],), kwargs=kw)
    else:
        p.nodes[i] = n._replace(op=op, kwargs={**kw, "index": n.kwargs["index"]})
    return p, f"{where(plan, i)} as {op}"


def wrong_group(plan: Plan, rng: random.Random) -> Result:
    """One member of a collective's group read from a rank outside it."""
    sites = []
    for i, n in enumerate(plan.nodes):
        if n.op in (*COLLECTIVES, "reducer") and len(n.inputs) > 1:
            for k, t in enumerate(n.inputs):
                x = plan.tensors[t]
                group = {plan.tensors[u].rank for u in n.inputs}
                others = [j for j, u in enumerate(plan.tensors) if u.rank not in group
                          and (u.tid, u.mb, u.version, u.shape) == (x.tid, x.mb, x.version, x.shape)]
                sites += [(i, k, j) for j in others]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, k, j = site
    p = copy_plan(plan)
    n = p.nodes[i]
    if _written_after(p, j, i):
        return None
    inputs = list(n.inputs)
    inputs[k] = j
    p.nodes[i] = n._replace(inputs=tuple(inputs))
    return p, f"{where(plan, i)} member {k} from rank {plan.tensors[j].rank}"


def _written_after(plan: Plan, t: int, i: int) -> bool:
    return any(t in n.outputs for n in plan.nodes[i:])


def wrong_peer(plan: Plan, rng: random.Random) -> Result:
    """A send_recv that reads the tensor of another rank than its source."""
    sites = []
    for i, n in enumerate(plan.nodes):
        if n.op == "send_recv":
            x = plan.tensors[n.inputs[0]]
            sites += [(i, j) for j, u in enumerate(plan.tensors[:]) if j != n.inputs[0]
                      and (u.tid, u.mb, u.shape) == (x.tid, x.mb, x.shape) and u.rank != x.rank
                      and not _written_after(plan, j, i)]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, j = site
    p = copy_plan(plan)
    n = p.nodes[i]
    p.nodes[i] = n._replace(inputs=(j,), kwargs={**n.kwargs, "src": p.tensors[j].rank})
    return p, f"{where(plan, i)} from rank {plan.tensors[j].rank}"


def scale_one_rank(plan: Plan, rng: random.Random) -> Result:
    """A tensor on one rank multiplied by a constant before its readers."""
    sites = [t for t in _computed(plan) if plan.logical[plan.tensors[t].tid].kind != "gradbuf"]
    t = _pick(rng, sites)
    if t is None:
        return None
    p = copy_plan(plan)
    x = p.tensors[t]
    factor = rng.choice([2.0, -1.0, 0.5])
    ok = _insert_after_producer(p, t, lambda a, b: [Node(
        x.rank, x.mb, "mul_scalar", "fw", (a,), (b,), {"value": factor}, "scale")])
    if not ok:
        return None
    return p, f"{plan.logical[x.tid].name} on rank {x.rank} mb {x.mb} times {factor}"


def _times_claim(plan: Plan, t: int, factor: Fraction) -> None:
    """Tensor t's claimed factor multiplied by ``factor`` (an honest claim of
    a tensor the plan now scales)."""
    x = plan.tensors[t]
    new = x.factor() * factor
    plan.tensors[t] = x._replace(scale=(new.numerator, new.denominator))


#: Factors the scale mutants apply: a gradient averaged where summed, summed
#: where averaged, divided by a parallel size twice.
FACTORS = (Fraction(2), Fraction(1, 2), Fraction(4), Fraction(1, 4), Fraction(-1))


def _scale_after(plan: Plan, t: int, factor: Fraction, name: str) -> bool:
    """Insert ``mul_scalar(factor)`` after tensor t; its output claims t's view
    times the factor, as a plan that meant to scale would write it."""
    x = plan.tensors[t]
    ok = _insert_after_producer(plan, t, lambda a, b: [Node(
        x.rank, x.mb, "mul_scalar", "fw", (a,), (b,), {"value": float(factor)}, name)])
    if ok:
        _times_claim(plan, len(plan.tensors) - 1, factor)
    return ok


def factor_one_rank(plan: Plan, rng: random.Random) -> Result:
    """A tensor on one rank scaled by an exact factor, its claim saying so (a
    divide factor applied on one rank only)."""
    sites = [t for t in _computed(plan) if plan.logical[plan.tensors[t].tid].kind != "gradbuf"]
    t = _pick(rng, sites)
    if t is None:
        return None
    p = copy_plan(plan)
    x = p.tensors[t]
    factor = rng.choice(FACTORS)
    if not _scale_after(p, t, factor, "scale"):
        return None
    return p, f"{plan.logical[x.tid].name} on rank {x.rank} mb {x.mb} times {factor}, claimed"


def factor_every_rank(plan: Plan, rng: random.Random) -> Result:
    """One value scaled by an exact factor on every rank and microbatch that
    computes it, every claim saying so (a loss averaged over the wrong count,
    AVG where SUM is needed: the replicas stay equal to each other)."""
    by_value: dict[tuple[int, int], list[int]] = {}
    for t in _computed(plan):
        x = plan.tensors[t]
        if plan.logical[x.tid].kind != "gradbuf":
            by_value.setdefault((x.tid, x.lver), []).append(t)
    key = _pick(rng, sorted(by_value))
    if key is None:
        return None
    factor = rng.choice(FACTORS)
    p = copy_plan(plan)
    count = sum(_scale_after(p, t, factor, "scale") for t in by_value[key])
    if not count:
        return None
    return p, f"{plan.logical[key[0]].name} v{key[1]} times {factor} on {count} ranks/mbs, claimed"


def factor_twice(plan: Plan, rng: random.Random) -> Result:
    """A scaling the plan does (a division by a token count or a parallel
    size, a multiply by a constant) applied a second time on one rank, its
    claim saying so."""
    read = {t for n in plan.nodes for t in n.inputs}
    sites = [i for i, n in enumerate(plan.nodes) if n.op in ("div", "mul_scalar")
             and isinstance(n.kwargs.get("value"), (int, float))
             and n.kwargs["value"] not in (0, 1) and n.outputs[0] in read]
    i = _pick(rng, sites)
    if i is None:
        return None
    n = plan.nodes[i]
    value = Fraction(repr(float(n.kwargs["value"])))
    factor = 1 / value if n.op == "div" else value
    p = copy_plan(plan)
    if not _scale_after(p, n.outputs[0], factor, "scale_again"):
        return None
    return p, f"{where(plan, i)} applied twice"


#: Numeric kwargs a mutation may change: an operator's constant, an exponent,
#: the optimizer's hyperparameters.
CONSTANTS = ("value", "exponent", "lr", "weight_decay", "beta1", "beta2", "eps", "step", "scale")


def change_constant(plan: Plan, rng: random.Random) -> Result:
    """A constant kwarg (eps, a scale, an exponent, a learning rate or
    another hyperparameter of the optimizer step) changed on one rank."""
    sites = [(i, k) for i, n in enumerate(plan.nodes) for k in CONSTANTS
             if isinstance(n.kwargs.get(k), (int, float)) and not isinstance(n.kwargs.get(k), bool)]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, k = site
    p = copy_plan(plan)
    n = p.nodes[i]
    old = n.kwargs[k]
    new = rng.choice([old * 2 if old else 1.0, old + 1.0, -old if old else 0.5])
    p.nodes[i] = n._replace(kwargs={**n.kwargs, k: new})
    return p, f"{where(plan, i)}: {k} {old} -> {new}"


def change_constant_everywhere(plan: Plan, rng: random.Random) -> Result:
    """One constant changed alike on every rank and microbatch (a loss
    normalised by the wrong token count, a learning rate scaled by a
    parallel size: the shipped loss-scale bugs). The replicas stay equal to
    each other, so only the comparison with the single-device step sees it."""
    sites = sorted({(n.op, n.dir, n.name, k) for n in plan.nodes for k in CONSTANTS
                    if isinstance(n.kwargs.get(k), (int, float))
                    and not isinstance(n.kwargs.get(k), bool)})
    site = _pick(rng, sites)
    if site is None:
        return None
    op, direction, name, k = site
    factor = rng.choice([2.0, 0.5, -1.0])
    p = copy_plan(plan)
    for i, n in enumerate(p.nodes):
        old = n.kwargs.get(k)
        if (n.op, n.dir, n.name) == (op, direction, name) and old is not None:
            new = 2 * old if isinstance(old, int) else old * factor if old else 1.0
            p.nodes[i] = n._replace(kwargs={**n.kwargs, k: new})
    return p, f"{op} ({direction}) {name}: {k} changed on every rank"


def swap_inputs(plan: Plan, rng: random.Random) -> Result:
    """Two inputs of one node swapped (where their shapes allow it)."""
    sites = []
    for i, n in enumerate(plan.nodes):
        if get_op(n.op).group or n.op == "local_grad_accumulation":
            continue
        ins = [k for k, t in enumerate(n.inputs) if t >= 0]
        for a in ins:
            for b in ins:
                if a < b and n.inputs[a] != n.inputs[b] and (
                        plan.tensors[n.inputs[a]].shape == plan.tensors[n.inputs[b]].shape):
                    sites.append((i, a, b))
    site = _pick(rng, sites)
    if site is None:
        return None
    i, a, b = site
    p = copy_plan(plan)
    ins = list(p.nodes[i].inputs)
    ins[a], ins[b] = ins[b], ins[a]
    p.nodes[i] = p.nodes[i]._replace(inputs=tuple(ins))
    return p, f"{where(plan, i)} inputs {a} and {b}"


def swap_outputs(plan: Plan, rng: random.Random) -> Result:
    """Two outputs of one node swapped (where their shapes allow it)."""
    sites = []
    for i, n in enumerate(plan.nodes):
        outs = [k for k, t in enumerate(n.outputs) if t >= 0]
        sites += [(i, a, b) for a in outs for b in outs if a < b and (
            plan.tensors[n.outputs[a]].shape == plan.tensors[n.outputs[b]].shape)]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, a, b = site
    p = copy_plan(plan)
    outs = list(p.nodes[i].outputs)
    outs[a], outs[b] = outs[b], outs[a]
    p.nodes[i] = p.nodes[i]._replace(outputs=tuple(outs))
    return p, f"{where(plan, i)} outputs {a} and {b}"


def insert_transpose(plan: Plan, rng: random.Random) -> Result:
    """A transpose of two equal-sized dims (or a cyclic permute of three)
    inserted on one rank after a tensor: at full size the shapes still fit."""
    sites = []
    for t in _computed(plan):
        shape = plan.tensors[t].shape
        pairs = [(a, b) for a in range(len(shape)) for b in range(a + 1, len(shape))
                 if shape[a] == shape[b] > 1]
        sites += [(t, pair) for pair in pairs]
        triples = [(a, b, c) for a in range(len(shape)) for b in range(a + 1, len(shape))
                   for c in range(b + 1, len(shape)) if shape[a] == shape[b] == shape[c] > 1]
        sites += [(t, triple) for triple in triples]
    site = _pick(rng, sites)
    if site is None:
        return None
    t, dims = site
    p = copy_plan(plan)
    x = p.tensors[t]

    def make(a: int, b: int) -> list[Node]:
        if len(dims) == 2:
            return [Node(x.rank, x.mb, "transpose", "fw", (a,), (b,),
                         {"dim0": dims[0], "dim1": dims[1]}, "transpose")]
        mid = _add_tensor(p, t)
        return [Node(x.rank, x.mb, "transpose", "fw", (a,), (mid,),
                     {"dim0": dims[0], "dim1": dims[1]}, "permute"),
                Node(x.rank, x.mb, "transpose", "fw", (mid,), (b,),
                     {"dim0": dims[1], "dim1": dims[2]}, "permute")]

    if not _insert_after_producer(p, t, make):
        return None
    return p, f"{plan.logical[x.tid].name} on rank {x.rank} mb {x.mb} dims {dims}"


def _read_instead(plan: Plan, rng: random.Random, pick_other) -> Result:
    """A node reads another tensor ``pick_other(plan, t)`` in place of ``t``."""
    sites = []
    for i, n in enumerate(plan.nodes):
        for k, t in enumerate(n.inputs):
            if t >= 0:
                sites += [(i, k, o) for o in pick_other(plan, t) if not _written_after(plan, o, i)]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, k, o = site
    p = copy_plan(plan)
    ins = list(p.nodes[i].inputs)
    ins[k] = o
    p.nodes[i] = p.nodes[i]._replace(inputs=tuple(ins))
    x = plan.tensors[o]
    return p, f"{where(plan, i)} input {k} <- rank {x.rank} mb {x.mb} v{x.version}"


def stale_version(plan: Plan, rng: random.Random) -> Result:
    """A node reads an earlier version of the same tensor (e.g. a buffer
    before the last accumulation)."""
    by_key: dict[tuple, list[int]] = {}
    for j, u in enumerate(plan.tensors):
        by_key.setdefault((u.rank, u.tid, u.shape), []).append(j)

    def older(p: Plan, t: int) -> list[int]:
        x = p.tensors[t]
        return [j for j in by_key[(x.rank, x.tid, x.shape)]
                if p.tensors[j].version < x.version and p.tensors[j].mb in (x.mb, -1)
                and p.logical[x.tid].kind == "gradbuf"] + [
            j for j in by_key[(x.rank, x.tid, x.shape)]
            if p.tensors[j].version == x.version - 1 and p.tensors[j].mb == x.mb]
    return _read_instead(plan, rng, older)


def other_microbatch(plan: Plan, rng: random.Random) -> Result:
    """A node reads the same tensor of another microbatch."""
    by_key: dict[tuple, list[int]] = {}
    for j, u in enumerate(plan.tensors):
        by_key.setdefault((u.rank, u.tid, u.version, u.shape), []).append(j)

    def others(p: Plan, t: int) -> list[int]:
        x = p.tensors[t]
        return [j for j in by_key[(x.rank, x.tid, x.version, x.shape)]
                if p.tensors[j].mb != x.mb and x.mb >= 0 and p.tensors[j].mb >= 0]
    return _read_instead(plan, rng, others)


def drop_accumulation(plan: Plan, rng: random.Random) -> Result:
    """A gradient accumulation left out: readers see the buffer before it."""
    sites = [i for i, n in enumerate(plan.nodes) if n.op == "local_grad_accumulation"]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes.pop(i)
    _reroute(p, n.outputs[0], n.inputs[0], i)
    return drop_orphans(p), where(plan, i)


def early_reducer(plan: Plan, rng: random.Random) -> Result:
    """A reducer that reads the buffers before their last accumulation."""
    acc_of = {n.outputs[0]: n.inputs[0] for n in plan.nodes if n.op == "local_grad_accumulation"}
    sites = [i for i, n in enumerate(plan.nodes) if n.op == "reducer"
             and all(t in acc_of for t in n.inputs)]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    p.nodes[i] = n._replace(inputs=tuple(acc_of[t] for t in n.inputs))
    return p, where(plan, i)


def _final_buffers(plan: Plan) -> dict[tuple[int, int], int]:
    """(tid, rank) -> tensor written last, for gradient buffers and for what
    an optimizer step updates (parameters, Adam's moments)."""
    ends = set(plan.grads.values()) | {plan.tensors[o].tid for n in plan.nodes
                                       if n.op in ("sgd_step", "adam_step")
                                       for o in n.outputs if o >= 0}
    return {key: t for key, t in plan.last_writes().items() if key[0] in ends}


def wrong_final_shard(plan: Plan, rng: random.Random) -> Result:
    """A rank ends with a copy of a peer's final gradient buffer (or updated
    parameter, or optimizer state) of another slice, sent to it after its
    own step, which truthfully claims the peer's slice."""
    final = _final_buffers(plan)
    sites = [(t, u) for (tid, r), t in final.items() for (tid2, r2), u in final.items()
             if tid == tid2 and r != r2 and plan.tensors[t].slices != plan.tensors[u].slices
             and plan.tensors[t].shape == plan.tensors[u].shape]
    site = _pick(rng, sites)
    if site is None:
        return None
    t, u = site
    p = copy_plan(plan)
    x, y = p.tensors[t], p.tensors[u]
    p.tensors.append(y._replace(rank=x.rank, version=x.version + 1))
    new = len(p.tensors) - 1
    p.nodes.append(Node(x.rank, -1, "send_recv", "none", (u,), (new,),
                        {"src": y.rank, "dst": x.rank}, p.logical[x.tid].name))
    return p, f"{p.logical[x.tid].name} on rank {x.rank} ends with rank {y.rank}'s slice"


def wrong_reducer_group(plan: Plan, rng: random.Random) -> Result:
    """A reducer run over the buffers of another replica group (same
    gradient, another slice); its output truthfully claims that slice."""
    reducers = [i for i, n in enumerate(plan.nodes) if n.op == "reducer"]
    sites = [(i, j) for i in reducers for j in reducers
             if plan.nodes[i].name == plan.nodes[j].name
             and plan.tensors[plan.nodes[i].outputs[0]].slices
             != plan.tensors[plan.nodes[j].outputs[0]].slices
             and plan.tensors[plan.nodes[i].outputs[0]].shape
             == plan.tensors[plan.nodes[j].outputs[0]].shape]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, j = site
    p = copy_plan(plan)
    mine, theirs = p.nodes[i], p.nodes[j]
    out = p.tensors[mine.outputs[0]]
    p.tensors[mine.outputs[0]] = out._replace(slices=p.tensors[theirs.outputs[0]].slices)
    p.nodes[i] = mine._replace(inputs=theirs.inputs, kwargs=theirs.kwargs)
    return p, f"{where(plan, i)} over the group of rank {theirs.rank}"


def missing_gradient(plan: Plan, rng: random.Random) -> Result:
    """A rank that holds a parameter shard writes no gradient for it: its
    zeros, accumulations and reducer are gone, and its replicas' reducers
    leave it out of their group."""
    bufs = set(plan.grads.values())
    pairs = sorted({(plan.tensors[o].tid, n.rank) for n in plan.nodes for o in n.outputs
                    if o >= 0 and plan.tensors[o].tid in bufs})
    site = _pick(rng, pairs)
    if site is None:
        return None
    tid, rank = site
    p = copy_plan(plan)
    gone = {j for j, u in enumerate(p.tensors) if (u.tid, u.rank) == (tid, rank)}
    nodes = []
    for n in p.nodes:
        if any(o in gone for o in n.outputs):
            continue
        if n.op == "reducer" and any(t in gone for t in n.inputs):
            kept = tuple(t for t in n.inputs if t not in gone)
            own = next(k for k, t in enumerate(kept) if p.tensors[t].rank == n.rank)
            n = n._replace(inputs=kept, kwargs={**n.kwargs, "index": own})
        nodes.append(n)
    p.nodes = nodes
    return drop_orphans(p), f"{p.logical[tid].name} on rank {rank}"


def _loss_tids(plan: Plan) -> set[int]:
    """Logical tensors of the loss computation after the last projection: walk
    the forward producers back from the loss, stopping at tensors a linear
    (the output layer, the router's gate) writes."""
    producers: dict[int, list[Node]] = {}
    for n in plan.nodes:
        if n.dir == "fw":
            for o in n.outputs:
                if o >= 0:
                    producers.setdefault(plan.tensors[o].tid, []).append(n)
    seen, stack = set(), [plan.loss]
    while stack:
        tid = stack.pop()
        nodes = producers.get(tid, [])
        if tid in seen or any(n.op in ("linear", "einsum") for n in nodes):
            continue
        seen.add(tid)
        stack.extend(plan.tensors[i].tid for n in nodes for i in n.inputs if i >= 0)
    return seen


def partial_loss(plan: Plan, rng: random.Random) -> Result:
    """One forward all-reduce of the loss across tensor-parallel ranks left
    out (the max, the sum of exponentials or the target logit of the
    vocab-parallel cross-entropy, or the loss itself), on one rank and
    microbatch or on its whole group: those ranks go on with their own part,
    truthfully claimed."""
    tids = _loss_tids(plan)
    sites = [i for i, n in enumerate(plan.nodes) if n.op in ("all_reduce", "all_reduce_max")
             and n.dir == "fw" and plan.tensors[n.outputs[0]].tid in tids]
    i = _pick(rng, sites)
    if i is None:
        return None
    whole_group = rng.random() < 0.5
    p = copy_plan(plan)
    group = set(p.nodes[i].inputs)
    drop = [k for k, n in enumerate(p.nodes) if n.op == p.nodes[i].op
            and (k == i or (whole_group and set(n.inputs) == group))]
    for k in reversed(drop):
        n = p.nodes.pop(k)
        _reroute(p, n.outputs[0], _own_in(p, n), k)
    return drop_orphans(p), f"{where(plan, i)}{' and its group' if whole_group else ''}"


def _own_in(plan: Plan, n: Node) -> int:
    return next(t for t in n.inputs if plan.tensors[t].rank == n.rank)


def delete_node(plan: Plan, rng: random.Random) -> Result:
    """A node left out: its outputs are never written."""
    i = _pick(rng, list(range(len(plan.nodes))))
    if i is None:
        return None
    p = copy_plan(plan)
    p.nodes.pop(i)
    return p, where(plan, i)


def drop_send(plan: Plan, rng: random.Random) -> Result:
    """A send_recv left out: the receiver reads the sender's tensor directly."""
    sites = [i for i, n in enumerate(plan.nodes) if n.op == "send_recv"]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes.pop(i)
    _reroute(p, n.outputs[0], n.inputs[0], i)
    return drop_orphans(p), where(plan, i)


def permute_group(plan: Plan, rng: random.Random) -> Result:
    """Two members of a collective's group listed in the other order (the
    node's own index follows its rank): a gather, scatter or all-to-all that
    concatenates or keeps the wrong chunks; a harmless reorder for a sum.
    Order-sensitive collectives are picked half of the time when there are
    any, so the sums, which are many, do not crowd them out."""
    sites = [i for i, n in enumerate(plan.nodes)
             if n.op in (*COLLECTIVES, "reducer") and len(n.inputs) > 1]
    ordered = [i for i in sites if plan.nodes[i].op in ("all_gather", "reduce_scatter", "all_to_all")]
    i = _pick(rng, ordered if ordered and rng.random() < 0.5 else sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    a, b = rng.sample(range(len(n.inputs)), 2)
    inputs = list(n.inputs)
    inputs[a], inputs[b] = inputs[b], inputs[a]
    kw = dict(n.kwargs)
    if "index" in kw:
        kw["index"] = next(k for k, t in enumerate(inputs) if p.tensors[t].rank == n.rank)
    p.nodes[i] = n._replace(inputs=tuple(inputs), kwargs=kw)
    return p, f"{where(plan, i)} members {a} and {b} swapped"


def wrong_index(plan: Plan, rng: random.Random) -> Result:
    """A collective or split that keeps another chunk than its own: the
    ``index`` of a reduce_scatter, all_to_all or split changed."""
    sites = [i for i, n in enumerate(plan.nodes)
             if (n.op in ("reduce_scatter", "all_to_all") and len(n.inputs) > 1)
             or (n.op == "split" and n.kwargs.get("parts", 1) > 1)]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    count = n.kwargs["parts"] if n.op == "split" else len(n.inputs)
    index = rng.choice([k for k in range(count) if k != n.kwargs["index"]])
    p.nodes[i] = n._replace(kwargs={**n.kwargs, "index": index})
    return p, f"{where(plan, i)} keeps chunk {index}"


def mislabel_layout(plan: Plan, rng: random.Random) -> Result:
    """The world spec calls tensor-parallel peers data-parallel replicas
    (tp folded into dp), with or without the loss's tensor-parallel
    all_reduce left out: under that layout the peers' loss parts would sum
    to the whole loss."""
    dp, tp = int(plan.world.get("dp", 1)), int(plan.world.get("tp", 1))
    if tp < 2:
        return None
    p = copy_plan(plan)
    p.world = {**p.world, "dp": dp * tp, "tp": 1}
    drop = rng.random() < 0.5
    if drop:
        nodes = [k for k, n in enumerate(p.nodes) if n.op == "all_reduce"
                 and p.tensors[n.outputs[0]].tid == p.loss]
        for k in reversed(nodes):
            n = p.nodes.pop(k)
            _reroute(p, n.outputs[0], _own_in(p, n), k)
        p = drop_orphans(p)
    return p, f"world dp {dp} tp {tp} as dp {dp * tp} tp 1{', loss all_reduce dropped' if drop else ''}"


def mask_offset(plan: Plan, rng: random.Random) -> Result:
    """A causal mask that places its rows or columns one chunk off in the
    sequence (``row_chunk`` or ``col_chunk`` moved by one): of a mask, or
    of a causal attention block or its backward."""
    sites = [(i, k) for i, n in enumerate(plan.nodes)
             if n.op == "causal_mask" or (n.op in ("attention", "attention_grad")
                                          and n.kwargs.get("causal"))
             for k in ("row_chunk", "col_chunk")]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, k = site
    p = copy_plan(plan)
    n = p.nodes[i]
    old = n.kwargs.get(k, 0)
    new = old + rng.choice([1, -1]) if old else 1
    p.nodes[i] = n._replace(kwargs={**n.kwargs, k: new})
    return p, f"{where(plan, i)}: {k} {old} -> {new}"


def drop_exchange(plan: Plan, rng: random.Random) -> Result:
    """An all_gather that reads the rank's own piece in every slot: the
    exchange (of keys and values, of sequence chunks) left out."""
    sites = [i for i, n in enumerate(plan.nodes) if n.op == "all_gather" and len(n.inputs) > 1]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    p.nodes[i] = n._replace(inputs=(_own(p, i),) * len(n.inputs))
    return drop_orphans(p), f"{where(plan, i)} with its own piece only"


def wrong_member(plan: Plan, rng: random.Random) -> Result:
    """One slot of an all-gather, reduce-scatter or all-to-all reads another
    member's piece of the same group: a sequence chunk (context
    parallelism's keys and values, a sequence-parallel activation), a
    parameter shard or a partial gradient exchanged with the wrong peer."""
    sites = [(i, a, b) for i, n in enumerate(plan.nodes)
             if n.op in ("all_gather", "reduce_scatter", "all_to_all") and len(n.inputs) > 1
             for a in range(len(n.inputs)) for b in range(len(n.inputs))
             if a != b and n.inputs[a] != n.inputs[b]]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, a, b = site
    p = copy_plan(plan)
    n = p.nodes[i]
    inputs = list(n.inputs)
    inputs[a] = inputs[b]
    p.nodes[i] = n._replace(inputs=tuple(inputs))
    return drop_orphans(p), (f"{where(plan, i)} slot {a} reads rank "
                             f"{plan.tensors[n.inputs[b]].rank}'s piece")


def _chunk(slices: tuple, dim: int, parts: int, k: int) -> tuple:
    lo, hi = slices[dim]
    size = (hi - lo) // parts
    out = list(slices)
    out[dim] = (lo + k * size, lo + (k + 1) * size)
    return tuple(out)


def wrong_owner(plan: Plan, rng: random.Random) -> Result:
    """A ZeRO owner keeps another owner's shard of a gradient: on one rank,
    every reduce-scatter (ZeRO-2/3) or the local split of the reduced buffer
    (ZeRO-1) of one parameter's gradient keeps chunk k instead of its own,
    and the gradient pieces and buffers after it truthfully claim chunk k.
    The rank still holds (and, with an optimizer step, updates) its own
    parameter shard."""
    params = {lt.name for lt in plan.logical if lt.kind == "param"}
    grads = {t for t, lt in enumerate(plan.logical) if lt.kind == "gradbuf"
             or lt.kind == "grad" and lt.name.removesuffix(".grad") in params}
    sites = sorted({(n.rank, n.name, n.op) for n in plan.nodes
                    if (n.op == "reduce_scatter" and len(n.inputs) > 1
                        or n.op == "split" and n.kwargs.get("parts", 1) > 1)
                    and plan.tensors[n.outputs[0]].tid in grads})
    site = _pick(rng, sites)
    if site is None:
        return None
    rank, name, op = site
    targets = [i for i, n in enumerate(plan.nodes)
               if (n.rank, n.name, n.op) == site]
    first = plan.nodes[targets[0]]
    parts = first.kwargs["parts"] if op == "split" else len(first.inputs)
    k = rng.choice([j for j in range(parts) if j != first.kwargs["index"]])
    p = copy_plan(plan)
    moved: dict[tuple, tuple] = {}
    for i in targets:
        n = p.nodes[i]
        dim = n.kwargs["dim"]
        out = p.tensors[n.outputs[0]]
        whole = p.tensors[n.inputs[0]]
        moved[out.slices] = _chunk(whole.slices, dim, parts, k)
        p.nodes[i] = n._replace(kwargs={**n.kwargs, "index": k})
    tids = {p.tensors[p.nodes[i].outputs[0]].tid for i in targets}
    base = {p.logical[t].name.removesuffix(".grad") for t in tids}
    tids |= {t for t, lt in enumerate(p.logical) if lt.kind == "gradbuf"
             and lt.name.removesuffix(".grad_buffer") in base}
    for j, t in enumerate(p.tensors):
        if t.rank == rank and t.tid in tids and t.slices in moved:
            p.tensors[j] = t._replace(slices=moved[t.slices])
    return p, f"{op} of {name} on rank {rank} keeps chunk {k}"


def stale_step(plan: Plan, rng: random.Random) -> Result:
    """An optimizer step that reads a stale or unreduced gradient: an
    earlier version of its gradient buffer (before the reducer, before the
    last accumulation) or a microbatch's gradient before it is accumulated."""
    steps = [i for i, n in enumerate(plan.nodes) if n.op in ("sgd_step", "adam_step")]
    sites = []
    for i in steps:
        n = plan.nodes[i]
        g = plan.tensors[n.inputs[1]]
        base = plan.logical[g.tid].name.removesuffix(".grad_buffer")
        tids = {t for t, lt in enumerate(plan.logical) if lt.name in (f"{base}.grad_buffer",
                                                                       f"{base}.grad")}
        written = {o for m in plan.nodes[:i] for o in m.outputs if o >= 0}
        sites += [(i, j) for j in sorted(written) if j != n.inputs[1]
                  and plan.tensors[j].rank == n.rank and plan.tensors[j].tid in tids
                  and plan.tensors[j].shape == g.shape]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, j = site
    p = copy_plan(plan)
    n = p.nodes[i]
    p.nodes[i] = n._replace(inputs=(n.inputs[0], j, *n.inputs[2:]))
    x = plan.tensors[j]
    return p, f"{where(plan, i)} reads {plan.logical[x.tid].name} mb {x.mb} v{x.version}"


def scaled_load(plan: Plan, rng: random.Random) -> Result:
    """A load (a parameter shard or a batch piece no node writes) that claims
    a factor 2, read by its consumers through a ``mul_scalar(0.5)`` copy that
    claims factor 1: the consumers see half the loaded value, and a verifier
    that took the load's claim on trust would see the halving as right."""
    written = {o for n in plan.nodes for o in n.outputs}
    read = {t for n in plan.nodes for t in n.inputs}
    sites = [i for i, t in enumerate(plan.tensors) if i not in written and i in read
             and plan.logical[t.tid].kind in ("param", "data") and t.scale == UNIT]
    t = _pick(rng, sites)
    if t is None:
        return None
    p = copy_plan(plan)
    x = p.tensors[t]
    p.tensors[t] = x._replace(scale=(2, 1))
    half = len(p.tensors)
    p.tensors.append(x._replace(version=max(u.version for u in plan.tensors if (
        u.rank, u.mb, u.tid) == (x.rank, x.mb, x.tid)) + 1))
    first = min(i for i, n in enumerate(p.nodes) if t in n.inputs)
    _reroute(p, t, half, first)
    p.nodes.insert(first, Node(x.rank, x.mb if x.mb >= 0 else p.nodes[first].mb, "mul_scalar",
                               p.nodes[first].dir, (t,), (half,), {"value": 0.5}, "halve_load"))
    return p, (f"{plan.logical[x.tid].name} on rank {x.rank} mb {x.mb} claimed 2 x its slice, "
               f"read halved")


def other_routing(plan: Plan, rng: random.Random) -> Result:
    """One rank reads another recorded constant in place of one of its own:
    another constant of the same shape (a routing mask, one-hot, per-slot
    pick or split of another value: a token sent to other experts, a
    combine picking another slot, rows cut by other split sizes), or
    another rank's piece of the same constant (the routing of other rows
    replayed). A traced plan's constants are inputs named by their value
    (docs/soundness.md, "Plans traced from PyTorch", 36 d), so a rank that
    routed otherwise reads an input of another name or piece."""
    written = {o for n in plan.nodes for o in n.outputs}
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for tid, lg in enumerate(plan.logical):
        if lg.name.startswith("const."):
            by_shape.setdefault(tuple(lg.shape), []).append(tid)
    loads = [i for i, t in enumerate(plan.tensors)
             if i not in written and plan.logical[t.tid].name.startswith("const.")]
    pieces: dict[int, set] = {}
    for i in loads:
        pieces.setdefault(plan.tensors[i].tid, set()).add(plan.tensors[i].slices)
    held = {(t.rank, t.mb, t.tid, t.version, t.slices) for t in plan.tensors}
    sites = []
    for i in loads:
        t = plan.tensors[i]
        options = [(other, t.slices) for other in by_shape[tuple(plan.logical[t.tid].shape)]
                   if other != t.tid]
        options += [(t.tid, sl) for sl in sorted(pieces[t.tid]) if sl != t.slices]
        sites += [(i, tid, sl) for tid, sl in options
                  if (t.rank, t.mb, tid, t.version, sl) not in held]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, tid, sl = site
    p = copy_plan(plan)
    t = p.tensors[i]
    p.tensors[i] = t._replace(tid=tid, slices=sl)
    return p, (f"rank {t.rank} reads {plan.logical[tid].name} {list(sl)} in place of "
               f"{plan.logical[t.tid].name} {list(t.slices)}")


MUTATIONS: dict[str, Callable[[Plan, random.Random], Result]] = {
    "drop_collective": drop_collective,
    "replace_collective": replace_collective,
    "wrong_group": wrong_group,
    "wrong_peer": wrong_peer,
    "scale_one_rank": scale_one_rank,
    "change_constant": change_constant,
    "change_constant_everywhere": change_constant_everywhere,
    "swap_inputs": swap_inputs,
    "swap_outputs": swap_outputs,
    "insert_transpose": insert_transpose,
    "stale_version": stale_version,
    "other_microbatch": other_microbatch,
    "drop_accumulation": drop_accumulation,
    "early_reducer": early_reducer,
    "wrong_final_shard": wrong_final_shard,
    "wrong_reducer_group": wrong_reducer_group,
    "missing_gradient": missing_gradient,
    "partial_loss": partial_loss,
    "delete_node": delete_node,
    "drop_send": drop_send,
    "permute_group": permute_group,
    "wrong_index": wrong_index,
    "mislabel_layout": mislabel_layout,
    "mask_offset": mask_offset,
    "drop_exchange": drop_exchange,
    "wrong_member": wrong_member,
    "wrong_owner": wrong_owner,
    "stale_step": stale_step,
    "factor_one_rank": factor_one_rank,
    "factor_every_rank": factor_every_rank,
    "factor_twice": factor_twice,
    "scaled_load": scaled_load,
    "other_routing": other_routing,
}


# ---------------------------------------------------------------- rewrites


def reorder(plan: Plan, rng: random.Random) -> Result:
    """Two neighbouring nodes on different ranks, or independent on one
    rank, run in the other order."""
    def independent(a: Node, b: Node) -> bool:
        if set(a.outputs) & set(b.inputs) - {-1} or set(b.outputs) & set(a.inputs) - {-1}:
            return False
        written = {(plan.tensors[o].tid, plan.tensors[o].rank) for o in a.outputs if o >= 0}
        return not any((plan.tensors[o].tid, plan.tensors[o].rank) in written
                       for o in b.outputs if o >= 0)
    sites = [i for i in range(len(plan.nodes) - 1)
             if independent(plan.nodes[i], plan.nodes[i + 1])]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    p.nodes[i], p.nodes[i + 1] = p.nodes[i + 1], p.nodes[i]
    return p, f"{where(plan, i)} after {where(plan, i + 1)}"


def split_all_reduce(plan: Plan, rng: random.Random) -> Result:
    """The forward all_reduce after layer 0's row-parallel wo written as
    reduce_scatter then all_gather along a dim that splits evenly."""
    p = copy_plan(plan)
    dims = [1, 0, 2]
    rng.shuffle(dims)
    for dim in dims:
        try:
            scatter_gather(p, dim=dim)
        except (ConfigError, IndexError):
            p = copy_plan(plan)
            continue
        return p, f"all_reduce of layer 0's wo as reduce_scatter + all_gather on dim {dim}"
    return None


def rename(plan: Plan, rng: random.Random) -> Result:
    """Node names changed and the tensor list permuted (indices renamed)."""
    p = copy_plan(plan)
    order = list(range(len(p.tensors)))
    rng.shuffle(order)
    new_index = {old: new for new, old in enumerate(order)}
    p.tensors = [plan.tensors[old] for old in order]
    p.nodes = [n._replace(inputs=tuple(new_index.get(t, -1) for t in n.inputs),
                          outputs=tuple(new_index.get(t, -1) for t in n.outputs),
                          name=f"n{k}.{n.name}") for k, n in enumerate(plan.nodes)]
    return p, "names and tensor indices"


def insert_identity(plan: Plan, rng: random.Random) -> Result:
    """An identity (a one-part split, a multiply by 1, an add of 0) inserted
    on one rank after a tensor."""
    t = _pick(rng, _computed(plan))
    if t is None:
        return None
    p = copy_plan(plan)
    x = p.tensors[t]
    op, kw = rng.choice([("split", {"dim": 0, "parts": 1, "index": 0}),
                         ("mul_scalar", {"value": 1.0}), ("add_scalar", {"value": 0.0})])
    if op == "split" and not x.shape:
        op, kw = "mul_scalar", {"value": 1.0}
    ok = _insert_after_producer(p, t, lambda a, b: [Node(x.rank, x.mb, op, "fw", (a,), (b,), kw,
                                                         "identity")])
    if not ok:
        return None
    return p, f"{op} after {plan.logical[x.tid].name} on rank {x.rank} mb {x.mb}"


def scatter_as_reduce_split(plan: Plan, rng: random.Random) -> Result:
    """A reduce_scatter written as an all_reduce and a local split of the
    sum (what sequence parallelism saves over Megatron's plain TP)."""
    sites = [i for i, n in enumerate(plan.nodes) if n.op == "reduce_scatter"]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    dim, out = n.kwargs["dim"], p.tensors[n.outputs[0]]
    whole = p.tensors[n.inputs[0]]
    slices = list(out.slices)
    slices[dim] = whole.slices[dim]
    p.tensors.append(out._replace(shape=whole.shape, slices=tuple(slices), version=-1))
    summed = len(p.tensors) - 1
    index = n.kwargs["index"]
    p.nodes[i:i + 1] = [
        n._replace(op="all_reduce", outputs=(summed,), kwargs={"index": index}),
        n._replace(op="split", inputs=(summed,), kwargs={"dim": dim, "parts": len(n.inputs),
                                                         "index": index}),
    ]
    number_versions(p, frozenset({out.tid}))
    return p, f"{where(plan, i)} as all_reduce + split"


def regroup_accumulation(plan: Plan, rng: random.Random) -> Result:
    """Two accumulations of one gradient buffer on one rank, (buf + g0) + g1,
    written buf + (g0 + g1): the add of the two microbatch gradients
    truthfully claims the union of their parts (the tensor-parallel peers
    keep the other grouping)."""
    readers: dict[int, int] = defaultdict(int)
    for n in plan.nodes:
        for t in n.inputs:
            readers[t] += 1
    made = {o: i for i, n in enumerate(plan.nodes) for o in n.outputs if o >= 0}
    sites = []
    for j, second in enumerate(plan.nodes):
        if second.op != "local_grad_accumulation" or made.get(second.inputs[0]) is None:
            continue
        i = made[second.inputs[0]]
        first = plan.nodes[i]
        if first.op != "local_grad_accumulation":
            continue
        g0, g1 = (plan.tensors[first.inputs[1]], plan.tensors[second.inputs[1]])
        if (readers[second.inputs[0]] == 1 and (g0.tid, g0.lver, g0.slices) == (
                g1.tid, g1.lver, g1.slices) and g0.parts[2] == g1.parts[2]
                and g0.parts[1] == g1.parts[0]):
            sites.append((i, j))
    site = _pick(rng, sites)
    if site is None:
        return None
    i, j = site
    p = copy_plan(plan)
    first, second = p.nodes[i], p.nodes[j]
    g0, g1 = p.tensors[first.inputs[1]], p.tensors[second.inputs[1]]
    p.tensors.append(g1._replace(parts=(g0.parts[0], g1.parts[1], g1.parts[2]), version=-1))
    both = len(p.tensors) - 1
    p.nodes[j:j + 1] = [
        Node(second.rank, second.mb, "add", second.dir, (first.inputs[1], second.inputs[1]),
             (both,), {}, f"{second.name}.regrouped"),
        second._replace(inputs=(first.inputs[0], both)),
    ]
    p.nodes.pop(i)
    p = drop_orphans(p)
    number_versions(p, frozenset({g1.tid, p.tensors[p.nodes[j].outputs[0]].tid}))
    return p, f"{where(plan, i)} and {where(plan, j)} as buf + (g0 + g1)"


def rescale(plan: Plan, rng: random.Random) -> Result:
    """A tensor on one rank multiplied by an exact factor and divided by it
    again, the value in between claimed with the factor (a pre-divide factor
    undone by a post-multiply, as FSDP's divide factors are)."""
    t = _pick(rng, [t for t in _computed(plan)
                    if plan.logical[plan.tensors[t].tid].kind != "gradbuf"])
    if t is None:
        return None
    p = copy_plan(plan)
    x = p.tensors[t]
    factor = rng.choice(FACTORS)
    if not _scale_after(p, t, factor, "pre_divide"):
        return None
    mid = len(p.tensors) - 1
    back = _add_tensor(p, t)
    k = next(i for i, n in enumerate(p.nodes) if mid in n.outputs)
    if not _reroute(p, mid, back, k + 1):
        return None
    p.nodes.insert(k + 1, Node(x.rank, x.mb, "div", "fw", (mid,), (back,),
                               {"value": float(factor)}, "post_multiply"))
    return p, f"{plan.logical[x.tid].name} on rank {x.rank} mb {x.mb} times {factor} and back"


#: Operators that are linear in every input a gradient flows through (the
#: glue between backward nodes): a factor on such an input is a factor on
#: the output.
_LINEAR_GLUE = ("local_grad_accumulation", "reducer", "send_recv", "split", "concat", "add",
                "mul_scalar", "div", *COLLECTIVES)


def _loss_pieces(plan: Plan) -> dict[tuple[int, int], int]:
    """(rank, mb) -> the loss tensor that rank writes last in that microbatch."""
    last = {}
    for n in plan.nodes:
        for o in n.outputs:
            if o >= 0 and plan.tensors[o].tid == plan.loss:
                last[(plan.tensors[o].rank, plan.tensors[o].mb)] = o
    return last


def per_rank_mean(plan: Plan, rng: random.Random) -> Result:
    """The per-rank mean convention written out: each (rank, microbatch)
    differentiates the mean over its own data. Its last loss piece is k times
    its share (k = n / (hi - lo) for parts [lo, hi) of n), claimed so; the
    backward's seed is k times 1, so every gradient of the microbatch carries
    k, claimed so; and each gradient is multiplied by 1/k before it is
    accumulated (the correction a trainer applies), claimed 1. What every rank
    ends with is its mean loss and the exact gradients."""
    pieces = _loss_pieces(plan)
    factors = {Fraction(abs(plan.tensors[o].parts[2]),
                        plan.tensors[o].parts[1] - plan.tensors[o].parts[0])
               for o in pieces.values()}
    seeds = [i for i, n in enumerate(plan.nodes) if n.op == "ones" and n.dir == "bw"
             and n.mb >= 0]
    if len(factors) != 1 or not seeds or any(plan.tensors[o].scale != UNIT
                                            for o in pieces.values()):
        return None
    w = plan.world  # a folded plan's parts number the shown blocks; k is the real mean's
    k = factors.pop() * (Fraction(w["fold_dp"] * w["fold_nm"], w["dp"] * w["nm"])
                         if "fold_dp" in w else 1)
    if k == 1:
        return None
    p = copy_plan(plan)
    scaled: set[int] = set()
    for i in reversed(seeds):  # the seed times k; its readers read the scaled copy
        if not _scale_after(p, p.nodes[i].outputs[0], k, "mean_seed"):
            return None
        scaled.add(len(p.tensors) - 1)
    nodes: list[Node] = []
    corrected: set[int] = set()
    for n in p.nodes:
        if n.name == "mean_seed" or not scaled & set(n.inputs):
            nodes.append(n)
            continue
        if n.op == "local_grad_accumulation" and n.inputs[1] in scaled:
            fixed = _add_tensor(p, n.inputs[1])
            _times_claim(p, fixed, 1 / k)
            corrected.add(p.tensors[fixed].tid)
            nodes.append(Node(n.rank, n.mb, "mul_scalar", n.dir, (n.inputs[1],), (fixed,),
                              {"value": float(1 / k)}, "mean_correction"))
            nodes.append(n._replace(inputs=(n.inputs[0], fixed, *n.inputs[2:])))
            continue
        if n.dir != "bw" and n.op not in _LINEAR_GLUE:
            return None  # a gradient read by a non-linear step (a norm): not this rewrite
        for o in n.outputs:
            if o >= 0:
                _times_claim(p, o, k)
                scaled.add(o)
        nodes.append(n)
    p.nodes = nodes
    for (rank, mb), o in pieces.items():  # the loss each rank ends with: its mean
        i = next(j for j, n in enumerate(p.nodes) if o in n.outputs)
        mean = _add_tensor(p, o)
        _reroute(p, o, mean, i + 1)
        _times_claim(p, mean, k)
        p.nodes.insert(i + 1, Node(rank, mb, "mul_scalar", p.nodes[i].dir, (o,), (mean,),
                                   {"value": float(k)}, "mean_loss"))
    number_versions(p, frozenset({plan.loss, *corrected}))
    return p, (f"every rank's loss a mean over its own data ({k} x its share), its gradients "
               f"/ {k} before they are accumulated")


REWRITES: dict[str, Callable[[Plan, random.Random], Result]] = {
    "reorder": reorder,
    "split_all_reduce": split_all_reduce,
    "rename": rename,
    "insert_identity": insert_identity,
    "scatter_as_reduce_split": scatter_as_reduce_split,
    "regroup_accumulation": regroup_accumulation,
    "rescale": rescale,
    "per_rank_mean": per_rank_mean,
}


# ------------------------------------------------------ context-parallel plans
# Operators for plans with a context-parallel axis (world ``cp`` > 1): the
# generator's all-gather and ring attention plans (gen_model/ring.py),
# and PyTorch's ring once traced. Each writes one of the shipped CP bugs
# (issue: context parallelism) as a small change; they return None on other
# plans. New tensors of a written-out merge or shift claim loose parts (one
# part of a partial maximum that no other tensor completes, as the ring's
# own intermediates do): such a claim is never assumed, so it says nothing.


def _cp_size(plan: Plan) -> int:
    return int(plan.world.get("cp", 1))


def _loose_parts(plan: Plan) -> Callable[[], tuple[int, int, int]]:
    """Fresh loose parts, each with a partial-maximum count no tensor uses."""
    low = [min([t.parts[2] for t in plan.tensors] + [-1])]

    def fresh() -> tuple[int, int, int]:
        low[0] -= 1
        return (0, 1, low[0])
    return fresh


def _new_tensor(plan: Plan, rank: int, mb: int, tid: int, shape: tuple[int, ...],
                slices: tuple, parts: tuple[int, int, int]) -> int:
    """A new tensor (the next free version of (rank, mb, tid))."""
    later = max((u.version for u in plan.tensors if (u.rank, u.mb, u.tid) == (rank, mb, tid)),
                default=-1)
    plan.tensors.append(plan.tensors[0]._replace(
        rank=rank, mb=mb, tid=tid, version=later + 1, shape=tuple(shape), lver=0,
        slices=tuple(slices), parts=parts, scale=UNIT))
    return len(plan.tensors) - 1


def _like(plan: Plan, t: int, parts: tuple[int, int, int], last: int | None = None) -> int:
    """A new tensor on t's rank claiming t's piece with ``parts``; with
    ``last`` its last dim is [0, last) (a loose claim needs only to fit)."""
    x = plan.tensors[t]
    shape, slices = x.shape, x.slices
    if last is not None:
        shape = (*shape[:-1], last)
        slices = (*slices[:-1], (slices[-1][0], slices[-1][0] + last))
    return _new_tensor(plan, x.rank, x.mb, x.tid, shape, slices, parts)


def _merges(plan: Plan) -> list[int]:
    return [i for i, n in enumerate(plan.nodes) if n.op == "lse_merge"] \
        if _cp_size(plan) > 1 else []


def _producers(plan: Plan) -> dict[int, int]:
    return {o: i for i, n in enumerate(plan.nodes) for o in n.outputs if o >= 0}


def merge_unshifted(plan: Plan, rng: random.Random) -> Result:
    """Ring attention: a block's log-sum-exp merged without its max shift
    (the kernel's row maximum of its masked scores not added back). The
    block's scores, scaled and masked as its attention masks them, and
    their row maximum are written out and the maximum taken off the lse
    the merge reads. Needs the single-device step to hold the scores and
    their row maximum (``Ring(scores=True)``), whose pieces they claim."""
    names = {lg.name: tid for tid, lg in enumerate(plan.logical)}
    if not {"scores", "scores.scaled", "scores.masked", "rowmax"} <= set(names):
        return None
    made = _producers(plan)
    sites = [(i, k) for i in _merges(plan) for k in (1, 3)
             if plan.nodes[made.get(plan.nodes[i].inputs[k], i)].op == "attention"
             and plan.nodes[made[plan.nodes[i].inputs[k]]].kwargs.get("causal")
             and len(plan.tensors[plan.nodes[i].inputs[k]].shape) == 2]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, k = site
    p = copy_plan(plan)
    merge = p.nodes[i]
    block = p.nodes[made[merge.inputs[k]]]
    q, kk = (p.tensors[t] for t in block.inputs[:2])
    kw = block.kwargs
    fresh = _loose_parts(plan)
    rows, cols = q.slices[1], kk.slices[1]
    score_slices = (q.slices[0], rows, cols)
    shape = (q.shape[0], q.shape[1], kk.shape[1])
    s, scaled, masked = (_new_tensor(p, merge.rank, merge.mb, names[n], shape, score_slices,
                                     (0, 1, 1)) for n in ("scores", "scores.scaled",
                                                          "scores.masked"))
    top = _new_tensor(p, merge.rank, merge.mb, names["rowmax"], shape[:2], score_slices[:2],
                      fresh())
    lse = _like(p, merge.inputs[k], fresh())
    new = [Node(merge.rank, merge.mb, "einsum", "fw", block.inputs[:2], (s,),
                {"eq": "bqd,bkd->bqk"}, "scores"),
           Node(merge.rank, merge.mb, "mul_scalar", "fw", (s,), (scaled,),
                {"value": kw["scale"]}, "scores.scaled"),
           Node(merge.rank, merge.mb, "causal_mask", "fw", (scaled,), (masked,),
                {"row_chunk": kw.get("row_chunk", 0), "col_chunk": kw.get("col_chunk", 0)},
                "scores.masked"),
           Node(merge.rank, merge.mb, "max", "fw", (masked,), (top,),
                {"dim": -1, "keepdim": False}, "rowmax"),
           Node(merge.rank, merge.mb, "sub", "fw", (merge.inputs[k], top), (lse,), {},
                "unshifted")]
    ins = list(merge.inputs)
    ins[k] = lse
    p.nodes[i] = merge._replace(inputs=tuple(ins))
    p.nodes[i:i] = new
    return p, f"{where(plan, i)}: its {'first' if k == 1 else 'second'} lse without its shift"


def merge_other_lse(plan: Plan, rng: random.Random) -> Result:
    """Ring attention: a block merged with another block's log-sum-exp (or
    the running one) in place of its own."""
    made = _producers(plan)
    sites = []
    for i in _merges(plan):
        n = plan.nodes[i]
        lb = plan.tensors[n.inputs[3]]
        sites += [(i, t) for t, j in made.items() if j < i and t != n.inputs[3]
                  and (plan.tensors[t].rank, plan.tensors[t].tid, plan.tensors[t].slices,
                       plan.tensors[t].shape) == (lb.rank, lb.tid, lb.slices, lb.shape)
                  and plan.nodes[j].op in ("attention", "lse_merge")]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, t = site
    p = copy_plan(plan)
    n = p.nodes[i]
    p.nodes[i] = n._replace(inputs=(*n.inputs[:3], t))
    return p, f"{where(plan, i)} reads the lse of {where(plan, made[t])}"


def merge_dropped_block(plan: Plan, rng: random.Random) -> Result:
    """Ring attention: a rank that merges one block fewer (one lse_merge
    left out: its readers read the running out and lse before it)."""
    i = _pick(rng, _merges(plan))
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes.pop(i)
    _reroute(p, n.outputs[0], n.inputs[0], i)
    _reroute(p, n.outputs[1], n.inputs[1], i)
    return drop_orphans(p), where(plan, i)


def _loaded(plan: Plan) -> list[int]:
    written = {o for n in plan.nodes for o in n.outputs}
    return [i for i in range(len(plan.tensors)) if i not in written]


def balance_order(plan: Plan, rng: random.Random) -> Result:
    """Load-balanced CP: one rank undoes the head-tail chunk order wrongly.
    The two sequence chunks of one of its data inputs (the tokens, the
    targets) change places: it reads chunk b's positions where it
    computes as chunk a, and a's where b."""
    if _cp_size(plan) < 2 or not plan.world.get("cp_balance"):
        return None
    pieces: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for i in _loaded(plan):
        t = plan.tensors[i]
        if plan.logical[t.tid].kind in ("data", "tokens") and len(t.shape) >= 2:
            pieces[(t.rank, t.mb, t.tid)].append(i)
    sites = sorted(key for key, ts in pieces.items()
                   if len({plan.tensors[i].slices[1] for i in ts}) == 2 and len(ts) == 2
                   and plan.tensors[ts[0]].shape == plan.tensors[ts[1]].shape)
    key = _pick(rng, sites)
    if key is None:
        return None
    a, b = pieces[key]
    p = copy_plan(plan)
    p.tensors[a] = plan.tensors[a]._replace(slices=plan.tensors[b].slices)
    p.tensors[b] = plan.tensors[b]._replace(slices=plan.tensors[a].slices)
    rank, mb, tid = key
    return p, f"rank {rank} mb {mb}: the chunks of {plan.logical[tid].name} swapped"


def _offset_sites(plan: Plan) -> dict[int, list[tuple[int, str]]]:
    """rank -> (node, what) of the position offsets a CP rank applies: its
    rotary tables' splits along the sequence (a loaded buffer split in at
    least cp parts, index not 0) and its masks' query chunk (row_chunk not
    0) of causal_mask, attention and attention_grad."""
    cp = _cp_size(plan)
    loaded = set(_loaded(plan))
    out: dict[int, list[tuple[int, str]]] = defaultdict(list)
    if cp < 2:
        return out
    for i, n in enumerate(plan.nodes):
        if n.op == "split" and n.kwargs.get("dim") == 0 and n.kwargs.get("parts", 1) >= cp \
                and n.kwargs.get("index") and n.inputs[0] in loaded \
                and plan.logical[plan.tensors[n.inputs[0]].tid].kind == "buffer":
            out[n.rank].append((i, "index"))
        elif n.op in ("causal_mask", "attention", "attention_grad") \
                and n.kwargs.get("row_chunk") and (n.op == "causal_mask" or n.kwargs.get("causal")):
            out[n.rank].append((i, "row_chunk"))
    return out


def position_offset(plan: Plan, rng: random.Random) -> Result:
    """The position offset of one CP rank not shifted: its rotary tables
    sliced at the sequence start (the rank's position ids start at 0), or,
    in a plan without them (or half the time), its masks placing its
    queries at the sequence start (row_chunk 0), forward and backward."""
    sites = _offset_sites(plan)
    rank = _pick(rng, sorted(sites))
    if rank is None:
        return None
    kinds = sorted({what for _, what in sites[rank]})
    what = kinds[0] if len(kinds) == 1 else rng.choice(kinds)
    p = copy_plan(plan)
    for i, kind in sites[rank]:
        if kind == what:
            p.nodes[i] = p.nodes[i]._replace(kwargs={**p.nodes[i].kwargs, kind: 0})
    how = "rotary tables at position 0" if what == "index" else "queries masked at position 0"
    return p, f"rank {rank}: {how}"


def _chunks(plan: Plan) -> int:
    return _cp_size(plan) * (2 if plan.world.get("cp_balance") else 1)


def _visible(kind: str, chunk: int, other: int) -> int:
    """What a block's rows see of its keys, for a block of equal-sized query
    and key chunks: every key (-1), up to the diagonal (0) or none (1)."""
    row, col = (chunk, other) if kind == "row_chunk" else (other, chunk)
    return (col > row) - (col < row)


def mask_chunk(plan: Plan, rng: random.Random) -> Result:
    """One rank's block attention (or causal mask) with the wrong causal mask
    chunk: its key chunk (or query chunk) another of the sequence's chunks,
    in the forward and, half the time, in the matching backward. A block's
    new chunk changes what its rows see (a key chunk before the queries
    moved to another one before them masks nothing differently)."""
    n_chunks = _chunks(plan)
    if _cp_size(plan) < 2:
        return None
    sites = [(i, k) for i, n in enumerate(plan.nodes) if n.dir == "fw" and (
        n.op == "causal_mask" or n.op == "attention" and n.kwargs.get("causal"))
        for k in ("row_chunk", "col_chunk")]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, k = site
    n = plan.nodes[i]
    old = n.kwargs.get(k, 0)
    choices = [c for c in range(n_chunks) if c != old]
    if n.op == "attention":  # a block: a chunk that changes what its rows see
        other = n.kwargs.get("col_chunk" if k == "row_chunk" else "row_chunk", 0)
        choices = [c for c in choices if _visible(k, c, other) != _visible(k, old, other)]
    if not choices:
        return None
    new = rng.choice(choices)
    p = copy_plan(plan)
    touched = [i]
    if rng.random() < 0.5:
        if n.op == "attention":
            touched += [j for j, m in enumerate(plan.nodes) if m.op == "attention_grad"
                        and m.rank == n.rank and m.inputs[1:4] == n.inputs and m.kwargs == n.kwargs]
        else:
            touched += [j for j, m in enumerate(plan.nodes) if m.op == "causal_mask"
                        and m.dir == "bw" and (m.rank, m.mb, m.name, m.kwargs) == (
                            n.rank, n.mb, n.name, n.kwargs)]
    for j in touched:
        p.nodes[j] = p.nodes[j]._replace(kwargs={**p.nodes[j].kwargs, k: new})
    return p, f"{where(plan, i)}: {k} {old} -> {new}" + (" and its backward" if len(touched) > 1
                                                         else "")


def kv_wrong_peer(plan: Plan, rng: random.Random) -> Result:
    """Ring attention: a key/value block rotated to the wrong peer. One
    forward send_recv of a sequence chunk reads another chunk's piece (of
    another rank, or the sender's other chunk), and so do the sends of the
    same chunk's other tensors (the values with the keys); what arrives
    still claims the chunk the ring expected."""
    if _cp_size(plan) < 2:
        return None
    made = _producers(plan)
    loaded = set(_loaded(plan))

    def ready(t: int, i: int) -> bool:
        return t in loaded or made.get(t, len(plan.nodes)) < i

    def others(i: int, x) -> list[int]:
        return [j for j, u in enumerate(plan.tensors) if (u.tid, u.mb, u.shape) == (
            x.tid, x.mb, x.shape) and u.rank != plan.nodes[i].rank
            and len(u.slices) > 1 and u.slices[1] != x.slices[1] and ready(j, i)]

    sends = [i for i, n in enumerate(plan.nodes) if n.op == "send_recv" and n.dir == "fw"
             and len(plan.tensors[n.inputs[0]].shape) > 1]
    sites = [(i, j) for i in sends for j in others(i, plan.tensors[plan.nodes[i].inputs[0]])]
    site = _pick(rng, sites)
    if site is None:
        return None
    i, j = site
    n, x, y = plan.nodes[i], plan.tensors[plan.nodes[i].inputs[0]], plan.tensors[j]
    p = copy_plan(plan)
    p.nodes[i] = n._replace(inputs=(j,), kwargs={**n.kwargs, "src": y.rank})
    moved = 1
    for k in sends:
        m = plan.nodes[k]
        z = plan.tensors[m.inputs[0]]
        if k == i or m.rank != n.rank or z.rank != x.rank or z.mb != x.mb \
                or z.slices[1] != x.slices[1] or z.tid == x.tid:
            continue
        twin = [t for t in others(k, z) if plan.tensors[t].rank == y.rank
                and plan.tensors[t].slices[1] == y.slices[1]]
        if twin:
            p.nodes[k] = m._replace(inputs=(twin[0],), kwargs={**m.kwargs, "src": y.rank})
            moved += 1
    return p, (f"{where(plan, i)}: rank {y.rank}'s chunk {y.slices[1]} in place of rank "
               f"{x.rank}'s {x.slices[1]} ({moved} sends)")


def _coords(plan: Plan, rank: int) -> tuple[int, int, int, int]:
    """(stage, replica, cp index, tp index) of a rank."""
    w = plan.world
    tp, cp, dp = int(w.get("tp", 1)), _cp_size(plan), int(w.get("dp", 1))
    return rank // (tp * cp * dp), (rank // (tp * cp)) % dp, (rank // tp) % cp, rank % tp


def loss_twice(plan: Plan, rng: random.Random) -> Result:
    """The loss aggregated over cp and dp twice (torchtitan's issue 3280):
    the token count a loss is normalised by summed over the cp ranks twice,
    so every rank's loss and its backward seed come out divided by cp (the
    claims unchanged: the plan believes its normaliser); or, half the time,
    the gradient buffers reduced over the dp x cp group and then again over
    the cp group."""
    cp = _cp_size(plan)
    if cp < 2:
        return None
    p = copy_plan(plan)
    if rng.random() < 0.5:
        pieces = _loss_pieces(plan)
        seeds = [n.outputs[0] for n in plan.nodes if n.op == "ones" and n.dir == "bw"
                 and n.mb >= 0]
        if not pieces or not seeds:
            return None
        for t in sorted({*pieces.values(), *seeds}, reverse=True):
            x = p.tensors[t]
            prod = next(i for i, n in enumerate(p.nodes) if t in n.outputs)
            out = _add_tensor(p, t)
            _reroute(p, t, out, prod + 1)
            p.nodes.insert(prod + 1, Node(x.rank, x.mb, "mul_scalar", p.nodes[prod].dir, (t,),
                                          (out,), {"value": 1 / cp}, "normalised_twice"))
        return p, f"every rank's loss and backward seed divided by cp {cp} once more"
    reducers = [i for i, n in enumerate(plan.nodes) if n.op == "reducer"]
    if not reducers:
        return None
    groups = defaultdict(list)
    for i in reducers:
        n = plan.nodes[i]
        c = _coords(plan, n.rank)
        groups[(n.name, plan.tensors[n.outputs[0]].tid, c[0], c[1], c[3])].append(i)
    for members in groups.values():
        ins = tuple(plan.nodes[i].outputs[0] for i in sorted(members, key=lambda i: plan.nodes[
            i].rank))
        for index, t in enumerate(ins):
            out = _like(p, t, plan.tensors[t].parts)
            p.nodes.append(Node(plan.tensors[t].rank, -1, "reducer", "none", ins, (out,),
                                {"index": index}, plan.nodes[members[0]].name))
    return p, "the gradient buffers reduced over dp x cp, then again over cp"


CP_MUTATIONS: dict[str, Callable[[Plan, random.Random], Result]] = {
    "merge_unshifted": merge_unshifted,
    "merge_other_lse": merge_other_lse,
    "merge_dropped_block": merge_dropped_block,
    "balance_order": balance_order,
    "position_offset": position_offset,
    "mask_chunk": mask_chunk,
    "kv_wrong_peer": kv_wrong_peer,
    "loss_twice": loss_twice,
}


def merge_order(plan: Plan, rng: random.Random) -> Result:
    """Ring attention: blocks merged in another order. Two merges in a row,
    (run + b1) + b2, written (run + b2) + b1, or one merge with its two
    sides in the other order."""
    made = _producers(plan)
    readers: dict[int, int] = defaultdict(int)
    for n in plan.nodes:
        for t in n.inputs:
            readers[t] += 1
    merges = _merges(plan)
    chains = [(made[plan.nodes[j].inputs[0]], j) for j in merges
              if plan.nodes[made.get(plan.nodes[j].inputs[0], j)].op == "lse_merge"
              and plan.nodes[made[plan.nodes[j].inputs[0]]].outputs == plan.nodes[j].inputs[:2]
              and all(readers[t] == 1 for t in plan.nodes[j].inputs[:2])]
    p = copy_plan(plan)
    if chains and rng.random() < 0.5:
        i, j = rng.choice(chains)
        first, second = plan.nodes[i], plan.nodes[j]
        new_first = first._replace(inputs=(*first.inputs[:2], *second.inputs[2:]))
        new_second = second._replace(inputs=(*first.outputs, *first.inputs[2:]))
        p.nodes[j:j + 1] = [new_first, new_second]
        p.nodes.pop(i)
        return p, f"{where(plan, i)} and {where(plan, j)}: their blocks in the other order"
    i = _pick(rng, merges)
    if i is None:
        return None
    n = plan.nodes[i]
    p.nodes[i] = n._replace(inputs=(*n.inputs[2:], *n.inputs[:2]))
    return p, f"{where(plan, i)}: its sides in the other order"


def merge_sigmoid(plan: Plan, rng: random.Random) -> Result:
    """Ring attention: one merge written the way PyTorch's ring merges,
    with sigmoid and a log of it: out = out_a - sigmoid(lse_b - lse_a)
    (out_a - out_b), lse = lse_a - log sigmoid(lse_a - lse_b)."""
    i = _pick(rng, _merges(plan))
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    oa, la, ob, lb = n.inputs
    out, lse = n.outputs
    fresh = _loose_parts(plan)
    d, w, gap, lg, diff, step = (_like(p, la, fresh()), _like(p, la, fresh()),
                                 _like(p, la, fresh()), _like(p, la, fresh()),
                                 _like(p, oa, fresh()), _like(p, oa, fresh()))
    col, sig = _like(p, oa, fresh(), last=1), _like(p, la, fresh())
    rows = p.tensors[la].shape[-1]

    def node(op: str, ins: tuple, outs: tuple, kw: dict | None = None) -> Node:
        return Node(n.rank, n.mb, op, n.dir, ins, outs, kw or {}, f"{n.name}.sigmoid")
    p.nodes[i:i + 1] = [
        node("sub", (lb, la), (d,)), node("sigmoid", (d,), (w,)),
        node("unflatten", (w,), (col,), {"dim": -1, "sizes": [rows, 1]}),
        node("sub", (oa, ob), (diff,)), node("mul", (col, diff), (step,)),
        node("sub", (oa, step), (out,)),
        node("sub", (la, lb), (gap,)), node("sigmoid", (gap,), (sig,)),
        node("log", (sig,), (lg,)), node("sub", (la, lg), (lse,)),
    ]
    return p, f"{where(plan, i)} in the sigmoid form"


CP_REWRITES: dict[str, Callable[[Plan, random.Random], Result]] = {
    "merge_order": merge_order,
    "merge_sigmoid": merge_sigmoid,
}


# ---------------------------------------------------------------- folded plans
# Operators for folded plans (docs/soundness.md, "Folded plans"): they return
# None on a plan without the fold keys.


def _replica(plan: Plan, rank: int) -> int:
    w = plan.world
    inner = int(w.get("tp", 1)) * int(w.get("cp", 1))
    return (rank // inner) % int(w.get("dp", 1))


def shown_constant(plan: Plan, rng: random.Random) -> Result:
    """A constant of the shown batch instead of the real one: the loss
    normalizer a plan traced at the shown rows would hold, on every rank."""
    if "fold_gbs" not in plan.world:
        return None
    real, shown = plan.world["fold_gbs"], plan.world["gbs"]
    sites = sorted({(n.op, n.kwargs["value"]) for n in plan.nodes
                    if n.op in ("div", "mul_scalar") and isinstance(n.kwargs.get("value"), float)
                    and n.kwargs["value"] >= real and n.kwargs["value"] % real == 0})
    site = _pick(rng, sites)
    if site is None:
        return None
    p = copy_plan(plan)
    op, value = site
    new = value * shown / real
    for i, n in enumerate(p.nodes):
        if n.op == op and n.kwargs.get("value") == value:
            p.nodes[i] = n._replace(kwargs={**n.kwargs, "value": new})
    return p, f"{op} by {value} -> {new} on every rank"


def block_differs(plan: Plan, rng: random.Random) -> Result:
    """One shown replica or microbatch runs another constant than the first
    (replica 1 or microbatch 1 only)."""
    if "fold_gbs" not in plan.world:
        return None
    sites = [i for i, n in enumerate(plan.nodes)
             if (n.mb >= 1 or _replica(plan, n.rank) >= 1)
             and isinstance(n.kwargs.get("value"), float)]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    p.nodes[i] = n._replace(kwargs={**n.kwargs, "value": n.kwargs["value"] * 2 + 1})
    return p, f"{where(plan, i)}: value {n.kwargs['value']} changed"


def partial_orbit(plan: Plan, rng: random.Random) -> Result:
    """A collective across replicas run over the rank's own replica only."""
    if "fold_gbs" not in plan.world:
        return None
    sites = [i for i, n in enumerate(plan.nodes) if get_op(n.op).group and len(
        {_replica(plan, plan.tensors[t].rank) for t in n.inputs if t >= 0}) > 1]
    i = _pick(rng, sites)
    if i is None:
        return None
    p = copy_plan(plan)
    n = p.nodes[i]
    mine = _replica(plan, n.rank)
    kept = tuple(t for t in n.inputs if t >= 0 and _replica(plan, plan.tensors[t].rank) == mine)
    index = next(k for k, t in enumerate(kept) if plan.tensors[t].rank == n.rank)
    p.nodes[i] = n._replace(inputs=kept, kwargs={**n.kwargs, "index": index})
    return p, f"{where(plan, i)}: group of replica {mine} only"


def fold_keys(plan: Plan, rng: random.Random) -> Result:
    """The fold keys say another real run than the one the plan stands for."""
    if "fold_gbs" not in plan.world:
        return None
    key, how = rng.choice([("fold_gbs", 2), ("fold_dp", 2), ("fold_nm", 2), ("fold_dp", 0),
                           ("fold_nm", 0)])
    p = copy_plan(plan)
    old = plan.world[key]
    p.world[key] = old * how if how else max(1, old // 2)
    return p, f"{key} {old} -> {p.world[key]}"


FOLD_MUTATIONS: dict[str, Callable[[Plan, random.Random], Result]] = {
    "shown_constant": shown_constant,
    "block_differs": block_differs,
    "partial_orbit": partial_orbit,
    "fold_keys": fold_keys,
}
#: Rewrites that keep every block's program (a rewrite on one rank makes a
#: folded plan's blocks differ, which is a finding by design).
FOLD_REWRITES = ("rename", "per_rank_mean")


# ------------------------------------------------------ materialized plans
# Operators for plans with every rank and microbatch written out and more
# than two replicas or microbatches (docs/soundness.md, "Materialized
# plans"): a bug in one replica, in the last microbatch or past replica 1,
# which a folded plan cannot hold. They return None on other plans.


def _materialized(plan: Plan) -> bool:
    w = plan.world
    return "fold_gbs" not in w and (int(w.get("dp", 1)) > 2 or int(w.get("nm", 1)) > 2)


def other_rows(plan: Plan, rng: random.Random) -> Result:
    """One replica loads another replica's batch rows (in every microbatch,
    or in one): its data and tokens inputs take the slices of replica d - 1."""
    dp = int(plan.world.get("dp", 1))
    if not _materialized(plan) or dp < 2:
        return None
    d = rng.randrange(1, dp)
    nm = int(plan.world.get("nm", 1))
    mbs = range(nm) if rng.random() < 0.5 else [rng.randrange(nm)]
    inner = int(plan.world.get("tp", 1)) * int(plan.world.get("cp", 1))
    written = {o for n in plan.nodes for o in n.outputs}
    data = {i for i, t in enumerate(plan.tensors) if i not in written
            and plan.logical[t.tid].kind in ("data", "tokens") and t.mb in mbs}
    source = {(t.rank, t.mb, t.tid, t.version): t.slices
              for i, t in enumerate(plan.tensors) if i in data and _replica(plan, t.rank) == d - 1}
    p = copy_plan(plan)
    changed = 0
    for i in data:
        t = p.tensors[i]
        key = (t.rank - inner, t.mb, t.tid, t.version)  # the same place in replica d - 1
        if _replica(plan, t.rank) == d and key in source:
            p.tensors[i] = t._replace(slices=source[key])
            changed += 1
    if not changed:
        return None
    return p, f"replica {d} loads replica {d - 1}'s rows in microbatch(es) {list(mbs)}"


def last_microbatch(plan: Plan, rng: random.Random) -> Result:
    """A constant changed on every rank in the last microbatch only."""
    nm = int(plan.world.get("nm", 1))
    if not _materialized(plan) or nm < 2:
        return None
    sites = sorted({(n.op, n.dir, n.name, k) for n in plan.nodes if n.mb == nm - 1
                    for k in CONSTANTS if isinstance(n.kwargs.get(k), (int, float))
                    and not isinstance(n.kwargs.get(k), bool)})
    site = _pick(rng, sites)
    if site is None:
        return None
    op, direction, name, k = site
    p = copy_plan(plan)
    for i, n in enumerate(p.nodes):
        if (n.op, n.dir, n.name, n.mb) == (op, direction, name, nm - 1):
            old = n.kwargs[k]
            p.nodes[i] = n._replace(kwargs={**n.kwargs, k: 2 * old if old else 1.0})
    return p, f"{op} ({direction}) {name}: {k} changed in microbatch {nm - 1} on every rank"


def replica_group(plan: Plan, rng: random.Random) -> Result:
    """A group formula wrong past replica 1: one rank's reducer over the
    replicas reads replica j's buffer in the slot of replica k (j, k >= 1)."""
    dp = int(plan.world.get("dp", 1))
    if not _materialized(plan) or dp < 3:
        return None
    sites = [i for i, n in enumerate(plan.nodes) if n.op in ("reducer", "all_reduce")
             and len({_replica(plan, plan.tensors[t].rank) for t in n.inputs if t >= 0}) > 2]
    i = _pick(rng, sites)
    if i is None:
        return None
    n = plan.nodes[i]
    by_replica = {_replica(plan, plan.tensors[t].rank): k for k, t in enumerate(n.inputs)
                  if t >= 0}
    others = sorted(r for r in by_replica if r >= 1 and r != _replica(plan, n.rank))
    if len(others) < 2:
        return None
    j, k = rng.sample(others, 2)
    ins = list(n.inputs)
    ins[by_replica[k]] = n.inputs[by_replica[j]]
    p = copy_plan(plan)
    kw = dict(n.kwargs)
    if "index" in kw:
        kw["index"] = next(m for m, t in enumerate(ins) if t >= 0 and p.tensors[t].rank == n.rank)
    p.nodes[i] = n._replace(inputs=tuple(ins), kwargs=kw)
    return p, f"{where(plan, i)}: replica {j}'s buffer in replica {k}'s slot"


#: Operators of one numeric ``value`` kwarg, and another such operator each
#: becomes (another program of the same shape).
_SWAPS = {"div": "mul_scalar", "mul_scalar": "div", "add_scalar": "mul_scalar"}


def _swap_op(plan: Plan, rng: random.Random, keep) -> tuple[Plan, str] | None:
    """Every node of one site (operator, direction, name) among those
    ``keep(node)`` accepts runs the other operator of ``_SWAPS``."""
    sites = sorted({(n.op, n.dir, n.name) for n in plan.nodes if n.op in _SWAPS and keep(n)})
    site = _pick(rng, sites)
    if site is None:
        return None
    p = copy_plan(plan)
    for i, n in enumerate(p.nodes):
        if (n.op, n.dir, n.name) == site and keep(n):
            p.nodes[i] = n._replace(op=_SWAPS[n.op])
    return p, f"{site[0]} ({site[1]}) {site[2]} runs {_SWAPS[site[0]]}"


def replica_op(plan: Plan, rng: random.Random) -> Result:
    """One replica (every rank, microbatch and direction of it) runs another
    operator at one site: its own replica class (docs/soundness.md)."""
    dp = int(plan.world.get("dp", 1))
    if not _materialized(plan) or dp < 3:
        return None
    d = rng.randrange(dp)
    made = _swap_op(plan, rng, lambda n: _replica(plan, n.rank) == d)
    return None if made is None else (made[0], f"replica {d}: {made[1]}")


def microbatch_op(plan: Plan, rng: random.Random) -> Result:
    """One microbatch (of one replica, or of every replica) runs another
    operator at one site."""
    nm = int(plan.world.get("nm", 1))
    if not _materialized(plan) or nm < 2:
        return None
    m = rng.randrange(nm)
    d = rng.randrange(int(plan.world.get("dp", 1))) if rng.random() < 0.5 else None
    made = _swap_op(plan, rng, lambda n: n.mb == m and (d is None or _replica(plan, n.rank) == d))
    if made is None:
        return None
    return made[0], f"microbatch {m} of {'every replica' if d is None else f'replica {d}'}: " \
        f"{made[1]}"


def owned_shard(plan: Plan, rng: random.Random) -> Result:
    """ZeRO: one replica owns another replica's shard. Its loaded inputs
    whose slices differ between replicas (the owned parameter and optimizer
    state shards) take replica j's slices, so shard j is owned twice and
    its own by nobody; with half the seeds its gradient split (or
    reduce-scatter) also keeps chunk j, claims moved with it."""
    dp = int(plan.world.get("dp", 1))
    if not _materialized(plan) or dp < 2 or not plan.world.get("zero"):
        return None
    d = rng.randrange(dp)
    j = rng.choice([e for e in range(dp) if e != d])
    inner = int(plan.world.get("tp", 1)) * int(plan.world.get("cp", 1))
    written = {o for n in plan.nodes for o in n.outputs}
    loaded = [i for i, t in enumerate(plan.tensors) if i not in written
              and plan.logical[t.tid].kind not in ("data", "tokens")]
    source = {(t.rank - inner * _replica(plan, t.rank), t.mb, t.tid, t.version): t.slices
              for i, t in ((i, plan.tensors[i]) for i in loaded) if _replica(plan, t.rank) == j}
    p = copy_plan(plan)
    changed = 0
    for i in loaded:
        t = p.tensors[i]
        key = (t.rank - inner * d, t.mb, t.tid, t.version)
        if _replica(plan, t.rank) == d and key in source and source[key] != t.slices:
            p.tensors[i] = t._replace(slices=source[key])
            changed += 1
    if not changed:
        return None
    what = f"replica {d} owns replica {j}'s shards ({changed} inputs)"
    if rng.random() < 0.5:
        for i, n in enumerate(plan.nodes):
            if _replica(plan, n.rank) != d or n.mb >= 0:
                continue
            if n.op == "split" and n.kwargs.get("parts") == dp and n.kwargs.get("index") == d:
                p.nodes[i] = p.nodes[i]._replace(kwargs={**n.kwargs, "index": j})
                out, whole = p.tensors[n.outputs[0]], p.tensors[n.inputs[0]]
                p.tensors[n.outputs[0]] = out._replace(
                    slices=_chunk(whole.slices, n.kwargs["dim"], dp, j))
        for i, n in enumerate(plan.nodes):  # ZeRO-2/3: every microbatch's scatter
            if _replica(plan, n.rank) == d and n.op == "reduce_scatter" and \
                    len(n.inputs) == dp and n.kwargs.get("index") == d:
                p.nodes[i] = p.nodes[i]._replace(kwargs={**n.kwargs, "index": j})
                out, whole = p.tensors[n.outputs[0]], p.tensors[n.inputs[j]]
                p.tensors[n.outputs[0]] = out._replace(
                    slices=_chunk(whole.slices, n.kwargs["dim"], dp, j))
                out, whole = p.tensors[n.outputs[0]], p.tensors[n.inputs[0]]
                p.tensors[n.outputs[0]] = out._replace(
                    slices=_chunk(whole.slices, n.kwargs["dim"], dp, j))
        what += ", and keeps its gradient chunk"
    return p, what


def _expert_parallel(plan: Plan) -> int:
    """The ep size of a materialized plan with expert parallelism, else 0."""
    ep = int(plan.world.get("ep", 1))
    return ep if _materialized(plan) and ep > 1 else 0


def _ep_coords(plan: Plan, rank: int) -> tuple[int, int]:
    """(edp, ep index) of a rank: its replica d is edp * ep + e."""
    d = _replica(plan, rank)
    ep = int(plan.world["ep"])
    return d // ep, d % ep


def _ep_rank(plan: Plan, rank: int, edp: int, e: int) -> int:
    """The rank at ``rank``'s place (stage, cp, tp) in replica edp * ep + e."""
    inner = int(plan.world.get("tp", 1)) * int(plan.world.get("cp", 1))
    d = _replica(plan, rank)
    return rank + (edp * int(plan.world["ep"]) + e - d) * inner


def ep_peer(plan: Plan, rng: random.Random) -> Result:
    """Expert parallelism: one site of the token all-to-all in one
    expert-data-parallel replica (every microbatch, or one) routes wrong:
    its group listed in another order, or a peer taken from another
    replica (the rank at the peer's place there)."""
    ep = _expert_parallel(plan)
    if not ep:
        return None
    edp_n = int(plan.world["dp"]) // ep
    sites = sorted({(n.dir, n.name) for n in plan.nodes if n.op == "all_to_all"})
    site = _pick(rng, sites)
    if site is None:
        return None
    edp = rng.randrange(edp_n)
    mbs = {n.mb for n in plan.nodes}
    mb = rng.choice(sorted(mbs)) if rng.random() < 0.5 else None
    other = rng.choice([x for x in range(edp_n) if x != edp]) \
        if edp_n > 1 and rng.random() < 0.5 else None
    index = {(t.rank, t.mb, t.tid, t.version): i for i, t in enumerate(plan.tensors)}
    p = copy_plan(plan)
    changed = 0
    for i, n in enumerate(plan.nodes):
        if n.op != "all_to_all" or (n.dir, n.name) != site or \
                _ep_coords(plan, n.rank)[0] != edp or (mb is not None and n.mb != mb):
            continue
        ins = list(n.inputs)
        if other is None:
            ins.reverse()
        else:
            k = next(k for k, t in enumerate(ins) if t >= 0 and plan.tensors[t].rank != n.rank)
            t = plan.tensors[ins[k]]
            moved = index.get((_ep_rank(plan, t.rank, other, _ep_coords(plan, t.rank)[1]), t.mb,
                               t.tid, t.version))
            if moved is None:
                continue
            ins[k] = moved
        own = next(k for k, t in enumerate(ins) if t >= 0 and plan.tensors[t].rank == n.rank)
        p.nodes[i] = n._replace(inputs=tuple(ins), kwargs={**n.kwargs, "index": own})
        changed += 1
    if not changed:
        return None
    how = "its group reversed" if other is None else f"a peer from replica {other}"
    return p, (f"all_to_all ({site[0]}) {site[1]} of expert-data-parallel replica {edp}, "
               f"{'every microbatch' if mb is None else f'microbatch {mb}'}: {how}")


def ep_expert(plan: Plan, rng: random.Random) -> Result:
    """Expert parallelism: one rank loads another ep rank's expert shards
    (its loaded inputs whose slices differ between the ep ranks of its
    replica take the other's slices)."""
    ep = _expert_parallel(plan)
    if not ep:
        return None
    ranks = sorted({n.rank for n in plan.nodes})
    rank = rng.choice(ranks)
    edp, e = _ep_coords(plan, rank)
    f = rng.choice([x for x in range(ep) if x != e])
    peer = _ep_rank(plan, rank, edp, f)
    written = {o for n in plan.nodes for o in n.outputs}
    source = {(t.mb, t.tid, t.version): t.slices for i, t in enumerate(plan.tensors)
              if t.rank == peer and i not in written}
    p = copy_plan(plan)
    changed = 0
    for i, t in enumerate(plan.tensors):
        key = (t.mb, t.tid, t.version)
        if t.rank == rank and i not in written and plan.logical[t.tid].kind not in (
                "data", "tokens") and source.get(key, t.slices) != t.slices:
            p.tensors[i] = t._replace(slices=source[key])
            changed += 1
    if not changed:
        return None
    return p, f"rank {rank} (replica {edp}, ep {e}) loads ep rank {f}'s experts ({changed} inputs)"


def expert_group(plan: Plan, rng: random.Random) -> Result:
    """Expert parallelism: one rank's reducer of an expert gradient (a sum
    over the expert-data-parallel replicas) reads, in one replica's slot,
    the buffer of another ep rank of that replica: other experts summed in."""
    ep = _expert_parallel(plan)
    if not ep:
        return None
    sites = [i for i, n in enumerate(plan.nodes) if n.op == "reducer" and len(
        {_ep_coords(plan, plan.tensors[t].rank)[1] for t in n.inputs if t >= 0}) == 1]
    i = _pick(rng, sites)
    if i is None:
        return None
    n = plan.nodes[i]
    index = {(t.rank, t.mb, t.tid, t.version): k for k, t in enumerate(plan.tensors)}
    k = rng.randrange(len(n.inputs))
    t = plan.tensors[n.inputs[k]]
    edp, e = _ep_coords(plan, t.rank)
    f = rng.choice([x for x in range(ep) if x != e])
    moved = index.get((_ep_rank(plan, t.rank, edp, f), t.mb, t.tid, t.version))
    if moved is None:
        return None
    ins = list(n.inputs)
    ins[k] = moved
    p = copy_plan(plan)
    kw = dict(n.kwargs)
    if "index" in kw:
        kw["index"] = next((m for m, x in enumerate(ins) if x >= 0
                            and p.tensors[x].rank == n.rank), kw["index"])
    p.nodes[i] = n._replace(inputs=tuple(ins), kwargs=kw)
    return p, f"{where(plan, i)}: ep rank {f}'s buffer in replica {edp}'s slot"


def scatter_row(plan: Plan, rng: random.Random) -> Result:
    """ZeRO-2/3: one reduce-scatter row mixes two parameters. In microbatch m
    every replica's scatters of two gradients of one shape exchange replica
    j's member, and replica j accumulates each scatter into the other's
    buffer: every replica's own values still go into its own chains (what the
    symmetry's cut sees), the sums mix the two parameters."""
    dp = int(plan.world.get("dp", 1))
    if not _materialized(plan) or dp < 2 or int(plan.world.get("zero", 0) or 0) < 2:
        return None
    scatters: dict[tuple[int, int, int], int] = {}  # (rank, mb, gradient tid) -> node
    for i, n in enumerate(plan.nodes):
        if n.op == "reduce_scatter" and n.mb >= 0 and len(n.inputs) == dp:
            scatters[(n.rank, n.mb, plan.tensors[n.outputs[0]].tid)] = i
    pairs = sorted({(r, m, a, b) for (r, m, a) in scatters for (r2, m2, b) in scatters
                    if (r2, m2) == (r, m) and a < b and
                    plan.tensors[plan.nodes[scatters[(r, m, a)]].inputs[0]].shape ==
                    plan.tensors[plan.nodes[scatters[(r, m, b)]].inputs[0]].shape})
    if not pairs:
        return None
    _, m, a, b = rng.choice(pairs)
    j = rng.randrange(dp)
    p = copy_plan(plan)
    swap: dict[int, int] = {}
    for (r, mb, t), i in scatters.items():
        other = scatters.get((r, mb, b if t == a else a))
        if mb != m or t not in (a, b) or other is None:
            continue
        ins = list(plan.nodes[i].inputs)
        ins[j] = plan.nodes[other].inputs[j]
        p.nodes[i] = plan.nodes[i]._replace(inputs=tuple(ins))
        if _replica(plan, r) == j:
            swap[plan.nodes[i].outputs[0]] = plan.nodes[other].outputs[0]
    for i, n in enumerate(plan.nodes):
        if n.op == "local_grad_accumulation" and len(n.inputs) == 2 and n.inputs[1] in swap:
            p.nodes[i] = n._replace(inputs=(n.inputs[0], swap[n.inputs[1]]))
    return p, (f"microbatch {m}: the scatters of {plan.logical[a].name} and "
               f"{plan.logical[b].name} exchange replica {j}'s member, which accumulates "
               f"each into the other's buffer")


MATERIALIZED_MUTATIONS: dict[str, Callable[[Plan, random.Random], Result]] = {
    "other_rows": other_rows,
    "last_microbatch": last_microbatch,
    "replica_group": replica_group,
    "replica_op": replica_op,
    "microbatch_op": microbatch_op,
    "owned_shard": owned_shard,
    "ep_peer": ep_peer,
    "ep_expert": ep_expert,
    "expert_group": expert_group,
    "scatter_row": scatter_row,
}
