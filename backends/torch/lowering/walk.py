"""Lower whole traces: a rank's (``lower_trace``), every rank's
(``lower_ranks``), and the parameter shards checked before any is lowered
(``check_shards``)."""

from __future__ import annotations

from backends.torch.errors import LoweringError
from backends.torch.lowering.all_to_all import OPS as ALL_TO_ALL_OPS
from backends.torch.lowering.all_to_all import NeedPeers
from backends.torch.lowering.constants import check_no_value_reads
from backends.torch.lowering.context import LNode, Lowered, Lowerer, live_events
from backends.torch.lowering.count_scales import decided
from backends.torch.lowering.flat_ranges import Block, FlatRange, mark_mixed, mixed, pick
from backends.torch.lowering.ir import Const, Ids, Moment1, Moment2, NoShard, numel
from backends.torch.lowering.mask_values import Tentative
from backends.torch.lowering.param_buffers import own_runs
from backends.torch.lowering.range_steps import final_range
from backends.torch.lowering.zero_reductions import drop_zero_reductions


def lower_ranks(traces: list[dict], vocab: int) -> list[Lowered]:
    """Lower every rank's trace (in rank order). A count of kept labels
    all-reduced by a rank has, as its value, the sum of the group members'
    recorded counts: each rank is lowered once to read its counts, and again
    with the step's values when any rank all-reduces one (docs/soundness.md,
    "Plans traced from PyTorch", 16)."""
    peers = _all_to_all_peers(traces, vocab)
    first = [lower_trace(t, vocab, "collect", peers) for t in traces]
    if not any(low.count_reduces for low in first):
        resolve_gathers(first)
        drop_zero_reductions(first)
        return first
    counts = _count_sums(first)
    for _ in range(COUNT_PASSES):
        # a count reduced after another (a count broadcast, then all-reduced)
        # reads the sum of the one before: lowered again until the sums settle
        again = _count_sums([lower_trace(t, vocab, Tentative(c), peers)
                             for t, c in zip(traces, counts)])
        if again == counts:
            break
        counts = again
    else:
        raise LoweringError(f"the ranks' all-reduced counts of kept labels did not settle in "
                            f"{COUNT_PASSES} passes")
    lows = [lower_trace(t, vocab, c, peers) for t, c in zip(traces, counts)]
    resolve_gathers(lows)
    drop_zero_reductions(lows)
    return lows


#: passes of the ranks that chain all-reduced counts, before they must settle
COUNT_PASSES = 4


def _count_sums(lows: list[Lowered]) -> list[list[int]]:
    """Each rank's all-reduced counts: the sums of the members' values at
    each of its count all-reduces (or broadcasts), in order."""
    by_rank = {low.rank: low.count_reduces for low in lows}
    counts = []
    for low in lows:
        values = []
        for k, (group, _) in enumerate(low.count_reduces):
            members = [by_rank.get(m, []) for m in group]
            if any(len(c) <= k or c[k][0] != group for c in members):
                raise LoweringError(f"rank {low.rank}: its count all-reduce {k + 1} over ranks "
                                    f"{list(group)} is not every member's {k + 1}th")
            values.append(sum(c[k][1] for c in members))
        counts.append(values)
    return counts


def _all_to_all_peers(traces: list[dict], vocab: int) -> dict | None:
    """What every rank sends at each of its all-to-alls of data (rank ->
    ``all_to_all.Sent`` by (group, k)): the ranks are lowered in rounds,
    each publishing its sends, until none stops for want of a member's
    (None when no rank runs one; docs/soundness.md, "Plans traced from
    PyTorch", 37)."""
    if not any(ev[0] in ALL_TO_ALL_OPS for t in traces for ev in t["events"]):
        return None
    peers: dict[int, dict] = {}
    rounds = 2 + max(sum(ev[0] in ALL_TO_ALL_OPS for ev in t["events"]) for t in traces)
    for _ in range(rounds):
        waiting = False
        for t in traces:
            lw = Lowerer(t, vocab, counts="collect", peers=peers)
            try:
                _lower_into(lw, t)
            except NeedPeers:
                waiting = True
            peers[t["rank"]] = dict(lw.published)
        if not waiting:
            return peers
    raise LoweringError("the ranks' all-to-alls wait on each other's sends (a member that "
                        "never reaches an all-to-all another one runs)")


def lower_trace(trace: dict, vocab: int, counts: list[int] | str | None = None,
                peers: dict | None = None) -> Lowered:
    """Lower one rank's trace (``backends.torch.rank.run``'s result);
    ``counts`` as ``Lowerer.counts`` (``lower_ranks`` gives them);
    ``peers``: the members' sends at its all-to-alls (``_all_to_all_peers``)."""
    guards: list = []
    count_reads: list = []
    check_no_value_reads(trace, guards, count_reads)
    trace = {**trace, "guards": guards} if guards else trace
    trace = {**trace, "count_reads": count_reads} if count_reads else trace
    return _lower_into(Lowerer(trace, vocab, counts=counts, peers=peers), trace)


def _lower_into(lw: Lowerer, trace: dict) -> Lowered:
    """The body of ``lower_trace`` on a lowerer made for ``trace``."""
    vocab = lw.vocab
    lw.next_id = len(trace["shapes"])
    inputs, axes = lw.inputs, lw.axes
    for name, (v, full, dims) in trace["params"].items():
        local = tuple(trace["shapes"][v])
        _check_shard(name, tuple(full), local, dims)
        lw.params[v] = name
        if any(axes and n == 0 for axes, n in zip(dims, local)):
            lw.env[v] = NoShard()  # this rank holds no rows of it: not an input here
            continue
        lw.env[v] = v
        lw.shapes[v] = local
        inputs[v] = ("param", name)
        axes[v] = dims
    for name, (v, shape, what) in trace["buffers"].items():
        if what == "causal":
            lw.env[v] = Const(v, -1)
            continue
        lw.env[v] = v
        lw.shapes[v] = tuple(shape)
        inputs[v] = ("buffer", name)
        axes[v] = [[] for _ in shape]
    for source in ("data", "labels"):
        if source not in trace:
            continue
        v, ids_shape = trace[source]
        name = "tokens" if source == "data" else source
        lw.env[v] = Ids(name)
        x = lw.one_hot[name] = lw.new((*ids_shape, vocab))
        inputs[x] = ("tokens", name)
        # rows cut by the data-parallel ranks, the sequence by the
        # context-parallel ones (rank.sequence_chunk)
        axes[x] = [["dp"]] + [["cp"] if d == 1 else [] for d in range(1, len(ids_shape) + 1)]
    lw.tokens = lw.one_hot["tokens"]
    lw.run(live_events(trace))
    for v, scope in trace.get("count_reads", ()):
        decided(lw, v, scope)
    losses = [lw.materialize(lw.env[v]) for v in trace["losses"]]
    held = {n for n, (v, _, _) in trace["params"].items() if not isinstance(lw.env[v], NoShard)}
    grads = {n: (None if g is None else lw.materialize(lw.env[g])) for n, g in trace["grads"].items()
             if n in held}
    runs: dict[str, tuple] = {}
    updates = {n: x for n, v in trace.get("updates", {}).items() if n in held
               if (x := _final(lw, n, v, runs, n)) is not None}
    states = {n: {k: x for k, v in st.items() if (x := _final(lw, n, v, runs, f"{n}.{k}"))
                  is not None}
              for n, st in trace.get("states", {}).items() if n in held}
    blocks = {n: [_grad_block(lw, n, v, starts) for v, starts in vs]
              for n, vs in trace.get("grad_blocks", {}).items() if n in held}
    guards = [(_guard_number(lw, v), name, other, taken, where)
              for v, name, other, taken, where in trace.get("guards", ())]
    finals = [*updates.values(), *(v for st in states.values() for v in st.values()),
              *(r[1] for rs in runs.values() for r in rs if r[0] == "own"),
              *(b[0] for bs in blocks.values() for b in bs), *(g[0] for g in guards)]
    lw.settle()
    return Lowered(trace["rank"], trace["coords"], lw.shapes,
                   _used(lw.nodes, losses, grads, finals), inputs, axes, losses, grads,
                   lw.tokens, lw.const_values, updates, states, dict(trace.get("split", {})),
                   lw.count_reduces, lw.buckets, lw.empty_sums, lw.row_cuts,
                   dict(trace.get("ties", {})), dict(lw.anchors), blocks, guards=guards,
                   range_sums=dict(lw.range_sums), final_runs=runs,
                   gathers={g: list(ps) for g, ps in lw.range_gathers.items()},
                   mixed=dict(lw.mixed), moved_windows=set(lw.moved_windows))


def _final(lw: Lowerer, name: str, v: int | None, runs: dict, key: str) -> int | None:
    """A parameter's or state's final value; None when it is elements of
    values side by side (a distributed optimizer's range, or a gathered
    buffer's view), whose runs go to ``runs[key]`` (docs/soundness.md,
    "Plans traced from PyTorch", 90)."""
    x = final_range(lw, lw.env.get(v), lw.updated) if v is not None else None
    if lw.trace.get("parallel") and isinstance(x, int) and x in lw.params:
        return None  # read back from memory as loaded: the rank never updates it (86 (c))
    found = own_runs(lw, x)
    if found is None:
        return _updated(lw, name, v)
    if len(found) == 1 and found[0][0] == "own" and isinstance(found[0][1], int) \
            and (found[0][2], found[0][3]) == (0, numel(lw, found[0][1])) \
            and found[0][1] not in lw.params:
        return found[0][1]  # a whole value's elements: that value
    runs[key] = found
    return None


def resolve_gathers(lows: list[Lowered]) -> None:
    """Each member's run of a rank's final runs (``param_buffers.Run``) as
    the runs of that member's input to its k-th all-gather over the group
    there: every run becomes (rank, value, lo, hi) (docs/soundness.md,
    "Plans traced from PyTorch", 90 (c))."""
    by_rank = {low.rank: low for low in lows}
    for low in lows:
        for key, runs in low.final_runs.items():
            out = []
            for run in runs:
                if run[0] == "own":
                    out.append((low.rank, *run[1:]))
                    continue
                _, member, ranks, k, offset, n = run
                sent = by_rank.get(member)
                if sent is None or len(sent.gathers.get(ranks, [])) <= k:
                    raise LoweringError(f"rank {low.rank} reads {key} from its all-gather "
                                        f"{k + 1} over ranks {list(ranks)}, which rank {member} "
                                        f"never runs")
                picked = pick(list(sent.gathers[ranks][k]), offset, n)
                out += [(member, v, lo, hi) for v, lo, hi in picked]
            low.final_runs[key] = tuple(out)


def _guard_number(lw: Lowerer, v: int) -> int:
    """The lowered value of a number a guard tests (a value of the plan,
    compared with the single-device step's: ``tracer.guards.match_guards``)."""
    x = lw.env.get(v)
    value = lw.materialize(x) if x is not None else None
    if not isinstance(value, int) or value < 0:
        raise LoweringError("a branch on a number read with .item() tests a value no recorded "
                            "op computes as a value of the plan: not lowered")
    return value


def _grad_block(lw: Lowerer, name: str, v: int, starts: tuple[int, ...]
                ) -> tuple[int, tuple[int, ...], tuple[int, ...], bool]:
    """A block of a final gradient the rank reads at ``starts`` of its
    gradient (docs/soundness.md, "Plans traced from PyTorch", 57): the
    value it is a block of, the block's starts in it, its shape, and False.
    Where the lowering finds the elements read there elsewhere than at
    those starts (another block of a value, or elements of several: a
    collective wrote another range than the step reads), the elements
    themselves, a value of the block's shape, with True: that value is
    claimed to be the gradient's block at ``starts``, a claim its stage
    refutes unless it is (91 (b))."""
    x = lw.env.get(v)
    if isinstance(x, Block) and x.value >= 0:
        found, value, shape = x.starts, x.value, x.shape
    elif isinstance(x, FlatRange):  # elements of several values: no block of one
        found, value, shape = None, -1, ()
    else:
        value = lw.materialize(x) if x is not None else None
        if value is None:
            raise LoweringError(f"{name}: a block of its final gradient no recorded op produced")
        found, shape = (0,) * len(lw.shapes[value]), tuple(lw.shapes[value])
    if found is not None and tuple(found) == tuple(starts) and value not in lw.mixed:
        return value, tuple(found), tuple(shape), False
    if isinstance(x, FlatRange):
        value = mixed(lw, list(x.parts), (sum(b - a for _, a, b in x.parts),))
    else:
        start = len(lw.nodes)
        value = lw.materialize(x)  # the elements read there, a value of the block's shape
        mark_mixed(lw, start)
    _mixed_for(lw, value, name)
    return value, tuple(starts), tuple(lw.shapes[value]), True


def _mixed_for(lw: Lowerer, value: int, name: str) -> None:
    """The parameter each loose value a final block is built from belongs
    to (its claims are made beside that parameter's gradient)."""
    need = {value}
    for node in reversed(lw.nodes):
        if need.intersection(node.outs):
            for o in node.outs:
                if o in lw.mixed:
                    lw.mixed[o] = name
            need.update(v for v in node.ins if v >= 0)


def check_shards(traces: list[dict]) -> None:
    """``_check_shard`` for every parameter of every rank, before any rank
    is lowered (the rank that shows an uneven cut may not be the first)."""
    for trace in traces:
        for name, (v, full, dims) in trace["params"].items():
            _check_shard(name, tuple(full), tuple(trace["shapes"][v]), dims)


def _check_shard(name: str, full: tuple[int, ...], local: tuple[int, ...],
                 dims: list[list[str]]) -> None:
    """Refuse a rank holding none of a dim other than 0 of a parameter.
    Uneven cuts are lowered along every dim: FSDP2's padded shards of dim 0
    (a rank without rows holds no input of it), DTensor's uneven
    ``Shard(d)`` (``torch.chunk``'s pieces: docs/soundness.md, "Plans traced
    from PyTorch", 15 and 27). That the rank's rows are its chunk is checked
    where the claims are made (``build``)."""
    for d, axes in enumerate(dims):
        if d and axes and local[d] == 0:
            raise LoweringError(
                f"parameter {name} of shape {list(full)} is sharded along dim {d} so that this "
                f"rank holds none of its {full[d]} (the mesh axes {axes}); a rank with an empty "
                f"shard is lowered along dim 0 only: choose sizes the mesh divides")


def _updated(lw: Lowerer, name: str, v: int | None) -> int:
    """The lowered value a parameter or an optimizer state ends the step with."""
    x = lw.env.get(v) if v is not None else None
    x = lw.updated.get(x, x) if isinstance(x, (Moment1, Moment2)) else x
    if not isinstance(x, int) or x in lw.params:
        raise LoweringError(f"the optimizer step of {name} is not lowered (it is not "
                            f"torch.optim's AdamW or SGD, for-loop implementation)")
    return x


def _used(nodes: list[LNode], losses: list[int], grads: dict[str, int | None],
          finals: list[int] = ()) -> list[LNode]:
    """The nodes the losses, the gradients and the updated parameters and
    states depend on (collectives and sends always stay: their peers on
    other ranks are matched by order)."""
    need = set(losses) | {g for g in grads.values() if g is not None} | set(finals)
    keep = []
    for node in reversed(nodes):
        if node.group is not None or need.intersection(node.outs):
            keep.append(node)
            need.update(v for v in node.ins if v >= 0)
    return keep[::-1]
