"""The per-rank final-state contract: what every rank must end the step with.

A parallel training step is right when every rank ends with what the
single-device step computes for what that rank holds, not merely when the
union of all ranks covers the results. docs/soundness.md (rule 3) states the
contract; this module finds, from the plan's structure alone, what each rank
ends with and what it should end with:

* the parameter shards a rank holds: its producer-less ``param`` tensors
  (their slices are load-time facts, not claims of computed tensors). A
  plan that shards gradients on purpose (ZeRO, FSDP) holds, per rank, the
  shard it owns: the parameter piece it loads is that shard.
* for each held shard, the gradient buffer the rank writes last, in
  execution order: what its optimizer reads. It must be a whole piece of the
  final gradient at exactly the held slice, and its lineage must be proved.
* with an optimizer step in the plan, for each held shard, the parameter
  tensor the rank writes last: the updated single-device parameter at
  exactly that shard, proved; and likewise the optimizer's state (Adam's
  two moments), which the next step reads;
* the loss pieces a rank writes last for each of its microbatches. Summed
  with those of its data-parallel replicas (same pipeline stage, same
  tensor-parallel index in the (pp, dp, tp) rank layout of
  :func:`rank_coords`), they must be the whole loss: every microbatch and
  replica once, no tensor-parallel part.

The loss groups of :func:`loss_groups` are added to the loss lineage before
stages are proved, so "sums to the whole loss" is a proved claim, not a
count of part indices.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from verdict.lineage import Lineage, StructureError
from verdict.ops.step import OPTIMIZERS
from verdict.plan import FOLD_KEYS, UNIT, Logical, Plan, Slices


@dataclass
class RankState:
    """What one rank of the parallel plan holds and ends with."""

    rank: int
    held: dict[int, list[Slices]] = field(default_factory=dict)  # param tid -> held slices
    last_grad: dict[int, int] = field(default_factory=dict)  # param tid -> last gradbuf tensor
    #: param tid -> slice -> the last gradbuf tensor at that slice (read when
    #: the plan's world has ``grad_blocks``: see :func:`check_final`)
    grad_blocks: dict[int, dict[Slices, int]] = field(default_factory=dict)
    loss: list[int] = field(default_factory=list)  # last loss tensor of each microbatch
    last_param: dict[int, int] = field(default_factory=dict)  # param tid -> last param written
    last_state: dict[int, int] = field(default_factory=dict)  # state tid -> last state written


def optimizer_states(single: Plan) -> dict[int, tuple[int, ...]]:
    """Parameter tid -> the tids of the optimizer state its step writes besides
    the parameter (Adam's exp_avg and exp_avg_sq; none for SGD)."""
    states = {}
    for node in single.nodes:
        if node.op in OPTIMIZERS:
            states[single.tensors[node.inputs[0]].tid] = tuple(
                single.tensors[o].tid for o in node.outputs[1:] if o >= 0)
    return states


def rank_coords(world: dict, rank: int) -> tuple[int, int, int]:
    """(pipeline stage, data-parallel index, tensor-parallel index) of a rank
    in the (pp, dp, cp, tp) row-major layout every plan uses. Context
    parallelism splits a replica's tokens along the sequence as data
    parallelism splits the batch, so its ranks count as data-parallel
    indices here: index d * cp + c."""
    dp = int(world.get("dp", 1)) * int(world.get("cp", 1))
    tp = int(world.get("tp", 1))
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def check_layout(parallel: Plan) -> None:
    """The world's (pp, dp, cp, tp) layout must describe the plan.

    The layout decides which ranks are data-parallel replicas, whose losses
    may be summed; a layout that called tensor-parallel peers replicas would
    let a tensor-parallel part of the loss pass as a replica's whole loss.
    So it is checked against load-time facts, the batch rows each rank loads
    (batch dim 0 of every data and tokens input): ranks of one data-parallel
    index load the same rows of a tensor, ranks of different indices
    disjoint rows. With context parallelism (cp > 1) an index is a (replica,
    sequence chunk) pair and the pieces compared are boxes of (batch rows,
    sequence positions). Raises StructureError('layout') when it does not
    hold.
    """
    world = parallel.world
    pp, dp, tp = (int(world.get(k, 1)) for k in ("pp", "dp", "tp"))
    dp *= int(world.get("cp", 1))
    top = max((t.rank for t in parallel.tensors), default=0)
    if top >= pp * dp * tp:
        raise StructureError("layout", f"rank {top} is outside the world's layout of "
                                       f"pp*dp*cp*tp = {pp * dp * tp} ranks")
    producer = parallel.producers()
    box = 2 if int(world.get("cp", 1)) > 1 else 1  # context parallel: rows and sequence
    rows: dict[int, dict[int, set]] = defaultdict(lambda: defaultdict(set))
    for i, t in enumerate(parallel.tensors):
        if producer[i] < 0 and t.slices and parallel.logical[t.tid].kind in ("data", "tokens"):
            rows[t.tid][t.rank].add(t.slices[:box])
    for tid, by_rank in sorted(rows.items()):
        name = parallel.logical[tid].name
        first: dict[int, tuple[int, set]] = {}
        for rank, ranges in sorted(by_rank.items()):
            d = rank_coords(world, rank)[1]
            if d not in first:
                first[d] = (rank, ranges)
            elif first[d][1] != ranges:
                raise StructureError("layout", (
                    f"ranks {first[d][0]} and {rank} are both data-parallel index {d} in the "
                    f"world's (pp, dp, tp) = ({pp}, {dp}, {tp}) layout but load different batch "
                    f"rows of {name}: the layout does not describe the plan"))
        pair = first_overlap({d: boxes for d, (_, boxes) in first.items()}, box)
        if pair:
            (d, (ra, _)), (e, (rb, _)) = ((k, first[k]) for k in pair)
            raise StructureError("layout", (
                f"ranks {ra} and {rb} are data-parallel indices {d} and {e} in the world's "
                f"(pp, dp, tp) = ({pp}, {dp}, {tp}) layout but load overlapping batch rows "
                f"of {name}: the layout does not describe the plan (replicas load disjoint "
                f"data)"))


#: Candidate pairs looked at per array pass of :func:`first_overlap`.
_PAIRS_PER_PASS = 1 << 22


def first_overlap(boxes: dict[int, set], width: int) -> tuple[int, int] | None:
    """The lowest pair of indices (d, e), d < e, of which a box of d and a
    box of e overlap (in every dimension they both have, as ``zip`` pairs
    them), or None.

    Sort and sweep instead of comparing every pair of indices: boxes
    sorted by their start in dimension 0; the boxes whose start lies before
    box i's end follow it in that order, so the candidate pairs are ranges,
    enumerated by array operations and then tested in every dimension.
    Cost: sorting the boxes plus the pairs that overlap in dimension 0 (in
    a plan whose replicas load disjoint rows, about none but the boxes of
    one index, or of the context-parallel chunks of one replica's rows)."""
    owner, rows = [], []
    big = np.iinfo(np.int64).max // 4
    for d, bs in boxes.items():
        for b in bs:
            owner.append(d)
            rows.append([*(x for x0_x1 in b for x in x0_x1), *(-big, big) * (width - len(b))])
    if not rows:
        return None
    a = np.array(rows, dtype=np.int64).reshape(len(rows), width, 2)
    d = np.array(owner, dtype=np.int64)
    order = np.argsort(a[:, 0, 0], kind="stable")
    a, d = a[order], d[order]
    ends = np.searchsorted(a[:, 0, 0], a[:, 0, 1], side="left")
    counts = np.maximum(ends - np.arange(len(a)) - 1, 0)
    best: tuple[int, int] | None = None
    start = 0
    while start < len(a):
        stop = start + max(1, int(np.searchsorted(np.cumsum(counts[start:]), _PAIRS_PER_PASS)))
        c = counts[start:stop]
        i = np.repeat(np.arange(start, stop), c)
        j = i + 1 + np.arange(len(i)) - np.repeat(np.cumsum(c) - c, c)
        hit = (d[i] != d[j]) & ((a[i, :, 0] < a[j, :, 1]) & (a[j, :, 0] < a[i, :, 1])).all(axis=1)
        if hit.any():
            lo, hi = np.minimum(d[i[hit]], d[j[hit]]), np.maximum(d[i[hit]], d[j[hit]])
            k = np.lexsort((hi, lo))[0]
            found = (int(lo[k]), int(hi[k]))
            best = found if best is None else min(best, found)
        start = stop
    return best


def final_version(plan: Plan, tid: int) -> int:
    """The last version of a logical tensor in a single-device plan."""
    return max(t.version for t in plan.tensors if t.tid == tid)


def rank_states(single: Plan, parallel: Plan) -> dict[int, RankState]:
    """Every rank that holds a parameter or ends with a loss or gradient."""
    states: dict[int, RankState] = {}

    def state(rank: int) -> RankState:
        return states.setdefault(rank, RankState(rank))

    producer = parallel.producers()
    grad_of = {buf: p for p, buf in single.grads.items()}
    state_tids = {s for states in optimizer_states(single).values() for s in states}
    for i, t in enumerate(parallel.tensors):
        if producer[i] < 0 and t.tid in single.grads and t.lver == 0:  # loaded, not updated
            held = state(t.rank).held.setdefault(t.tid, [])
            if t.slices not in held:
                held.append(t.slices)
    last_loss: dict[tuple[int, int], int] = {}
    for node in parallel.nodes:
        for o in node.outputs:
            if o < 0:
                continue
            t = parallel.tensors[o]
            if t.tid in grad_of:
                state(t.rank).last_grad[grad_of[t.tid]] = o
                state(t.rank).grad_blocks.setdefault(grad_of[t.tid], {})[t.slices] = o
            elif t.tid in single.grads:
                state(t.rank).last_param[t.tid] = o
            elif t.tid in state_tids:
                state(t.rank).last_state[t.tid] = o
            elif t.tid == single.loss:
                last_loss[(t.rank, t.mb)] = o
    for (rank, _), o in sorted(last_loss.items()):
        state(rank).loss.append(o)
    return dict(sorted(states.items()))


def loss_groups(single: Plan, parallel: Plan, states: dict[int, RankState]) -> list[tuple[int, ...]]:
    """For each set of data-parallel replicas that ends with the loss, the
    loss tensors they end with, which must sum to the whole loss."""
    by_group: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, st in states.items():
        if st.loss:
            stage, _, tp = rank_coords(parallel.world, rank)
            by_group[(stage, tp)].extend(st.loss)
    return [tuple(sorted(g)) for _, g in sorted(by_group.items())]


def add_loss_groups(single: Plan, parallel: Plan, lineages: list[Lineage], of_gp: list[int],
                    groups: list[tuple[int, ...]]) -> None:
    """Make each replica set's loss tensors a group of the loss lineage, so
    the stage that proves the loss proves their sum. A set whose tensors are
    not all claimed as pieces of the final loss is left out here and reported
    by :func:`check_final`."""
    final = final_version(single, single.loss)
    for group in groups:
        tensors = [parallel.tensors[t] for t in group]
        if any(t.lver != final for t in tensors) or len({t.slices for t in tensors}) != 1:
            continue
        lin = lineages[of_gp[group[0]]]
        entry = (tensors[0].slices, group)
        if entry not in lin.groups and (len(group) > 1 or not tensors[0].is_whole()):
            lin.groups.append(entry)


def _cells(slices: list[Slices], cuts: list[list[int]]) -> set[tuple[int, ...]]:
    """The cells of the grid ``cuts`` (each dim's sorted boundaries) that
    the slices cover, by their indices."""
    covered: set[tuple[int, ...]] = set()
    for s in slices:
        cells: set[tuple[int, ...]] = {()}
        for d, (a, b) in enumerate(s):
            ks = range(cuts[d].index(a), cuts[d].index(b))
            cells = {c + (k,) for c in cells for k in ks}
        covered |= cells
    return covered


def _box(slices: list[Slices]) -> Slices | None:
    """The slice the held pieces make together, if they make one box.

    Works on the grid of the pieces' own boundaries, so its cost depends on
    the number of pieces, never on the tensor's size."""
    box = tuple((min(s[d][0] for s in slices), max(s[d][1] for s in slices))
                for d in range(len(slices[0])))
    cuts = [sorted({x for s in slices for x in s[d]}) for d in range(len(box))]
    covered = _cells(slices, cuts)
    needed = 1
    for c in cuts:
        needed *= len(c) - 1
    return box if len(covered) == needed else None


def _contains(outer: Slices, inner: Slices) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _show(s: Slices) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in s) + "]"


def check_final(single: Plan, parallel: Plan, states: dict[int, RankState],
                lineages: list[Lineage], of_gp: list[int], proved: set[int]) -> list[str]:
    """Every way a rank's final state breaks the contract, one line each;
    ``proved`` holds the lineage ids proved by stages (or assumed inputs)."""
    problems = []
    name = single.logical
    final_grad = {p: final_version(single, buf) for p, buf in single.grads.items()}
    final_param = {p: final_version(single, p) for p in single.grads}
    opt_states = optimizer_states(single)
    holders: dict[int, list[Slices]] = defaultdict(list)
    blocks = bool(parallel.world.get("grad_blocks"))
    # a distributed optimizer's step: every final parameter and state as blocks (item 90)
    finals = final_blocks(parallel)
    state_blocks: dict[int, list[int]] = defaultdict(list)
    read: dict[int, list[Slices]] = defaultdict(list)  # with grad_blocks: the blocks ranks end with
    for rank, st in states.items():
        for p, held in sorted(st.held.items()):
            holders[p] += held
            box = held[0] if len(held) == 1 else _box(held)
            pname = name[p].name
            if blocks:
                # a rank may hold pieces that make no single shard (a strided
                # shard's parts, docs/soundness.md, "Plans traced from
                # PyTorch", 87): each block lies in one of them
                for s, t_index in sorted(st.grad_blocks.get(p, {}).items()):
                    read[p].append(s)
                    inside = box if box is not None else next(
                        (h for h in held if _contains(h, s)), held[0])
                    problems += _check_block(parallel, rank, pname, inside, s, t_index,
                                             final_grad[p], of_gp, proved)
                if final_param[p] > 0 and finals is not None and box is None:
                    # a strided shard's pieces (item 116 (c)): each piece made by
                    # the updated blocks that lie in it, and no block outside them
                    problems += _check_pieces_blocks(parallel, rank, pname, held, p,
                                                     finals.get((rank, p), []), final_param[p],
                                                     of_gp, proved)
                    for s in opt_states.get(p, ()):
                        state_blocks[s] += finals.get((rank, s), [])
                elif final_param[p] > 0:
                    if finals is None or box is None:
                        # an update over gradient blocks is checked only as a
                        # distributed optimizer's final blocks (item 90)
                        problems.append(f"rank {rank} holds {pname} with its gradient as blocks "
                                        f"and its update is not listed as final blocks of a "
                                        f"shard: the update is unchecked")
                        continue
                    problems += _check_final_blocks(parallel, rank, pname, box, p,
                                                    finals.get((rank, p), []), final_param[p],
                                                    of_gp, proved)
                    for s in opt_states.get(p, ()):
                        state_blocks[s] += finals.get((rank, s), [])
                continue
            if box is None:
                problems.append(f"rank {rank} holds pieces {', '.join(map(_show, held))} of "
                                f"{pname}, which make no single shard")
                continue
            t_index = st.last_grad.get(p)
            if t_index is None:
                problems.append(f"rank {rank} holds shard {_show(box)} of {pname} but ends with "
                                f"no gradient for it")
                continue
            t = parallel.tensors[t_index]
            what = (f"rank {rank} holds shard {_show(box)} of {pname} but ends with "
                    f"Tensor(rank={rank}, mb={t.mb}, tid={t.tid}, v={t.version})")
            if t.slices != box:
                problems.append(f"{what}, the gradient of slice {_show(t.slices)}")
            elif t.lver != final_grad[p] or not t.is_whole():
                problems.append(f"{what}, which is not the fully accumulated and reduced "
                                f"gradient (version {t.lver} of {final_grad[p]}, parts {t.parts})")
            elif t.scale != UNIT:
                problems.append(f"{what}, {t.factor()} x the gradient{factor_origin(parallel, t_index)}")
            elif of_gp[t_index] not in proved:
                problems.append(f"{what}, whose gradient is never proved")
            elif final_param[p] > 0 and finals is not None:
                problems += _check_final_blocks(parallel, rank, pname, box, p,
                                                finals.get((rank, p), []), final_param[p],
                                                of_gp, proved)
                for s in opt_states.get(p, ()):
                    state_blocks[s] += finals.get((rank, s), [])
            elif final_param[p] > 0:
                problems += _check_update(parallel, rank, pname, box, st.last_param.get(p),
                                          final_param[p], of_gp, proved)
                for s in opt_states.get(p, ()):
                    problems += _check_update(parallel, rank, pname, box, st.last_state.get(s),
                                              final_version(single, s), of_gp, proved,
                                              f"its {name[s].name}")
    for p in single.grads:
        shape = name[p].shape
        if not holders.get(p):
            problems.append(f"no rank holds {name[p].name}")
        elif _box(holders[p]) != tuple((0, n) for n in shape):
            problems.append(f"the ranks' shards of {name[p].name} do not cover it")
        elif blocks and (not read.get(p) or _box(read[p]) != tuple((0, n) for n in shape)):
            problems.append(f"the blocks of the gradient of {name[p].name} the ranks end with "
                            f"do not cover it")
    for p, states_of in opt_states.items() if finals is not None else ():
        for s in states_of:
            problems += _check_state_blocks(parallel, name[p], name[s].name, s,
                                            state_blocks.get(s, []), final_version(single, s),
                                            of_gp, proved)
    problems += _check_loss(single, parallel, states, lineages, of_gp, proved)
    return problems


def final_blocks(parallel: Plan) -> dict[tuple[int, int], list[int]] | None:
    """With a distributed optimizer's step (the world's ``final_blocks``):
    (rank, single-device tensor) -> the plan tensors the rank ends with of
    it (docs/soundness.md, "Plans traced from PyTorch", 90 (d)); else None."""
    listed = parallel.world.get("final_blocks")
    if not listed:
        return None
    index = {(t.rank, t.mb, t.tid, t.version): i for i, t in enumerate(parallel.tensors)}
    out: dict[tuple[int, int], list[int]] = defaultdict(list)
    for entry in str(listed).split(";"):  # "rank,tid,tensor's rank,mb,tid,version"
        rank, tid, *key = (int(x) for x in entry.split(","))
        # a listed tensor the plan lacks: -1, reported as a final tensor not held
        out[(rank, tid)].append(index.get(tuple(key), -1))
    return dict(out)


def _block_problem(parallel: Plan, rank: int, what: str, t_index: int, tid: int, final: int,
                   of_gp: list[int], proved: set[int]) -> str | None:
    if t_index < 0:
        return f"rank {rank} ends with a tensor of {what} that the plan does not hold"
    t = parallel.tensors[t_index]
    ends = (f"rank {rank} ends with Tensor(rank={t.rank}, mb={t.mb}, tid={t.tid}, "
            f"v={t.version}) as its block {_show(t.slices)} of {what}")
    if t.rank != rank or t.tid != tid:
        return f"{ends}, which holds {parallel.logical[t.tid].name} there"
    if t.lver != final or not t.is_whole():
        return (f"{ends}, which is not the updated {what} there (version {t.lver} of {final}, "
                f"parts {t.parts})")
    if t.scale != UNIT:
        return f"{ends}, {t.factor()} x the updated {what}{factor_origin(parallel, t_index)}"
    if of_gp[t_index] not in proved:
        return f"{ends}, whose update is never proved"
    return None


def _check_final_blocks(parallel: Plan, rank: int, pname: str, box: Slices, p: int,
                        tensors: list[int], final: int, of_gp: list[int],
                        proved: set[int]) -> list[str]:
    """The blocks of a parameter a rank ends with after a distributed
    optimizer's step: each the updated single-device parameter there,
    proved, inside the rank's shard, and together the whole shard (the
    all-gather gave it every other rank's updated range)."""
    if not tensors:
        return [f"rank {rank} holds shard {_show(box)} of {pname} but never updates it"]
    problems = []
    for t_index in tensors:
        found = _block_problem(parallel, rank, pname, t_index, p, final, of_gp, proved)
        if found:
            problems.append(found)
        elif not _contains(box, parallel.tensors[t_index].slices):
            problems.append(f"rank {rank} ends with block {_show(parallel.tensors[t_index].slices)}"
                            f" of {pname}, outside its shard {_show(box)}")
    if not problems and not _covers([parallel.tensors[t].slices for t in tensors], box):
        problems.append(f"rank {rank} holds shard {_show(box)} of {pname} but its updated blocks "
                        f"{', '.join(_show(parallel.tensors[t].slices) for t in tensors)} do "
                        f"not make it (elements left as loaded)")
    return problems


def _check_pieces_blocks(parallel: Plan, rank: int, pname: str, held: list[Slices], p: int,
                         tensors: list[int], final: int, of_gp: list[int],
                         proved: set[int]) -> list[str]:
    """The updated blocks of a parameter a rank holds as pieces that make no
    single shard (a strided shard's): each block inside one piece, and each
    piece made by its blocks, as ``_check_final_blocks`` requires of a shard."""
    outside = [t for t in tensors
               if not any(_contains(h, parallel.tensors[t].slices) for h in held)]
    if outside:
        return [f"rank {rank} ends with block {_show(parallel.tensors[outside[0]].slices)} of "
                f"{pname}, outside its pieces {', '.join(map(_show, held))}"]
    problems = []
    for h in held:
        inside = [t for t in tensors if _contains(h, parallel.tensors[t].slices)]
        problems += _check_final_blocks(parallel, rank, pname, h, p, inside, final, of_gp,
                                        proved)
    return problems


def _check_state_blocks(parallel: Plan, p: Logical, sname: str, s: int, tensors: list[int],
                        final: int, of_gp: list[int], proved: set[int]) -> list[str]:
    """An optimizer state after a distributed optimizer's step: each rank's
    blocks (its range) the updated single-device state there, proved, and
    the ranks' blocks together the whole state."""
    problems = []
    for t_index in tensors:
        found = _block_problem(parallel, parallel.tensors[t_index].rank, sname, t_index, s,
                               final, of_gp, proved)
        if found:
            problems.append(found)
    whole = tuple((0, n) for n in p.shape)
    if not problems and not _covers([parallel.tensors[t].slices for t in tensors], whole):
        problems.append(f"the ranks' blocks of {sname} do not make the whole state")
    return problems


def _covers(slices: list[Slices], box: Slices) -> bool:
    """The slices, inside ``box``, cover every element of it."""
    if not slices or any(not _contains(box, s) for s in slices):
        return False
    cuts = [sorted({a for s in slices for a in s[d]} | set(box[d])) for d in range(len(box))]
    covered = _cells(slices, cuts)
    needed = {()}
    for d, (a, b) in enumerate(box):
        needed = {c + (k,) for c in needed for k in range(cuts[d].index(a), cuts[d].index(b))}
    return needed <= covered


def _check_block(parallel: Plan, rank: int, pname: str, box: Slices, s: Slices, t_index: int,
                 final: int, of_gp: list[int], proved: set[int]) -> list[str]:
    """With ``grad_blocks``: a block of the gradient a rank ends with (the
    flat range of it the rank's distributed optimizer reads) lies in the
    rank's shard and is the fully reduced gradient there, proved."""
    t = parallel.tensors[t_index]
    what = (f"rank {rank} holds shard {_show(box)} of {pname} and ends with "
            f"Tensor(rank={rank}, mb={t.mb}, tid={t.tid}, v={t.version}), its block {_show(s)}")
    if not _contains(box, s):
        return [f"{what}, outside the shard"]
    if t.lver != final or not t.is_whole():
        return [f"{what}, which is not the fully accumulated and reduced gradient (version "
                f"{t.lver} of {final}, parts {t.parts})"]
    if t.scale != UNIT:
        return [f"{what}, {t.factor()} x the gradient{factor_origin(parallel, t_index)}"]
    if of_gp[t_index] not in proved:
        return [f"{what}, whose gradient is never proved"]
    return []


def _check_update(parallel: Plan, rank: int, pname: str, box: Slices, u: int | None,
                  final: int, of_gp: list[int], proved: set[int], what: str = "it") -> list[str]:
    """With an optimizer step: the parameter (or optimizer state, ``what``)
    a rank writes last, ``u``, is the updated single-device tensor at its
    held shard, proved: a whole piece whose slice is the shard or contains
    it (ZeRO-1/2 all-gather the updated shards, so every rank ends with the
    whole updated parameter)."""
    if u is None:
        return [f"rank {rank} holds shard {_show(box)} of {pname} but never updates {what}"]
    t = parallel.tensors[u]
    tname = parallel.logical[t.tid].name
    ends = (f"rank {rank} holds shard {_show(box)} of {pname} but ends with "
            f"Tensor(rank={rank}, mb={t.mb}, tid={t.tid}, v={t.version})")
    if not _contains(t.slices, box):
        return [f"{ends}, the update of {tname} at slice {_show(t.slices)}"]
    if t.lver != final or not t.is_whole():
        return [f"{ends}, which is not the updated {tname} (version {t.lver} of {final}, "
                f"parts {t.parts})"]
    if t.scale != UNIT:
        return [f"{ends}, {t.factor()} x the updated {tname}{factor_origin(parallel, u)}"]
    if of_gp[u] not in proved:
        return [f"{ends}, whose update of {tname} is never proved"]
    return []


def _loss_convention(tensors, shown: Fraction = Fraction(1)) -> str | None:
    """How a replica set's loss tensors are scaled: 'share' (each its parts of
    the loss, scale 1), 'mean' (each the mean over its own data: n/(hi-lo)
    times its parts), 'rank mean' (each n/H times its parts, H the parts
    its rank's loss tensors hold in all: microbatch means over the
    microbatch count), or None for anything else (docs/soundness.md, "Scaled
    claims"). In a folded plan or a cut of one, whose parts number the shown
    blocks only, a mean over a block's own data is still a mean of the real
    run: n counts the real blocks, ``shown`` times the parts' n (the real
    blocks over the shown ones; "Scaled claims under a fold or a cut")."""
    if all(t.scale == UNIT for t in tensors):
        return "share"
    if all(t.factor() == shown * Fraction(abs(t.parts[2]), t.parts[1] - t.parts[0])
           for t in tensors):
        return "mean"
    held: dict[int, int] = {}  # the parts each rank's loss tensors hold in all
    for t in tensors:
        held[t.rank] = held.get(t.rank, 0) + t.parts[1] - t.parts[0]
    if all(t.factor() == shown * Fraction(abs(t.parts[2]), held[t.rank]) for t in tensors):
        return "rank mean"  # Megatron's: each microbatch's mean over the microbatch count
    return None


def shown_ratio(world: dict) -> Fraction:
    """The real blocks (replicas x microbatches) over the shown ones: 1 for a
    plan that is not folded."""
    if not all(k in world for k in FOLD_KEYS):
        return Fraction(1)
    return Fraction(int(world["fold_dp"]) * int(world["fold_nm"]),
                    int(world["dp"]) * int(world["nm"]))


def factor_origin(parallel: Plan, t: int) -> str:
    """Where tensor t's factor comes from: walking back through producers
    whose output has t's factor, the first node whose inputs (on its own
    rank) all carry another factor. '' when there is none to name."""
    producer = parallel.producers()
    scale = parallel.tensors[t].scale
    seen = set()
    while producer[t] >= 0 and t not in seen:
        seen.add(t)
        node = parallel.nodes[producer[t]]
        same = [i for i in node.inputs if i >= 0 and parallel.tensors[i].scale == scale]
        if not same:
            return (f", a factor applied by {node.op} ({node.dir}) at {node.name or 'the step'} "
                    f"on rank {node.rank} mb {node.mb}")
        # past a value made from nothing (zeros claimed at the factor of
        # what they are put beside) when another input carries the factor
        made = [i for i in same if producer[i] >= 0 and parallel.nodes[producer[i]].inputs]
        t = (made or same)[0]
    return ""


def _check_loss(single: Plan, parallel: Plan, states: dict[int, RankState],
                lineages: list[Lineage], of_gp: list[int], proved: set[int]) -> list[str]:
    groups = loss_groups(single, parallel, states)
    if not groups:
        return ["no rank ends with the loss"]
    final = final_version(single, single.loss)
    problems = []
    for group in groups:
        tensors = [parallel.tensors[t] for t in group]
        ranks = sorted({t.rank for t in tensors})
        where = f"the loss on ranks {ranks} (data-parallel replicas)"
        stale = [t for t in tensors if t.lver != final]
        if stale:
            t = stale[0]
            problems.append(f"{where}: Tensor(rank={t.rank}, mb={t.mb}, tid={t.tid}, "
                            f"v={t.version}) is version {t.lver} of the loss, not {final}")
            continue
        convention = _loss_convention(tensors, shown_ratio(parallel.world))
        if convention is None:
            shown = ", ".join(f"r{t.rank}/mb{t.mb}: {t.factor()} x parts {t.parts[0]}..{t.parts[1]}"
                              f" of {t.parts[2]}" for t in tensors)
            problems.append(f"{where} is scaled neither as shares of the loss nor as means over "
                            f"each rank's own data: {shown}")
            continue
        lin = lineages[of_gp[group[0]]]
        entry = (tensors[0].slices, group)
        whole_one = len(group) == 1 and tensors[0].is_whole()
        if lin.id not in proved or not (whole_one or entry in lin.groups):
            parts = ", ".join(f"r{t.rank}/mb{t.mb}: {t.parts[0]}..{t.parts[1]} of {t.parts[2]}"
                              for t in tensors)
            problems.append(f"{where} is not proved to sum to the whole loss (a part is left "
                            f"out, counted twice or left partial across tensor-parallel "
                            f"ranks): {parts}")
    return problems
