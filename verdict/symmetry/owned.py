"""ZeRO owned shards in a materialized plan, found and checked on the whole plan.

With ZeRO-1 each replica loads another shard of a parameter (the one it
owns), all-gathers the whole parameter from the orbit's shards before its
microbatches, reduces whole gradients as plain data parallelism does,
keeps the chunk of the reduced gradient it owns (a local ``split``) and,
with an optimizer, updates its shard and all-gathers the updated shards.
The block check (verdict/symmetry/blocks.py) compares replicas up to these
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

ZeRO-2 and ZeRO-3 reduce-scatter each microbatch's gradient instead of
reducing whole ones, and ZeRO-3 gathers the parameter per use inside the
microbatches; ``find_scatters`` and ``chains`` (verdict/symmetry/owned_grads.py) check
(6) such gathers as rule 1's, (7) every scatter: over the whole orbit at its
own index, one row of block values per buffer shared by every replica, its
own value the block's at the whole box, its output the rank's shard read by
one accumulation only, and (8) the chain of those accumulations from zeros
ending in what the rank ends with. The cut replaces each scatter by its own
value, widens the chain to the box and sums the shown chain ends with a
reducer: the ZeRO-1 shape (docs/soundness.md, "ZeRO-2 and ZeRO-3:
reduce-scattered shards"). With expert parallelism a shared parameter's
gathers and scatters run in two levels, the ep ranks of a replica and the
orbit (docs/soundness.md, "ZeRO-1 with expert parallelism" and "ZeRO-2 and
ZeRO-3 with expert parallelism").

The cut of the representatives (verdict/symmetry/cut.py) replaces each gather
by its value, the whole parameter loaded, drops keeps and updates, and
runs each optimizer step on the whole box (the gathered parameter, the
reduced gradient, its state widened to the box): the cut is a plain
data-parallel plan. docs/soundness.md, "ZeRO-1: owned shards", holds the
argument; anything these rules do not describe raises ``OwnedError``
(verdict/symmetry/shards.py) and the plan is verified in full. The gathers
are found here; what becomes of their gradients and shards (rules 3, 4, 7
and 8) in verdict/symmetry/owned_grads.py.
"""

from __future__ import annotations

import numpy as np

from verdict.columns import Columns
from verdict.layout import Layout
from verdict.plan import UNIT
from verdict.symmetry.arrays import Arrays
from verdict.symmetry.owned_grads import ShardGradients
from verdict.symmetry.shards import (
    Owned,
    check_loaded,
    inputs_of,
    read_counts,
    refuse,
)

#: Group entries (gathers x replicas) the scan holds at a time.
_ENTRIES = 1 << 19


def find_owned(plan: Columns, cols: Arrays, dp: int, mesh: Layout) -> Owned:
    """The owned shards of ``plan`` (read through the block check's arrays
    ``cols``, with ``dp`` replicas on ``mesh``), every gather, keep and
    optimizer step on them checked; Owned.none for a plan without ZeRO.
    Raises OwnedError when a rule does not hold."""
    if not plan.world.get("zero", 0):
        return Owned.none(len(cols.n_rank), len(cols.t_rank))
    if plan.world["zero"] not in (1, 2, 3):
        return refuse(f"ZeRO stage {plan.world['zero']!r} is none the owned shards cover")
    return _Scan(plan, cols, dp, mesh).run()


class _Scan(ShardGradients):
    """One pass over the plan's collectives, splits and optimizer steps."""

    def __init__(self, plan: Columns, cols: Arrays, dp: int, mesh: Layout):
        self.cols, self.p, self.dp = cols, plan, dp
        self.zero = int(self.p.world["zero"])
        self.ep = int(self.p.world.get("ep", 1))
        #: ranks between two ep ranks of one replica (the mesh's cp x tp)
        self.ep_stride = int(self.p.world.get("cp", 1)) * int(self.p.world.get("tp", 1))
        cols = self.cols
        nn, nt = len(cols.n_rank), len(cols.t_rank)
        self.t_cls, self.t_d = mesh.split_array(cols.t_rank)
        self.n_cls, self.n_d = mesh.split_array(cols.n_rank)
        self.kinds = [lg.kind for lg in self.p.logical]
        self.reads = read_counts(cols)
        self.gathers = np.zeros(nn, dtype=bool)
        self.keeps = np.zeros(nn, dtype=bool)
        self.updates = np.zeros(nn, dtype=bool)
        self.gathered = np.zeros(nt, dtype=bool)
        self.scatters = np.zeros(nn, dtype=bool)
        self.inner = np.zeros(nn, dtype=bool)
        self.inner_made = np.zeros(nt, dtype=bool)  # the in-block gathers' outputs
        #: (rank, param tid) -> (parts, index) of its keep when its shards are
        #: gathered in two levels (else (D, replica))
        self.split_of: dict[tuple[int, int], tuple[int, int]] = {}
        self.scattered: dict[int, int] = {}
        self.reduced_ep: set[tuple[int, int]] = set()
        self.reduced: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.shifts: list[tuple[np.ndarray, ...]] = []  # (tensors, dims, offsets)
        self.kw_cache: dict[int, dict] = {}
        self.dim_of: dict[int, int] = {}  # gather node -> its dim
        self.slices = self.p.tensors.slices.view(np.ndarray)
        self.parts = self.p.tensors.parts.view(np.ndarray)
        scale = self.p.tensors.scale
        self.scale = None if scale is None else scale.view(np.ndarray)
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
        return [tuple(x) for x in self.slices[a:b].tolist()]

    def whole(self, t: int) -> bool:
        lo, hi, n = self.parts[t].tolist()
        return hi - lo == n and (self.scale is None or tuple(self.scale[t].tolist()) == UNIT)

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
        crossing = self.crossing()
        if self.ep > 1:
            self.find_inner(crossing)
        step = max(1, _ENTRIES // self.dp)  # gathers whose groups are read at a time
        updates = []
        for lo in range(0, len(crossing), step):
            nodes = crossing[lo:lo + step]
            groups = self.groups(nodes)
            loaded = self.is_loaded(groups).all(axis=1) | \
                self.inner_made[np.maximum(groups, 0)].all(axis=1)
            self.gather(nodes[loaded], groups[loaded])
            updates.append(nodes[~loaded])
        self.check_inner_read()
        if self.shard_of:
            check_loaded(self.cols, self.kinds, self.shard_of)
            if self.zero >= 2:
                self.find_scatters()
            else:
                self.find_keeps()
            self.find_steps()
        for nodes in updates:
            for lo in range(0, len(nodes), step):
                self.update(nodes[lo:lo + step], self.groups(nodes[lo:lo + step]))
        gathered_by = np.zeros(len(self.cols.t_rank), dtype=np.int64)
        for nodes in updates:
            read, _ = inputs_of(self.cols, nodes)
            np.add.at(gathered_by, read, 1)
        out = np.array(list(self.updated.values()), dtype=np.int64)
        if (self.reads[out] != gathered_by[out]).any():
            refuse("an updated shard is read by another node than the gathers of updated "
                   "shards")
        t, dim, off = (np.concatenate([np.zeros(0, dtype=np.int64),
                                       *(np.asarray(x[k], dtype=np.int64) for x in self.shifts)])
                       for k in range(3))
        order = np.argsort(t, kind="stable")
        t, dim, off = t[order], dim[order], off[order]
        same = t[1:] == t[:-1]
        if ((dim[1:] != dim[:-1]) | (off[1:] != off[:-1]))[same].any():
            refuse("a shard is gathered at two offsets")
        first = np.concatenate((np.ones(min(1, len(t)), dtype=bool), ~same))  # none: no shifts
        return Owned(self.gathers, self.keeps, self.updates, self.gathered,
                     (t[first], dim[first], off[first]), self.rewire, self.widen,
                     self.scatters, self.scattered, self.reduced, self.inner,
                     frozenset(self.reduced_ep))

    def is_loaded(self, t: np.ndarray) -> np.ndarray:
        c, s = self.cols, np.maximum(t, 0)
        return (t >= 0) & (c.t_producer[s] < 0) & (c.t_lver[s] == 0) & (c.t_mb[s] == -1)

    def crossing(self, op: str = "all_gather") -> np.ndarray:
        """The nodes of ``op`` that read another replica's tensor; all_gathers
        outside microbatches (ZeRO-3: also inside, per use), else refused."""
        cols = self.cols
        ag = np.flatnonzero(np.array([o == op for o in cols.ops] or [False])[cols.n_op])
        if not ag.size:
            return ag
        read, reader = inputs_of(cols, ag)
        other = (read < 0) | (self.t_d[np.maximum(read, 0)] != self.n_d[reader])
        hit = np.zeros(len(cols.n_rank), dtype=bool)
        hit[reader[other]] = True
        out = ag[hit[ag]]
        if op != "all_gather":
            return out
        inside = out[cols.n_mb[out] >= 0]
        if inside.size and self.zero < 3:
            refuse(f"the all_gather {int(inside[0])} on rank {int(cols.n_rank[inside[0]])} "
                   f"crosses replicas inside a microbatch")
        return out

    def groups(self, nodes: np.ndarray) -> np.ndarray:
        """The inputs of gathers over the whole orbit at their own index, one
        row each (replica j in column j; else refused)."""
        cols, dp = self.cols, self.dp
        lengths = cols.ptr[cols.n_ins[nodes] + 1] - cols.ptr[cols.n_ins[nodes]]
        outs = cols.ptr[cols.n_outs[nodes] + 1] - cols.ptr[cols.n_outs[nodes]]
        index = np.array([self.kw(int(k)).get("index", -1) for k in cols.n_kw[nodes].tolist()])
        bad = (lengths != dp) | (outs != 1) | (index != self.n_d[nodes])
        m = cols.flat[cols.ptr[cols.n_ins[nodes]][:, None] + np.arange(dp)[None, :]
                      * ~bad[:, None]].astype(np.int64)
        safe = np.maximum(m, 0)
        bad |= ((m < 0) | (self.t_d[safe] != np.arange(dp)[None, :])
                | (self.t_cls[safe] != self.n_cls[nodes][:, None])).any(axis=1)
        if bad.any():
            i = int(nodes[np.argmax(bad)])
            refuse(f"the all_gather {i} on rank {int(cols.n_rank[i])} is not one over the whole "
                   f"orbit of replicas at its own index")
        return m

    def kw(self, code: int) -> dict:
        if code not in self.kw_cache:
            self.kw_cache[code] = self.p.kwargs_of(code)
        return self.kw_cache[code]

    def gather(self, nodes: np.ndarray, m: np.ndarray) -> None:
        """Rule 1: the loaded shards of one parameter gathered, tiling one box
        in replica order; their output claims it, whole."""
        cols = self.cols
        tid = cols.t_tid[m[:, 0]].astype(np.int64)
        param = np.array([k == "param" for k in self.kinds])[tid]
        bad = ~param | (cols.t_tid[m] != tid[:, None]).any(axis=1)
        if bad.any():
            i = int(nodes[np.argmax(bad)])
            refuse(f"the all_gather {i} on rank {int(cols.n_rank[i])} does not gather the "
                   f"loaded shards of one parameter, replica by replica")
        out = cols.flat[cols.ptr[cols.n_outs[nodes]]].astype(np.int64)
        dims = np.array([self.kw(int(k)).get("dim") for k in cols.n_kw[nodes].tolist()],
                        dtype=object)
        width, full = self.tiling(nodes, m, dims)
        for i, t, o, w, box, row in zip(nodes.tolist(), tid.tolist(), out.tolist(),
                                        width.tolist(), full, m):
            d = int(self.n_d[i])
            where = f"the all_gather {i} on rank {int(cols.n_rank[i])}"
            if o < 0 or int(cols.t_tid[o]) != t or int(cols.t_lver[o]) != 0 or \
                    self.box(o) != box or not self.whole(o):
                refuse(f"{where}: its output does not claim the whole box its shards tile")
            key = (int(cols.n_rank[i]), t)
            found = (self.dim_of[i], w, self.own_shard(i, int(row[d]), key), box, o)
            if key in self.shard_of and (self.zero < 3 or self.shard_of[key][:4] != found[:4]):
                refuse(f"{where}: a second gather of {self.p.logical[t].name} on the rank")
            self.shard_of.setdefault(key, found)
        self.gathers[nodes] = True
        self.gathered[out] = True
        d = self.n_d[nodes].astype(np.int64)  # each gather's own shard (every rank gathers)
        own = m[np.arange(len(nodes)), d]
        one = ~self.inner_made[own]  # two levels: the in-block gathers' inputs are shifted
        self.shifts.append((own[one], [self.dim_of[i] for i in nodes[one].tolist()],
                            (d * width)[one]))

    def own_shard(self, i: int, own: int, key: tuple[int, int]) -> int:
        """The shard the rank of gather ``i`` loads: its own member ``own``,
        or, gathered in two levels, the in-block gather's input at the rank's
        ep position, the in-block gather along the same dim (its keep is then
        chunk ``d ep + e`` of ``D ep``, recorded in ``split_of``)."""
        if not self.inner_made[own]:
            return own
        k = int(self.cols.t_producer[own])
        e = self.ep_index(int(self.cols.n_rank[i]))
        if self.dim_of[k] != self.dim_of[i]:
            refuse(f"the all_gather {i} on rank {int(self.cols.n_rank[i])} gathers along "
                   f"another dim than the in-block gather {k} it reads")
        self.split_of[key] = (self.dp * self.ep, int(self.n_d[i]) * self.ep + e)
        return self.ins(k)[e]

    def ep_index(self, rank: int) -> int:
        """The rank's expert-parallel index e (data-parallel index d ep + e)."""
        return rank // self.ep_stride % self.ep

    def find_inner(self, crossing: np.ndarray) -> None:
        """Expert parallelism: the gathers outside microbatches that read no
        other replica's tensor but whose outputs an orbit's gather reads.
        Each must read, in position j, the loaded shard of one parameter on
        the ep rank j of its own replica and class (its rank moved by
        (j - e) cp tp), j = 0..ep-1, tiling one box along its ``dim`` with
        equal widths, its ``index`` its own e, its output claiming the box,
        whole, version 0: the parameter at that box, the replica's piece of
        the orbit's gather (docs/soundness.md, "ZeRO-1 with expert
        parallelism"). Each replica's loaded shards are shifted by d times
        the box's width, as rule 2 shifts a replica's shard."""
        cols, ep = self.cols, self.ep
        read, _ = inputs_of(cols, crossing)
        made = cols.t_producer[read[read >= 0]]
        made = np.unique(made[made >= 0])
        if not made.size:
            return
        is_ag = np.array([o == "all_gather" for o in cols.ops] or [False])[cols.n_op[made]]
        nodes = made[is_ag & ~np.isin(made, crossing)]
        if not nodes.size:
            return
        lengths = cols.ptr[cols.n_ins[nodes] + 1] - cols.ptr[cols.n_ins[nodes]]
        outs = cols.ptr[cols.n_outs[nodes] + 1] - cols.ptr[cols.n_outs[nodes]]
        ranks = cols.n_rank[nodes].astype(np.int64)
        e = ranks // self.ep_stride % ep
        index = np.array([self.kw(int(k)).get("index", -1) for k in cols.n_kw[nodes].tolist()])
        # ZeRO-3 gathers per use: in the microbatch of the orbit's gather it feeds
        mb = cols.n_mb[nodes]
        bad = (lengths != ep) | (outs != 1) | (index != e) | ((mb != -1) & (self.zero < 3))
        m = cols.flat[cols.ptr[cols.n_ins[nodes]][:, None] + np.arange(ep)[None, :]
                      * ~bad[:, None]].astype(np.int64)
        safe = np.maximum(m, 0)
        want = ranks[:, None] + (np.arange(ep)[None, :] - e[:, None]) * self.ep_stride
        tid = cols.t_tid[safe[:, 0]].astype(np.int64)
        param = np.array([k == "param" for k in self.kinds])[tid]
        bad |= (m < 0).any(axis=1) | ~self.is_loaded(m).all(axis=1) | ~param | \
            (cols.t_rank[safe] != want).any(axis=1) | (cols.t_tid[safe] != tid[:, None]).any(axis=1)
        if bad.any():
            i = int(nodes[np.argmax(bad)])
            refuse(f"the all_gather {i} on rank {int(cols.n_rank[i])} is not one of the loaded "
                   f"shards of one parameter over the ep ranks of its replica at its own index")
        dims = np.array([self.kw(int(k)).get("dim") for k in cols.n_kw[nodes].tolist()],
                        dtype=object)
        width, full = self.tiling(nodes, m, dims, ep)
        out = cols.flat[cols.ptr[cols.n_outs[nodes]]].astype(np.int64)
        for i, t, o, box, at in zip(nodes.tolist(), tid.tolist(), out.tolist(), full,
                                    mb.tolist()):
            if o < 0 or int(cols.t_tid[o]) != t or int(cols.t_lver[o]) != 0 or \
                    int(cols.t_mb[o]) != at or self.box(o) != box or not self.whole(o):
                refuse(f"the all_gather {i} on rank {int(cols.n_rank[i])}: its output does "
                       f"not claim the whole box its shards tile")
        self.inner[nodes] = True
        self.inner_made[out] = True
        d = self.n_d[nodes].astype(np.int64)
        self.shifts.append((m.reshape(-1), np.repeat([self.dim_of[i] for i in nodes.tolist()], ep),
                            np.repeat(d * width * ep, ep)))

    def check_inner_read(self) -> None:
        """The in-block gathers' outputs are read by the orbit's gathers only,
        each by one of them at least, in its own microbatch (ZeRO-3 per use)."""
        made = np.flatnonzero(self.inner_made)
        if not made.size:
            return
        read, reader = inputs_of(self.cols, np.flatnonzero(self.gathers))
        keep = read >= 0
        read, reader = read[keep], reader[keep]
        same = self.cols.n_mb[reader] == self.cols.t_mb[read]
        by_gathers = np.zeros(len(self.cols.t_rank), dtype=np.int64)
        np.add.at(by_gathers, read[same], 1)
        bad = (by_gathers[made] == 0) | (by_gathers[made] != self.reads[made])
        if bad.any():
            t = int(made[np.argmax(bad)])
            refuse(f"the in-block gather of {self.p.logical[int(self.cols.t_tid[t])].name} on "
                   f"rank {int(self.cols.t_rank[t])} is read by another node than the orbit's "
                   f"gathers")

    def tiling(self, nodes: np.ndarray, m: np.ndarray, dims: np.ndarray, size: int = 0
               ) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
        """Per gather, (shard width, the box) of shards that tile one box
        along its ``dim`` in group order with equal widths (else refused);
        groups of ``size`` members (default: the orbit's D)."""
        cols, dp = self.cols, size or self.dp
        width = np.zeros(len(nodes), dtype=np.int64)
        full: list = [None] * len(nodes)
        ndim = (cols.slice_off[m[:, 0] + 1] - cols.slice_off[m[:, 0]]).astype(np.int64)
        slices = self.slices
        for k in np.unique(ndim).tolist():
            rows = np.flatnonzero(ndim == k)
            dim = np.array([d if isinstance(d, int) and not isinstance(d, bool) and 0 <= d < k
                            else -1 for d in dims[rows]], dtype=np.int64)
            sub = m[rows]
            same_ndim = (cols.slice_off[sub + 1] - cols.slice_off[sub]) == k
            box = slices[cols.slice_off[sub][..., None] * same_ndim[..., None]
                         + np.arange(k)].astype(np.int64)  # (rows, dp, k, 2)
            at = np.arange(k)[None, :] == dim[:, None]  # (rows, k)
            lo = box[:, 0, :, 0]
            w = box[:, 0, :, 1] - lo
            j = np.arange(dp)[None, :, None]
            want_lo = np.where(at[:, None, :], lo[:, None, :] + j * w[:, None, :],
                               lo[:, None, :])
            want_hi = np.where(at[:, None, :], want_lo + w[:, None, :], box[:, 0, None, :, 1])
            ok = (dim >= 0) & same_ndim.all(axis=1) & (box[..., 0] == want_lo).all(axis=(1, 2)) \
                & (box[..., 1] == want_hi).all(axis=(1, 2)) & (np.where(at, w, 1) > 0).all(axis=1)
            if not ok.all():
                i = int(nodes[rows[np.argmin(ok)]])
                refuse(f"the all_gather {i} on rank {int(cols.n_rank[i])}: the replicas' "
                       f"shards of {self.p.logical[int(cols.t_tid[m[rows[np.argmin(ok)], 0]])].name}"
                       f" do not tile one box in replica order (a shard owned twice or by "
                       f"nobody)")
            width[rows] = np.where(at, w, 0).sum(axis=1)
            hi = np.where(at, lo + dp * w, box[:, 0, :, 1])
            for r, a, b, d, i in zip(rows.tolist(), lo.tolist(), hi.tolist(), dim.tolist(),
                                     nodes[rows].tolist()):
                full[r] = [tuple(x) for x in zip(a, b)]
                self.dim_of[i] = d
        return width, full

    def update(self, nodes: np.ndarray, m: np.ndarray) -> None:
        """Rule 5: gathers of the orbit's updated shards of one parameter
        (replica j's step output in column j), read by nothing."""
        cols = self.cols
        for i, row in zip(nodes.tolist(), m.tolist()):
            cls, tid = int(self.n_cls[i]), int(cols.t_tid[row[0]])
            where = f"the all_gather {i} on rank {int(cols.n_rank[i])}"
            o = int(cols.flat[cols.ptr[cols.n_outs[i]]])
            key = (int(cols.n_rank[i]), tid)
            if int(cols.n_mb[i]) >= 0 or \
                    any(self.updated.get((cls, j, tid)) != t for j, t in enumerate(row)) or \
                    key not in self.shard_of or \
                    self.kw(int(cols.n_kw[i])).get("dim") != self.shard_of[key][0]:
                refuse(f"{where} gathers neither loaded shards nor the orbit's updated shards "
                       f"of one parameter")
            # the updated shards have their owners' boxes (rule 4), which tile (rule 1)
            if o < 0 or int(cols.t_tid[o]) != tid or \
                    int(cols.t_lver[o]) != int(cols.t_lver[row[0]]) or \
                    self.box(o) != self.shard_of[key][3] or not self.whole(o) or int(self.reads[o]):
                refuse(f"{where}: its output does not claim the whole updated box, or is read")
        self.updates[nodes] = True
