"""Bug reproduction: the 14 parallelization bugs of the VERDICT paper (§8.3).

    inject(plan, bug) -> Plan

takes a correct parallel llama3 plan (made for dp2 pp2 tp2 nm2, but any plan
with the parallelism a bug needs will do) and returns a copy with one bug,
made the way a parallelizer gets it wrong: a collective missing, of the
wrong kind or on the wrong group, a constant wrong on some ranks, a tensor
read from the wrong rank or microbatch, a node run too early. The result is
a valid plan file (SSA, each tensor written once, reads after writes) that
looks like any other: node names, tensor views and kwargs are those a
parallelizer would write, nothing names the bug. docs/bugs.md says what the
verifier prints for each.

Targets are fixed, so every run makes the same plan:

==  =====================================================================
 1  forward all_reduce after ``layers.0.attention.wo`` (row-parallel, every
    rank and microbatch): run on a group of one rank, a rank-local copy.
    Its output keeps its view (the whole sum) but holds this rank's part.
 2  the same all_reduce nodes dropped; their outputs are never written and
    ``layers.0.add_1`` reads them.
 3  the same all_reduce nodes emitted as all_gather along the last dim.
 4  the plan has no all_gather (Megatron TP all-reduces), so the same
    all_reduce is first written as the equal reduce_scatter + all_gather
    pair along the sequence (as sequence parallelism does); the all_gather
    is then emitted as all_reduce.
 5  backward all_reduce of ``layers.0.attention_norm.mul_1.grad`` (after the
    multiref backward that sums the norm output's gradients; every rank and
    microbatch) on a group of one rank: a local copy of a partial gradient.
 6  the first forward send_recv into rank 4 (pipeline stage 1) reads the
    tensor of rank 2 (stage 0 of the other data-parallel replica) instead
    of rank 0.
 7  forward ``layers.0.attention_norm.add`` (RMSNorm eps) on rank 0, both
    microbatches: eps 1e-6 instead of 1e-5.
 8  forward ``layers.0.attention_norm.pow_1`` on rank 0: exponent 1, not 2.
 9  as 7, on ranks 0 and 1 (both TP ranks of replica 0).
10  backward ``layers.0.add_1.multiref`` (the residual stream after
    attention) on rank 0, microbatch 1: reads the gradient of copy 0 of
    microbatch 0 (a stale buffer) instead of its own.
11  backward ``layers.0.attention.apply_rotary_emb`` on rank 0: its two
    output gradients (of q and of k) swapped.
12  forward ``layers.0.attention.truediv`` on rank 0: scores divided by
    head_dim instead of sqrt(head_dim).
13  as 12, on ranks 0 and 1.
14  the last operator of the last microbatch on rank 0 is a gradient
    accumulation (a microbatch's gradients are accumulated after its
    backward, in parameter order: for this plan ``layers.15.feed_forward.w2``).
    The cross-replica reducer of that gradient, on every rank that holds it
    (0-3), is launched before that accumulation: it reduces the buffer
    version without the last microbatch, and the accumulation then updates
    the local buffer only.
==  =====================================================================

A bug that finds no target in the plan (no tensor parallelism for 1-5, no
pipeline for 6, ...) raises ValueError (a ConfigError), as does a bug number
outside 1..14.
"""

from __future__ import annotations

from backends.planfile import validate
from gen_model.config import ConfigError
from gen_model.parallelize import merge, number_versions
from verdict.plan import Node, Plan

#: One line per bug, as in the paper's table.
BUGS = {
    1: "missing all-reduce, dataflow intact",
    2: "missing all-reduce, dataflow broken",
    3: "all-reduce replaced by all-gather",
    4: "all-gather replaced by all-reduce",
    5: "backward communication missing its reduce",
    6: "wrong source rank of a send between pipeline stages",
    7: "forward add with an inconsistent constant on one rank",
    8: "forward pow with an inconsistent exponent on one rank",
    9: "forward add with inconsistent constants on several ranks",
    10: "backward multiref on one rank consuming a wrong gradient",
    11: "backward apply_rotary_emb on one rank with its output gradients swapped",
    12: "inconsistent scaling of a tensor on one rank",
    13: "inconsistent scaling of a tensor on two ranks",
    14: "reducer launched before the last operator of the last microbatch",
}

WO = "layers.0.attention.wo"
NORM_ADD = "layers.0.attention_norm.add"
NORM_POW = "layers.0.attention_norm.pow_1"
NORM_GRAD = "layers.0.attention_norm.mul_1.grad"
RESIDUAL_MULTIREF = "layers.0.add_1.multiref"
ROTARY = "layers.0.attention.apply_rotary_emb"
SCALE = "layers.0.attention.truediv"
WRONG_EPS = 1e-6  # the RMSNorm eps of some other code base; llama3 uses 1e-5


def inject(plan: Plan, bug: int) -> Plan:
    """A copy of ``plan`` with bug ``bug`` (1..14) in it; ``plan`` is unchanged."""
    if bug not in BUGS:
        raise ConfigError(f"no bug {bug}: bug-reproduction plans are br1 to br{len(BUGS)}")
    if all(plan.world.get(k, 1) == 1 for k in ("dp", "tp", "pp", "ep", "nm")):
        raise ConfigError(f"bug {bug} is a parallelization bug: it needs a parallel plan")
    if plan.world.get("model") != "llama3":
        raise ConfigError(f"bug {bug} is made for llama3 plans, not {plan.world.get('model')}")
    out = _copy(plan)
    _INJECT[bug](out)
    validate(out.to_data())  # a PlanError is a ValueError too
    return out


# ---------------------------------------------------------------- helpers


def _copy(plan: Plan) -> Plan:
    """A copy whose lists can be edited (nodes and tensors are immutable)."""
    return Plan(world=dict(plan.world), logical=list(plan.logical), tensors=list(plan.tensors),
                nodes=list(plan.nodes), loss=plan.loss, grads=dict(plan.grads))


def _find(plan: Plan, bug: int, what: str, pred) -> list[int]:
    found = [i for i, n in enumerate(plan.nodes) if pred(n)]
    if not found:
        raise ConfigError(f"bug {bug} does not apply to this plan: it has no {what}")
    return found


def _named(op: str, direction: str, name: str, ranks=None, mbs=None):
    def pred(n: Node) -> bool:
        return (n.op == op and n.dir == direction and n.name == name
                and (ranks is None or n.rank in ranks) and (mbs is None or n.mb in mbs))
    return pred


def _wo_all_reduces(plan: Plan, bug: int) -> list[int]:
    """The forward all_reduce nodes after layer 0's row-parallel wo, every rank."""
    return _find(plan, bug, f"forward all_reduce of {WO} (tensor parallelism)",
                 _named("all_reduce", "fw", WO))


def _replace(plan: Plan, i: int, **fields) -> None:
    plan.nodes[i] = plan.nodes[i]._replace(**fields)


def _own(plan: Plan, i: int) -> int:
    """The input of collective node ``i`` that lives on its own rank."""
    node = plan.nodes[i]
    return next(t for t in node.inputs if plan.tensors[t].rank == node.rank)


def _reschedule(plan: Plan, renumber: frozenset[int] = frozenset()) -> None:
    """Re-merge the per-rank node sequences into one execution order, as the
    parallelizer does, and renumber in that order the SSA versions of the
    logical tensors ``renumber``. On an unchanged plan this gives back the
    same order."""
    seqs: dict[int, list[Node]] = {}
    for n in sorted(plan.nodes, key=lambda n: n.rank):
        seqs.setdefault(n.rank, []).append(n)
    plan.nodes = merge(seqs, plan)
    number_versions(plan, renumber)


def _per_rank_sequence_edit(plan: Plan, edits: dict[int, list[Node]]) -> None:
    """Replace node i by the nodes edits[i] (in its rank's sequence), then
    reschedule and renumber the versions of the tensors the new nodes write."""
    nodes: list[Node] = []
    for i, n in enumerate(plan.nodes):
        nodes.extend(edits.get(i, [n]))
    plan.nodes = nodes
    tids = {plan.tensors[o].tid for new in edits.values() for n in new for o in n.outputs if o >= 0}
    _reschedule(plan, frozenset(tids))


# ---------------------------------------------------------------- the bugs


def _bug1(plan: Plan) -> None:
    for i in _wo_all_reduces(plan, 1):
        _replace(plan, i, inputs=(_own(plan, i),), kwargs={"index": 0})


def _bug2(plan: Plan) -> None:
    drop = set(_wo_all_reduces(plan, 2))
    plan.nodes = [n for i, n in enumerate(plan.nodes) if i not in drop]


def _bug3(plan: Plan) -> None:
    for i in _wo_all_reduces(plan, 3):
        out = plan.tensors[plan.nodes[i].outputs[0]]
        dim = len(out.shape) - 1
        _replace(plan, i, op="all_gather", kwargs={"dim": dim, **plan.nodes[i].kwargs})


def scatter_gather(plan: Plan, bug: int = 4, dim: int = 1) -> list[int]:
    """Rewrite layer 0's forward wo all_reduce as reduce_scatter + all_gather
    along ``dim`` (the sequence): an equivalent plan. Returns the indices of
    the new all_gather nodes."""
    edits: dict[int, list[Node]] = {}
    gathers: list[Node] = []
    scattered: dict[tuple[tuple[int, ...], int], int] = {}  # (group inputs, index) -> tensor
    targets = _wo_all_reduces(plan, bug)
    for i in targets:
        node = plan.nodes[i]
        out = plan.tensors[node.outputs[0]]
        n, index = len(node.inputs), node.kwargs["index"]
        if out.shape[dim] % n:
            raise ConfigError(f"bug {bug}: dim {dim} of {WO} does not split {n} ways")
        lo, hi = out.slices[dim]
        step = (hi - lo) // n
        shape = list(out.shape)
        shape[dim] //= n
        slices = list(out.slices)
        slices[dim] = (lo + index * step, lo + (index + 1) * step)
        plan.tensors.append(out._replace(shape=tuple(shape), slices=tuple(slices), version=-1))
        scattered[(node.inputs, index)] = len(plan.tensors) - 1
    for i in targets:
        node = plan.nodes[i]
        index = node.kwargs["index"]
        mine = scattered[(node.inputs, index)]
        group = tuple(scattered[(node.inputs, k)] for k in range(len(node.inputs)))
        rs = node._replace(op="reduce_scatter", outputs=(mine,), kwargs={"dim": dim, "index": index})
        ag = node._replace(op="all_gather", inputs=group, kwargs={"dim": dim, "index": index})
        gathers.append(ag)
        edits[i] = [rs, ag]
    _per_rank_sequence_edit(plan, edits)
    keep = {id(n) for n in gathers}
    return [i for i, n in enumerate(plan.nodes) if id(n) in keep]


def _bug4(plan: Plan) -> None:
    for i in scatter_gather(plan, 4):
        _replace(plan, i, op="all_reduce", kwargs={"index": plan.nodes[i].kwargs["index"]})


def _bug5(plan: Plan) -> None:
    for i in _find(plan, 5, f"backward all_reduce of {NORM_GRAD} (tensor parallelism)",
                   _named("all_reduce", "bw", NORM_GRAD)):
        _replace(plan, i, inputs=(_own(plan, i),), kwargs={"index": 0})


def _bug6(plan: Plan) -> None:
    pp_ranks = plan.world.get("dp", 1) * plan.world.get("tp", 1)
    moves = _find(plan, 6, "forward send_recv between pipeline stages",
                  lambda n: n.op == "send_recv" and n.dir == "fw")
    i = min(moves, key=lambda j: (plan.nodes[j].rank, j))  # the first into the lowest rank
    node = plan.nodes[i]
    sent = plan.tensors[node.inputs[0]]
    wrong = sent.rank + plan.world.get("tp", 1)  # the same TP rank of the next replica
    if plan.world.get("dp", 1) < 2 or wrong // pp_ranks != sent.rank // pp_ranks:
        raise ConfigError("bug 6 needs data parallelism: the wrong source is another replica")
    other = next((k for k, t in enumerate(plan.tensors)
                  if (t.rank, t.mb, t.tid, t.version) == (wrong, sent.mb, sent.tid, sent.version)),
                 None)
    if other is None:
        raise ConfigError(f"bug 6: rank {wrong} holds no copy of the sent tensor")
    _replace(plan, i, inputs=(other,), kwargs={**node.kwargs, "src": wrong})
    _reschedule(plan)


def _first_ranks(plan: Plan, bug: int, ranks: int = 1) -> tuple[int, ...]:
    """Ranks 0 .. ranks-1: the first tensor-parallel ranks of replica 0."""
    tp = plan.world.get("tp", 1)
    if ranks > tp:
        raise ConfigError(f"bug {bug} mutates {ranks} tensor-parallel ranks; the plan has tp={tp}")
    return tuple(range(ranks))


def _set_kwarg(plan: Plan, bug: int, op: str, name: str, ranks, key: str, value) -> None:
    for i in _find(plan, bug, f"forward {op} {name} on ranks {list(ranks)}",
                   _named(op, "fw", name, ranks=ranks)):
        _replace(plan, i, kwargs={**plan.nodes[i].kwargs, key: value})


def _bug7(plan: Plan) -> None:
    _set_kwarg(plan, 7, "add_scalar", NORM_ADD, _first_ranks(plan, 7), "value", WRONG_EPS)


def _bug8(plan: Plan) -> None:
    _set_kwarg(plan, 8, "pow", NORM_POW, _first_ranks(plan, 8), "exponent", 1)


def _bug9(plan: Plan) -> None:
    _set_kwarg(plan, 9, "add_scalar", NORM_ADD, _first_ranks(plan, 9, 2), "value", WRONG_EPS)


def _bug10(plan: Plan) -> None:
    if plan.world.get("nm", 1) < 2:
        raise ConfigError("bug 10 reads another microbatch's gradient: it needs nm >= 2")
    i = _find(plan, 10, f"backward {RESIDUAL_MULTIREF} on rank 0, microbatch 1",
              _named("multiref", "bw", RESIDUAL_MULTIREF, ranks=(0,), mbs=(1,)))[0]
    node = plan.nodes[i]
    mine = plan.tensors[node.inputs[1]]
    stale = next(k for k, t in enumerate(plan.tensors)
                 if (t.rank, t.mb, t.tid, t.version) == (mine.rank, 0, mine.tid, mine.version))
    _replace(plan, i, inputs=(node.inputs[0], stale, *node.inputs[2:]))
    _reschedule(plan)


def _bug11(plan: Plan) -> None:
    for i in _find(plan, 11, f"backward {ROTARY} on rank 0",
                   _named("apply_rotary_emb", "bw", ROTARY, ranks=(0,))):
        dq, dk, *rest = plan.nodes[i].outputs
        _replace(plan, i, outputs=(dk, dq, *rest))


def _scale_by_head_dim(plan: Plan, bug: int, ranks) -> None:
    nodes = _find(plan, bug, f"forward div {SCALE}", _named("div", "fw", SCALE, ranks=ranks))
    for i in nodes:
        root = plan.nodes[i].kwargs["value"]  # sqrt(head_dim)
        if not root > 1:
            raise ConfigError(f"bug {bug}: {SCALE} does not divide by sqrt(head_dim) > 1")
        _replace(plan, i, kwargs={**plan.nodes[i].kwargs, "value": root * root})


def _bug12(plan: Plan) -> None:
    _scale_by_head_dim(plan, 12, _first_ranks(plan, 12))


def _bug13(plan: Plan) -> None:
    _scale_by_head_dim(plan, 13, _first_ranks(plan, 13, 2))


def _bug14(plan: Plan) -> None:
    if plan.world.get("nm", 1) < 2 or plan.world.get("dp", 1) < 2:
        raise ConfigError("bug 14 needs several microbatches and data parallelism")
    last_mb = plan.world["nm"] - 1
    accs = _find(plan, 14, "gradient accumulation of the last microbatch on rank 0",
                 lambda n: n.op == "local_grad_accumulation" and n.rank == 0 and n.mb == last_mb)
    name = plan.nodes[accs[-1]].name
    reducers = _find(plan, 14, f"reducer of {name}",
                     lambda n: n.op == "reducer" and n.name == name)
    last_acc = {plan.nodes[i].rank: i for i in range(len(plan.nodes))
                if plan.nodes[i].op == "local_grad_accumulation"
                and plan.nodes[i].name == name and plan.nodes[i].mb == last_mb}
    before = {plan.nodes[i].outputs[0]: plan.nodes[i].inputs[0] for i in last_acc.values()}
    moved = {}
    for i in reducers:
        node = plan.nodes[i]
        if node.rank not in last_acc or any(t not in before for t in node.inputs):
            raise ConfigError(f"bug 14: the reducer of {name} does not read last-microbatch buffers")
        moved[last_acc[node.rank]] = node._replace(inputs=tuple(before[t] for t in node.inputs))
    edits: dict[int, list[Node]] = {i: [] for i in reducers}
    for i, node in moved.items():
        edits[i] = [node, plan.nodes[i]]
    _per_rank_sequence_edit(plan, edits)


_INJECT = {1: _bug1, 2: _bug2, 3: _bug3, 4: _bug4, 5: _bug5, 6: _bug6, 7: _bug7, 8: _bug8,
           9: _bug9, 10: _bug10, 11: _bug11, 12: _bug12, 13: _bug13, 14: _bug14}
