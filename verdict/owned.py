"""ZeRO-1 owned shards in a materialized plan, found and checked on the whole plan.

With ZeRO-1 each replica loads another shard of a parameter (the one it
owns), all-gathers the whole parameter from the orbit's shards before its
microbatches, reduces whole gradients as plain data parallelism does,
keeps the chunk of the reduced gradient it owns (a local ``split``) and,
with an optimizer, updates its shard and all-gathers the updated shards.
The block check (verdict/blocks.py) compares replicas up to these
differences, which :func:`find_owned` checks here instead, for every node
of the plan:

1. a *gather*: an ``all_gather`` outside microbatches whose inputs are the
   loaded shards of one parameter on the replicas 0..D-1 of the node's rank
   class, in that order, tiling one box along its ``dim`` with equal
   widths, its ``index`` its own replica, its output claiming the box,
   whole: its value is the loaded parameter at the box.
2. the shard offsets: replica d's shard is replica 0's moved by d times
   the shard width, which the block check subtracts before comparing.
3. a *keep*: the ``split`` writing a rank's last gradient buffer of such a
   parameter, chunk d of D of a reducer's whole sum, claiming the rank's
   shard.
4. at most one optimizer step (elementwise) reads the shard, the kept
   chunk and loaded state shards of the same box, writing updated shards
   of that box; nothing else reads the shard or the kept chunk.
5. an *update*: an ``all_gather`` of the orbit's updated shards, read by
   nothing.

The cut of the representatives (verdict/symmetry.py) replaces each gather
by its value, the whole parameter loaded, drops keeps and updates, and
runs each optimizer step on the whole box (the gathered parameter, the
reduced gradient, its state widened to the box): the cut is a plain
data-parallel plan. docs/soundness.md, "ZeRO-1: owned shards", holds the
argument; anything these rules do not describe raises :class:`OwnedError`
and the plan is verified in full.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verdict.fold import ORBIT_SUMS
from verdict.ops.step import OPTIMIZERS
from verdict.plan import UNIT


class OwnedError(Exception):
    """Why the owned shards of a plan are not ones the symmetry covers."""


@dataclass(frozen=True)
class Owned:
    """What the block check and the cut need: the gathers, keeps and
    gathers of updated shards (node masks), the gathers' outputs (a tensor
    mask), for each loaded shard the dim and offset the block check
    subtracts from its slices, and, for an optimizer step on owned shards,
    the inputs the cut gives it (node -> position -> tensor) and the boxes
    its shards widen to (tensor -> slices)."""

    gathers: np.ndarray
    keeps: np.ndarray
    updates: np.ndarray
    gathered: np.ndarray
    shifts: dict[int, tuple[int, int]]
    rewire: dict[int, dict[int, int]]
    widen: dict[int, list[tuple[int, int]]]

    @property
    def nodes(self) -> np.ndarray:
        """The nodes whose ``index`` is their replica (compared without it),
        which the cut drops."""
        return self.gathers | self.keeps | self.updates

    @staticmethod
    def none(nodes: int, tensors: int) -> Owned:
        return Owned(np.zeros(nodes, dtype=bool), np.zeros(nodes, dtype=bool),
                     np.zeros(nodes, dtype=bool), np.zeros(tensors, dtype=bool), {}, {}, {})


def find_owned(check) -> Owned:
    """The owned shards of the plan ``check`` (a verdict.blocks.BlockCheck)
    reads, every gather, keep and optimizer step on them checked;
    Owned.none for a plan without ZeRO. Raises OwnedError when a rule does
    not hold."""
    p = check.p
    if not p.world.get("zero", 0):
        return Owned.none(len(check.cols.n_rank), len(check.cols.t_rank))
    if int(p.world["zero"]) != 1:
        return _refuse("ZeRO-2/3 reduce-scatter each microbatch's gradient across replicas "
                       "inside the blocks")
    return _Scan(check).run()


class _Scan:
    """One pass over the plan's collectives, splits and optimizer steps."""

    def __init__(self, check):
        self.cols, self.p, self.dp = check.cols, check.p, check.fold.dp
        cols = self.cols
        nn, nt = len(cols.n_rank), len(cols.t_rank)
        self.t_cls, self.t_d = check.split(cols.t_rank)
        self.n_cls, self.n_d = check.split(cols.n_rank)
        self.kinds = [lg.kind for lg in self.p.logical]
        self.reads = _reads(cols)
        self.gathers = np.zeros(nn, dtype=bool)
        self.keeps = np.zeros(nn, dtype=bool)
        self.updates = np.zeros(nn, dtype=bool)
        self.gathered = np.zeros(nt, dtype=bool)
        self.shifts: dict[int, tuple[int, int]] = {}
        self.rewire: dict[int, dict[int, int]] = {}
        self.widen: dict[int, list[tuple[int, int]]] = {}
        #: (rank, param tid) -> (dim, shard width, its shard, the box gathered, the gather's output)
        self.shard_of: dict[tuple[int, int], tuple[int, int, int, list, int]] = {}
        #: (rank, param tid) -> the keep's output, the reduced buffer it splits
        self.kept: dict[tuple[int, int], tuple[int, int]] = {}
        #: (class, replica, param tid) -> the updated shard an optimizer step writes
        self.updated: dict[tuple[int, int, int], int] = {}

    # -- the plan's entries ------------------------------------------------------
    def box(self, t: int) -> list[tuple[int, int]]:
        a, b = int(self.cols.slice_off[t]), int(self.cols.slice_off[t + 1])
        return [tuple(x) for x in self.p.tensors.slices[a:b].tolist()]

    def whole(self, t: int) -> bool:
        lo, hi, n = (int(x) for x in self.p.tensors.parts[t])
        scale = self.p.tensors.scale
        return hi - lo == n and (scale is None or tuple(int(x) for x in scale[t]) == UNIT)

    def ins(self, i: int) -> list[int]:
        k = int(self.cols.n_ins[i])
        return self.cols.flat[self.cols.ptr[k]:self.cols.ptr[k + 1]].tolist()

    def outs(self, i: int) -> list[int]:
        k = int(self.cols.n_outs[i])
        return self.cols.flat[self.cols.ptr[k]:self.cols.ptr[k + 1]].tolist()

    def op(self, i: int) -> str:
        return self.cols.ops[int(self.cols.n_op[i])]

    def loaded(self, t: int) -> bool:
        c = self.cols
        return t >= 0 and int(c.t_producer[t]) < 0 and int(c.t_lver[t]) == 0 and \
            int(c.t_mb[t]) == -1

    # -- the rules ---------------------------------------------------------------
    def run(self) -> Owned:
        cols = self.cols
        crossing = []
        for i in np.flatnonzero(np.array([op == "all_gather" for op in cols.ops])[cols.n_op]
                                ).tolist():
            group = self.ins(i)
            if all(t >= 0 and int(self.t_d[t]) == int(self.n_d[i]) for t in group):
                continue  # within the replica: compared like any node
            if int(cols.n_mb[i]) >= 0:
                _refuse(f"the all_gather {i} on rank {int(cols.n_rank[i])} crosses replicas "
                        f"inside a microbatch")
            crossing.append(i)
        later = [i for i in crossing if not all(self.loaded(t) for t in self.ins(i))]
        for i in crossing:
            if i not in later:
                self.gather(i)
        _check_loaded(cols, self.kinds, self.shard_of)
        self.find_keeps()
        self.find_steps()
        for i in later:
            self.update(i)
        return Owned(self.gathers, self.keeps, self.updates, self.gathered, self.shifts,
                     self.rewire, self.widen)

    def orbit_of(self, i: int) -> tuple[str, int, list[int], int, int]:
        """(where, its dim, its group, its output, its replica) of a gather
        over the whole orbit at its own index (else refused)."""
        where = f"the all_gather {i} on rank {int(self.cols.n_rank[i])}"
        kw = self.p.kwargs_of(int(self.cols.n_kw[i]))
        group, out, d = self.ins(i), self.outs(i), int(self.n_d[i])
        if len(group) != self.dp or any(t < 0 for t in group) or kw.get("index") != d or \
                len(out) != 1 or out[0] < 0 or any(
                    int(self.t_d[t]) != j or int(self.t_cls[t]) != int(self.n_cls[i])
                    for j, t in enumerate(group)):
            _refuse(f"{where} is not one over the whole orbit of replicas at its own index")
        return where, kw.get("dim"), group, out[0], d

    def tiling(self, where: str, dim, group: list[int], name: str
               ) -> tuple[int, list[tuple[int, int]]]:
        """(shard width, the box) of shards that tile one box along ``dim`` in
        group order with equal widths (else refused)."""
        boxes = [self.box(t) for t in group]
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < len(boxes[0]):
            _refuse(f"{where} has no dim of its parameter")
        lo, width = boxes[0][dim][0], boxes[0][dim][1] - boxes[0][dim][0]
        if width <= 0 or not all(
                b[:dim] == boxes[0][:dim] and b[dim + 1:] == boxes[0][dim + 1:]
                and b[dim] == (lo + j * width, lo + (j + 1) * width) for j, b in enumerate(boxes)):
            _refuse(f"{where}: the replicas' shards of {name} do not tile one box in replica "
                    f"order (a shard owned twice or by nobody)")
        return width, [*boxes[0][:dim], (lo, lo + len(boxes) * width), *boxes[0][dim + 1:]]

    def gather(self, i: int) -> None:
        """Rule 1: the loaded shards of one parameter gathered."""
        cols = self.cols
        where, dim, group, o, d = self.orbit_of(i)
        tid = int(cols.t_tid[group[0]])
        name = self.p.logical[tid].name
        if self.kinds[tid] != "param" or any(int(cols.t_tid[t]) != tid for t in group):
            _refuse(f"{where} does not gather the loaded shards of one parameter, replica by "
                    f"replica")
        width, full = self.tiling(where, dim, group, name)
        if int(cols.t_tid[o]) != tid or int(cols.t_lver[o]) != 0 or self.box(o) != full or \
                not self.whole(o):
            _refuse(f"{where}: its output does not claim the whole box its shards tile")
        key = (int(cols.n_rank[i]), tid)
        if key in self.shard_of:
            _refuse(f"{where}: a second gather of {name} on the rank")
        self.shard_of[key] = (dim, width, group[d], full, o)
        self.gathers[i] = True
        self.gathered[o] = True
        for j, t in enumerate(group):
            if self.shifts.setdefault(t, (dim, j * width)) != (dim, j * width):
                _refuse(f"{where}: a shard gathered along two dims")

    def find_keeps(self) -> None:
        """Rule 3: for every rank and gathered parameter, the node writing its
        last gradient buffer keeps the rank's own chunk of a reducer's sum."""
        cols, dp = self.cols, self.dp
        last = _last_writers(cols, {int(b): int(q) for q, b in self.p.grads.items()})
        for key, (dim, _, shard, full, _) in self.shard_of.items():
            i = last.get(key, -1)
            where = f"rank {key[0]}'s last gradient buffer of {self.p.logical[key[1]].name}"
            if i < 0 or self.op(i) != "split" or int(cols.n_mb[i]) != -1:
                _refuse(f"{where} is not a split of the reduced gradient")
            src = self.ins(i)
            made = int(cols.t_producer[src[0]]) if len(src) == 1 and src[0] >= 0 else -1
            if made < 0 or self.op(made) not in ORBIT_SUMS or int(cols.n_rank[made]) != key[0]:
                _refuse(f"{where} is not a split of a sum over the replicas")
            kw = self.p.kwargs_of(int(cols.n_kw[i]))
            d = int(self.n_d[i])
            o = self.outs(i)[0]
            if (kw.get("dim"), kw.get("parts"), kw.get("index")) != (dim, dp, d) or \
                    self.box(o) != self.box(shard) or self.box(src[0]) != full or \
                    not self.whole(o) or not self.whole(src[0]) or \
                    int(cols.t_lver[o]) != int(cols.t_lver[src[0]]):
                _refuse(f"{where} does not keep chunk {d} of {dp} of the whole reduced "
                        f"gradient along dim {dim}, the shard the rank loads")
            self.keeps[i] = True
            self.kept[key] = (o, src[0])

    def find_steps(self) -> None:
        """Rule 4: the only other reader of a rank's shard is an optimizer
        step on it, reading the kept chunk and loaded state shards of the
        same box, writing updated shards of that box; nothing else reads
        the kept chunk."""
        cols = self.cols
        watched = [shard for _, _, shard, _, _ in self.shard_of.values()] + \
            [o for o, _ in self.kept.values()]
        read, reader = _inputs(cols)
        pick = np.flatnonzero(np.isin(read, watched) & ~self.gathers[reader])
        readers: dict[int, list[int]] = {}
        for t, i in zip(read[pick].tolist(), reader[pick].tolist()):
            readers.setdefault(t, []).append(i)
        for key, (dim, width, shard, full, gathered) in self.shard_of.items():
            o, reduced = self.kept[key]
            steps = readers.get(shard, [])
            where = f"rank {key[0]}'s shard of {self.p.logical[key[1]].name}"
            if not steps:
                if readers.get(o):
                    _refuse(f"{where}: its kept gradient chunk is read by another node than an "
                            f"optimizer step on the shard")
                continue
            i = steps[0]
            ins, outs = self.ins(i), self.outs(i)
            if len(steps) != 1 or readers.get(o) != [i] or self.op(i) not in OPTIMIZERS or \
                    len(ins) < 2 or ins[:2] != [shard, o]:
                _refuse(f"{where} is read by another node than its gathers and one optimizer "
                        f"step on it and its kept gradient chunk")
            states = ins[2:]
            own = self.box(shard)
            if any(not self.loaded(t) or self.kinds[int(cols.t_tid[t])] == "param"
                   or int(self.reads[t]) != 1 or self.box(t) != own or not self.whole(t)
                   for t in states) or \
                    not outs or outs[0] < 0 or int(cols.t_tid[outs[0]]) != key[1] or any(
                        t < 0 or self.box(t) != own or not self.whole(t) for t in outs):
                _refuse(f"{where}: its optimizer step does not read loaded state shards and "
                        f"write updated shards of the same box")
            d = int(self.n_d[i])
            self.rewire[i] = {0: gathered, 1: reduced}
            for t in (*states, *outs):
                self.widen[t] = full
            for t in states:
                self.shifts[t] = (dim, d * width)
            self.updated[(int(self.n_cls[i]), d, key[1])] = outs[0]

    def update(self, i: int) -> None:
        """Rule 5: a gather of the orbit's updated shards of one parameter,
        read by nothing."""
        cols = self.cols
        where, dim, group, o, _ = self.orbit_of(i)
        cls, tid = int(self.n_cls[i]), int(cols.t_tid[group[0]])
        if any(self.updated.get((cls, j, tid)) != t for j, t in enumerate(group)):
            _refuse(f"{where} gathers neither loaded shards nor the orbit's updated shards of "
                    f"one parameter")
        _, full = self.tiling(where, dim, group, self.p.logical[tid].name)
        if int(cols.t_tid[o]) != tid or int(cols.t_lver[o]) != int(cols.t_lver[group[0]]) or \
                self.box(o) != full or not self.whole(o) or int(self.reads[o]):
            _refuse(f"{where}: its output does not claim the whole updated box, or is read")
        self.updates[i] = True


def _inputs(cols) -> tuple[np.ndarray, np.ndarray]:
    """Every (tensor read, node reading it), node by node."""
    lengths = cols.ptr[cols.n_ins + 1] - cols.ptr[cols.n_ins]
    starts = np.repeat(cols.ptr[cols.n_ins] - np.concatenate(([0], np.cumsum(lengths)[:-1])),
                       lengths)
    read = cols.flat[starts + np.arange(int(lengths.sum()))].astype(np.int64)
    return read, np.repeat(np.arange(len(cols.n_rank)), lengths)


def _reads(cols) -> np.ndarray:
    """How many nodes read each tensor."""
    out = np.zeros(len(cols.t_rank), dtype=np.int64)
    read = _inputs(cols)[0]
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
        if key in shard_of and shard_of[key][2] != t:
            _refuse(f"rank {key[0]} loads a second piece of a parameter it gathers")


def _refuse(why: str):
    raise OwnedError(why)
