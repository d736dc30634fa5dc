"""ZeRO-1 owned shards in a materialized plan, found and checked on the whole plan.

With ZeRO-1 each replica loads another shard of a parameter (the one it
owns), all-gathers the whole parameter from the orbit's shards before its
microbatches, reduces whole gradients as plain data parallelism does, and
keeps the chunk of the reduced gradient it owns (a local ``split``). The
block check (verdict/blocks.py) compares replicas up to these three
differences, which :func:`find_owned` checks here instead, for every node
of the plan:

* a *gather*: an ``all_gather`` outside microbatches whose inputs are the
  loaded shards of one parameter on the replicas 0..D-1 of the node's rank
  class, in that order, tiling one box along the gather's ``dim`` with equal
  widths, its ``index`` its own replica; its output claims that box, whole.
  Its value is then the loaded parameter at the box (an all-gather
  concatenates its group's inputs in group order), a function of loaded
  inputs only.
* a *keep*: the ``split`` that writes a rank's last gradient buffer of such
  a parameter, reading the output of a sum over replicas (a reducer), in
  ``parts`` D at ``index`` d along the gather's dim; its output claims chunk
  d of the reduced buffer, which is exactly the shard the rank loaded.
* the shard offsets: replica d's shard is replica 0's moved by d times the
  shard width along that dim, which the block check subtracts before
  comparing inputs (as it does a block's first row).

The cut of the representatives (verdict/symmetry.py) replaces each gather
by its value, the whole parameter loaded, and drops each keep: the cut is a
plain data-parallel plan. docs/soundness.md, "ZeRO-1: owned shards", holds
the argument; anything these rules do not describe raises
:class:`OwnedError` and the plan is verified in full.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verdict.fold import ORBIT_SUMS
from verdict.plan import UNIT


class OwnedError(Exception):
    """Why the owned shards of a plan are not ones the symmetry covers."""


@dataclass(frozen=True)
class Owned:
    """What the block check and the cut need: the gathers and keeps (node
    masks), the gathers' outputs (a tensor mask) and, for each loaded shard,
    the dim and offset the block check subtracts from its slices."""

    gathers: np.ndarray
    keeps: np.ndarray
    gathered: np.ndarray
    shifts: dict[int, tuple[int, int]]

    @property
    def nodes(self) -> np.ndarray:
        """The nodes whose ``index`` is their replica (compared without it)."""
        return self.gathers | self.keeps

    @staticmethod
    def none(nodes: int, tensors: int) -> Owned:
        return Owned(np.zeros(nodes, dtype=bool), np.zeros(nodes, dtype=bool),
                     np.zeros(tensors, dtype=bool), {})


def find_owned(check) -> Owned:
    """The owned shards of the plan ``check`` (a verdict.blocks.BlockCheck)
    reads, every gather and keep checked; Owned.none for a plan without
    ZeRO. Raises OwnedError when a rule does not hold."""
    cols, p = check.cols, check.p
    nn, nt = len(cols.n_rank), len(cols.t_rank)
    if not p.world.get("zero", 0):
        return Owned.none(nn, nt)
    if int(p.world["zero"]) != 1:
        return _refuse("ZeRO-2/3 reduce-scatter each microbatch's gradient across replicas "
                       "inside the blocks")
    t_cls, t_d = check.split(cols.t_rank)
    n_cls, n_d = check.split(cols.n_rank)
    kinds = [lg.kind for lg in p.logical]
    slices = p.tensors.slices
    scale = p.tensors.scale
    parts = p.tensors.parts

    def box(t: int) -> list[tuple[int, int]]:
        a, b = int(cols.slice_off[t]), int(cols.slice_off[t + 1])
        return [tuple(x) for x in slices[a:b].tolist()]

    def whole(t: int) -> bool:
        lo, hi, n = (int(x) for x in parts[t])
        return (hi - lo == n) and (scale is None or tuple(int(x) for x in scale[t]) == UNIT)

    def ins(i: int) -> list[int]:
        k = int(cols.n_ins[i])
        return cols.flat[cols.ptr[k]:cols.ptr[k + 1]].tolist()

    def outs(i: int) -> list[int]:
        k = int(cols.n_outs[i])
        return cols.flat[cols.ptr[k]:cols.ptr[k + 1]].tolist()

    dp = check.fold.dp
    op_of = cols.ops
    gathers = np.zeros(nn, dtype=bool)
    keeps = np.zeros(nn, dtype=bool)
    gathered = np.zeros(nt, dtype=bool)
    shifts: dict[int, tuple[int, int]] = {}
    #: (rank, param tid) -> (dim, its shard tensor, the box gathered)
    shard_of: dict[tuple[int, int], tuple[int, int, list]] = {}
    reads = _reads(cols)
    for i in np.flatnonzero(np.array([op == "all_gather" for op in op_of])[cols.n_op]).tolist():
        group = ins(i)
        d = int(n_d[i])
        if all(t >= 0 and int(t_d[t]) == d for t in group):
            continue  # within the replica: compared like any node
        where = f"the all_gather {i} on rank {int(cols.n_rank[i])}"
        if int(cols.n_mb[i]) >= 0:
            _refuse(f"{where} crosses replicas inside a microbatch")
        kw = p.kwargs_of(int(cols.n_kw[i]))
        dim, index = kw.get("dim"), kw.get("index")
        out = outs(i)
        if len(group) != dp or any(t < 0 for t in group) or index != d or len(out) != 1:
            _refuse(f"{where} is not one over the whole orbit of replicas at its own index")
        tid = int(cols.t_tid[group[0]])
        if kinds[tid] != "param" or any(
                int(cols.t_producer[t]) >= 0 or int(cols.t_tid[t]) != tid
                or int(cols.t_lver[t]) != 0 or int(cols.t_mb[t]) != -1
                or int(t_d[t]) != j or int(t_cls[t]) != int(n_cls[i])
                for j, t in enumerate(group)):
            _refuse(f"{where} does not gather the loaded shards of one parameter, replica "
                    f"by replica")
        boxes = [box(t) for t in group]
        if not isinstance(dim, int) or not 0 <= dim < len(boxes[0]):
            _refuse(f"{where} has no dim of its parameter")
        width = boxes[0][dim][1] - boxes[0][dim][0]
        tiles = all(
            b[:dim] == boxes[0][:dim] and b[dim + 1:] == boxes[0][dim + 1:]
            and b[dim] == (boxes[0][dim][0] + j * width, boxes[0][dim][0] + (j + 1) * width)
            for j, b in enumerate(boxes))
        o = out[0]
        full = [*boxes[0][:dim], (boxes[0][dim][0], boxes[-1][dim][1]), *boxes[0][dim + 1:]]
        if not tiles or width <= 0:
            _refuse(f"{where}: the replicas' shards of {p.logical[tid].name} do not tile one "
                    f"box in replica order (a shard owned twice or by nobody)")
        if o < 0 or int(cols.t_tid[o]) != tid or int(cols.t_lver[o]) != 0 or box(o) != full \
                or not whole(o) or int(cols.t_producer[o]) != i:
            _refuse(f"{where}: its output does not claim the whole box its shards tile")
        own = group[d]
        if reads[own] != dp:
            _refuse(f"{where}: the shard of replica {d} is read by other nodes than the "
                    f"orbit's gathers (an optimizer step on owned shards is not covered)")
        key = (int(cols.n_rank[i]), tid)
        if key in shard_of:
            _refuse(f"{where}: a second gather of {p.logical[tid].name} on the rank")
        shard_of[key] = (dim, own, full)
        gathers[i] = True
        gathered[o] = True
        for j, t in enumerate(group):
            if shifts.setdefault(t, (dim, j * width)) != (dim, j * width):
                _refuse(f"{where}: a shard gathered along two dims")
    _check_loaded(cols, kinds, shard_of)
    _find_keeps(check, p, shard_of, ins, outs, box, whole, keeps, n_d)
    return Owned(gathers, keeps, gathered, shifts)


def _reads(cols) -> np.ndarray:
    """How many nodes read each tensor."""
    out = np.zeros(len(cols.t_rank), dtype=np.int64)
    lengths = cols.ptr[cols.n_ins + 1] - cols.ptr[cols.n_ins]
    starts = np.repeat(cols.ptr[cols.n_ins] - np.concatenate(([0], np.cumsum(lengths)[:-1])),
                       lengths)
    read = cols.flat[starts + np.arange(int(lengths.sum()))]
    np.add.at(out, read[read >= 0], 1)
    return out


def _last_writers(cols, buf_of: dict[int, int]) -> dict[tuple[int, int], int]:
    """(rank, parameter) -> the last node (in plan order) writing one of its
    gradient buffers."""
    lengths = cols.ptr[cols.n_outs + 1] - cols.ptr[cols.n_outs]
    starts = np.repeat(cols.ptr[cols.n_outs] - np.concatenate(([0], np.cumsum(lengths)[:-1])),
                       lengths)
    t = cols.flat[starts + np.arange(int(lengths.sum()))].astype(np.int64)
    writer = np.repeat(np.arange(len(cols.n_rank)), lengths)
    bufs = np.array(sorted(buf_of), dtype=np.int64)
    keep = (t >= 0) & np.isin(cols.t_tid[np.maximum(t, 0)], bufs)
    t, writer = t[keep], writer[keep]
    last: dict[tuple[int, int], int] = {}
    for rank, tid, i in zip(cols.t_rank[t].tolist(), cols.t_tid[t].tolist(), writer.tolist()):
        if last.get((rank, buf_of[tid]), -1) < i:
            last[(rank, buf_of[tid])] = i
    return last


def _check_loaded(cols, kinds: list[str], shard_of: dict) -> None:
    """A rank that gathers a parameter loads of it only its own shard."""
    loaded = np.flatnonzero((cols.t_producer < 0) & (cols.t_lver == 0) & np.array(
        [k == "param" for k in kinds] or [False])[cols.t_tid])
    for t in loaded.tolist():
        key = (int(cols.t_rank[t]), int(cols.t_tid[t]))
        if key in shard_of and shard_of[key][1] != t:
            _refuse(f"rank {key[0]} loads a second piece of a parameter it gathers")


def _find_keeps(check, p, shard_of: dict, ins, outs, box, whole, keeps: np.ndarray,
                n_d: np.ndarray) -> None:
    """For every rank and gathered parameter, the node writing its last
    gradient buffer is a keep of the rank's own chunk of a reducer's sum."""
    cols, dp = check.cols, check.fold.dp
    last = _last_writers(cols, {int(b): int(q) for q, b in p.grads.items()})
    sums = set(ORBIT_SUMS)
    for key, (dim, shard, full) in shard_of.items():
        i = last.get(key, -1)
        where = f"rank {key[0]}'s last gradient buffer of {p.logical[key[1]].name}"
        if i < 0 or cols.ops[int(cols.n_op[i])] != "split" or int(cols.n_mb[i]) != -1:
            _refuse(f"{where} is not a split of the reduced gradient")
        src = ins(i)
        made = int(cols.t_producer[src[0]]) if len(src) == 1 and src[0] >= 0 else -1
        if made < 0 or cols.ops[int(cols.n_op[made])] not in sums or \
                int(cols.n_rank[made]) != key[0]:
            _refuse(f"{where} is not a split of a sum over the replicas")
        kw = p.kwargs_of(int(cols.n_kw[i]))
        d = int(n_d[i])
        o = outs(i)[0]
        if (kw.get("dim"), kw.get("parts"), kw.get("index")) != (dim, dp, d) or \
                box(o) != box(shard) or box(src[0]) != full or not whole(o) or \
                int(cols.t_lver[o]) != int(cols.t_lver[src[0]]) or not whole(src[0]):
            _refuse(f"{where} does not keep chunk {d} of {dp} of the whole reduced gradient "
                    f"along dim {dim}, the shard the rank loads")
        keeps[i] = True
    reads = _reads(cols)
    for i in np.flatnonzero(keeps).tolist():
        if any(reads[o] for o in outs(i) if o >= 0):
            _refuse("a kept gradient chunk is read (an optimizer step on owned shards is not "
                    "covered)")


def _refuse(why: str):
    raise OwnedError(why)
