"""Every block of a materialized plan compared with its representative, on arrays.

The uniformity rules of verdict/symmetry/rules.py ("Folded plans", step 3 in
docs/soundness.md), applied to every replica and microbatch of a plan that
writes them all out, as array operations over the plan's columns
(verdict/columns.py), so that their cost per node is a few array passes,
not a Python function call:

* every block program (class, d, m) equals the one of (class, 0, 0), and
  every step program (class, d) the one of (class, 0) (or those of the
  representatives of d's and m's classes, verdict/symmetry/classes.py), node by
  node: same
  operator, direction and kwargs, and the same tensors up to renaming (the
  tensor's class, own microbatch or outside microbatches, logical id,
  version, local shape; an input's slices relative to its block's first
  row, and its parts);
* (a) a node reads another replica's tensor only as a sum over the whole
  orbit of replicas, with ``index`` its own position; (b) another
  microbatch's tensor only as the running buffer of an accumulation chain,
  zeros first; (c) the blocks of a class start b rows apart and cover the
  batch once; (d)-(f) the glue: only sums of chain ends cross replicas,
  blocks read nothing computed outside microbatches but constants, a
  rank's last gradient buffer is its chain's end or such a sum.

A violation raises ``StructureError('symmetry')`` naming the replica,
microbatch and the first differing node (in execution order) and the
representative's node it differs from.
"""

from __future__ import annotations

import json

import numpy as np

from verdict.columns import Columns, drop_pages, row_ids, trim_heap
from verdict.layout import Layout
from verdict.lineage import StructureError
from verdict.ops import get_op
from verdict.plan import DIRECTIONS, INPUT_KINDS, Plan
from verdict.symmetry.arrays import (
    I32,
    NODE_CHUNK,
    arrays,
    chunks,
    fitting,
    index_array,
    member_mask,
    small_array,
    spans,
)
from verdict.symmetry.fold import Fold, batch_dims
from verdict.symmetry.owned import find_owned
from verdict.symmetry.rules import (
    ACCUMULATE,
    CONSTANTS,
    NOT_A_SUM_OF_ENDS,
    NOT_LAST_BUFFER,
    NOT_OWN_INDEX,
    NOT_RUNNING_BUFFER,
    NOT_WHOLE_ORBIT,
    ORBIT_SUMS,
    READS_OUTSIDE,
    accumulation_chains,
    block_offsets,
    ends_with_chains,
    index_kwarg,
    inner_size,
    last_writes,
    own_index,
    reads_outside,
    sum_of_ends,
    whole_orbit,
)

#: No finding (BlockCheck's per-node codes)
_NONE = np.iinfo(np.int8).max


class BlockCheck:
    """The check; after :meth:`run`, what the representatives' cut needs:
    the mesh, batch dims, rows per block, each block's first row and each
    accumulation chain's end."""

    def __init__(self, single: Plan, parallel: Columns, fold: Fold):
        self.p, self.fold = parallel, fold
        w = parallel.world
        self.cp, self.tp = inner_size(w), int(w.get("tp", 1))  # cp: ep x cp inner ranks
        self.pp = int(w.get("pp", 1))
        self.mesh = Layout(fold.dp, self.cp, self.tp)
        self.batch = batch_dims(single)
        self.rows = fold.real_gbs // (fold.real_dp * fold.real_nm)
        self.offset: dict[tuple, int] = {}
        self.chain_end: dict[tuple[int, int], int] = {}
        self.chain_start: dict[tuple[int, int], int] = {}
        self.found: list[tuple[int, int | None, str]] = []  # (node, representative, why)
        self.cols = arrays(parallel)
        #: the class and replica of every rank of the world, by rank: the passes
        #: look up a chunk's nodes and tensors here instead of keeping a class and
        #: a replica per node and tensor (first_pass checks every rank is one of these)
        self.rank_cls, self.rank_d = (
            small_array(a, self.fold.dp) for a in
            self.split(np.arange(self.pp * self.fold.dp * self.cp * self.tp, dtype=np.int64)))
        #: the replica of every node and tensor, kept once the passes are done
        self.kept_d: tuple[np.ndarray, np.ndarray] | None = None
        #: which ops accumulate into a gradient buffer, by op code
        self.acc_op = np.array([op == ACCUMULATE for op in self.cols.ops] or [False])
        #: the representative replica of each replica's class (verdict/symmetry/classes.py);
        #: None: replica 0 for all
        self.rep_of_d: np.ndarray | None = None
        #: likewise the representative microbatch of each microbatch's class
        self.rep_of_m: np.ndarray | None = None
        nn = len(self.cols.n_rank)
        #: each kind of finding (why, is a rule) -> its code, in the order the check meets them
        self.sites: dict[tuple[str, bool], int] = {}
        #: per node, the code of its first finding, rules and comparisons apart (_NONE: none),
        #: and for a comparison the node it names in the representative's program (made
        #: at the first comparison found: a plan whose blocks agree needs none)
        self.rule_code = np.full(nn, _NONE, dtype=np.int8)
        self.diff_code = np.full(nn, _NONE, dtype=np.int8)
        self.diff_ref: np.ndarray | None = None
        #: the representatives of the last pass (None: no pass yet)
        self.last_reps: tuple[np.ndarray, np.ndarray] | None = None
        #: ZeRO's gathers, keeps, scatters and shard offsets, found and checked on
        #: the whole plan (verdict/symmetry/owned.py; OwnedError when a rule breaks)
        self.owned = find_owned(parallel, self.cols, fold.dp, self.mesh)

    # -- helpers ------------------------------------------------------------------
    @property
    def n_d(self) -> np.ndarray:
        """The replica of every node: made afresh until :meth:`finish`,
        which keeps it for the cut (the passes look up a chunk's)."""
        return self.rank_d[self.cols.n_rank] if self.kept_d is None else self.kept_d[0]

    @property
    def t_d(self) -> np.ndarray:
        """The replica of every tensor, likewise."""
        return self.rank_d[self.cols.t_rank] if self.kept_d is None else self.kept_d[1]

    @property
    def differs(self) -> np.ndarray:
        """The nodes that differ from their representative's (comparisons, not rules)."""
        return self.diff_code != _NONE

    def is_acc(self, nodes: np.ndarray | slice) -> np.ndarray:
        """Whether each of ``nodes`` accumulates a microbatch into a gradient buffer."""
        cols = self.cols
        return self.acc_op[cols.n_op[nodes]] & (cols.n_mb[nodes] >= 0)

    def split(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(class id, replica) of ranks: class = (stage, c, t) as one number."""
        return self.mesh.split_array(ranks)

    def flag(self, mask: np.ndarray, nodes: np.ndarray | None, why: str, reps=None) -> None:
        """Record ``why`` on every node where ``mask`` holds (a comparison,
        naming ``reps``, or a rule when ``reps`` is None), unless the node
        has a finding met earlier. ``nodes`` names the node of each entry
        of ``mask`` (None: entry i is node i)."""
        rule = reps is None
        code = self.sites.setdefault((why, rule), len(self.sites))
        if code >= _NONE:
            raise RuntimeError("too many kinds of findings")
        hit = np.flatnonzero(mask)
        if not hit.size:
            return
        at = hit if nodes is None else nodes[hit]
        codes = self.rule_code if rule else self.diff_code
        first = codes[at] > code
        codes[at[first]] = code
        if not rule:
            if self.diff_ref is None:
                n = len(self.diff_code)
                self.diff_ref = np.zeros(n, dtype=index_array(np.array([n])).dtype)
            self.diff_ref[at[first]] = reps[hit[first]]

    def findings(self) -> list[tuple[int, int | None, str]]:
        """(node, representative's node or None, why): for each kind of
        finding, the first node whose first finding it is."""
        out: list[tuple[int, int | None, str]] = []
        for codes, rule in ((self.rule_code, True), (self.diff_code, False)):
            if not (codes != _NONE).any():
                continue
            for (why, is_rule), code in self.sites.items():
                hit = np.flatnonzero(codes == code) if is_rule == rule else ()
                if len(hit):
                    i = int(hit[0])
                    out.append((i, None if rule else int(self.diff_ref[i]), why))
        return out

    def raise_first(self) -> None:
        if self.found:
            raise StructureError("symmetry", self.first_finding())

    def first_finding(self) -> str:
        """The first recorded finding, in execution order, naming its
        replica, microbatch and node."""
        i, j, why = min(self.found, key=lambda f: f[0])
        mb, d = int(self.cols.n_mb[i]), int(self.rank_d[self.cols.n_rank[i]])
        replica = "expert-data-parallel replica" if int(self.p.world.get("ep", 1)) > 1 \
            else "replica"
        where = f"{replica} {d}" + (f", microbatch {mb}" if mb >= 0 else
                                    " (outside microbatches)")
        ref = f", against the representative's {label(self.p, j)}" if j is not None else ""
        return f"{where}: {label(self.p, i)}{ref}: {why}"

    def free_tensors(self) -> int:
        """The first tensor no node reads or writes, or -1. Such a tensor
        is in no block program, so nothing compares it."""
        seen = np.zeros(len(self.cols.t_rank), dtype=bool)
        flat = self.cols.flat
        for lo, hi in chunks(len(flat)):
            part = flat[lo:hi]
            seen[part[part >= 0]] = True
        free = np.flatnonzero(~seen)
        return int(free[0]) if free.size else -1

    #: What only the passes read: the compared columns, and the passes' own masks,
    #: views and findings. The representatives' cut (verdict/symmetry/cut.py) reads the
    #: tuples, microbatches, replicas, slice offsets, owned shards, offsets and chains.
    PASS_ONLY_COLUMNS = ("t_mb", "t_tid", "t_version", "t_lver", "t_producer", "n_op", "n_dir",
                         "n_kw")
    PASS_ONLY = ("t_view", "bad_rows", "orbit", "rule_code", "diff_code", "diff_ref",
                 "last_reps")

    def finish(self) -> None:
        """Let go of what only the passes read (PASS_ONLY_COLUMNS and
        PASS_ONLY, set to None), once the classes are found: a few tens of
        bytes a node the cut does not need, and the heap pages the passes'
        temporaries freed (:func:`trim_heap`); the replica of every node and
        tensor is kept from then on, for the cut. No pass may run after."""
        for name in self.PASS_ONLY_COLUMNS:
            setattr(self.cols, name, None)
        for name in self.PASS_ONLY:
            setattr(self, name, None)
        self.kept_d = (self.n_d, self.t_d)
        trim_heap()

    def kwargs(self, i: int) -> dict:
        return self.p.kwargs_of(int(self.cols.n_kw[i]))

    # -- the check -----------------------------------------------------------------
    def run(self) -> None:
        self.examine()
        self.raise_first()

    def examine(self) -> None:
        """Every rule and comparison, recording findings in ``found`` (and
        the differing nodes in ``differs``) without raising, but for a
        plan whose blocks cannot be matched at all.

        A later pass (other ``rep_of_d``/``rep_of_m``, verdict/symmetry/classes.py)
        after one without rule findings redoes only what depends on the
        representatives, for the nodes whose block's representative
        changed: the others compare with the same representative's node as
        before, and the rules not made in comparisons read no
        representative (docs/soundness.md, "When the blocks differ")."""
        if self.last_reps is not None and not (self.rule_code != _NONE).any():
            self.recheck()
        else:
            self.first_pass()
        self.last_reps = self.reps_now()
        self.found = self.findings()

    def reps_now(self) -> tuple[np.ndarray, np.ndarray]:
        """The representative of every replica and every microbatch, as arrays."""
        dp, nm = self.fold.dp, self.fold.nm
        return (np.zeros(dp, dtype=np.int64) if self.rep_of_d is None else self.rep_of_d.copy(),
                np.zeros(nm, dtype=np.int64) if self.rep_of_m is None else self.rep_of_m.copy())

    def recheck(self) -> None:
        """The comparisons of the nodes whose block's representative changed."""
        (old_d, old_m), (new_d, new_m) = self.last_reps, self.reps_now()
        cols = self.cols
        moved_d, moved_m = old_d != new_d, old_m != new_m
        changed = np.empty(len(cols.n_rank), dtype=bool)
        for lo, hi in chunks(len(changed)):
            mb = cols.n_mb[lo:hi]
            changed[lo:hi] = moved_d[self.rank_d[cols.n_rank[lo:hi]]] | (
                (mb >= 0) & moved_m[np.maximum(mb, 0)])
        self.rule_code[changed] = _NONE
        self.diff_code[changed] = _NONE
        rep = self.representatives(changed)
        self.check_kwargs(rep, self.orbit, changed)
        self.check_entries(rep, self.orbit, self.bad_rows, changed)

    def first_pass(self) -> None:
        self.rule_code[:] = _NONE
        self.diff_code[:] = _NONE
        cols = self.cols
        nm = self.fold.nm
        nn = len(cols.n_rank)
        for what, ranks in (("node runs", cols.n_rank), ("tensor lives", cols.t_rank)):
            if len(ranks) and (int(ranks.max()) >= len(self.rank_d) or int(ranks.min()) < 0):
                raise StructureError("symmetry",
                                     f"a {what} on a rank outside the world's layout")
        if nn and (int(cols.n_mb.max()) >= nm or int(cols.n_mb.min()) < -1):
            raise StructureError("symmetry", f"a node runs a microbatch outside 0..{nm - 1}")
        kinds = [lg.kind for lg in self.p.logical] or [""]

        def of_kind(*which: str) -> np.ndarray:
            return np.array([k in which for k in kinds], dtype=bool)[cols.t_tid]

        self.gradbuf_tid = np.array([k == "gradbuf" for k in kinds], dtype=bool)
        self.check_offsets(of_kind("data", "tokens"))
        self.t_view, self.bad_rows = self.input_views((cols.t_producer < 0) &
                                                      of_kind(*INPUT_KINDS))
        drop_pages(self.p.tensors.slices, self.p.tensors.parts)
        rep = self.representatives()
        ends = self.check_chains()
        self.orbit = orbit = self.orbits()
        self.check_kwargs(rep, orbit)
        self.check_entries(rep, orbit, self.bad_rows)
        del rep
        self.check_glue(orbit, ends)

    def check_offsets(self, t_data: np.ndarray) -> None:
        """Rule (c), :func:`~verdict.symmetry.rules.block_offsets`, over the
        first row each class loads in each block; inputs are then compared
        relative to their block's first row (``offset``)."""
        cols, slices = self.cols, self.p.tensors.slices
        data = np.flatnonzero((cols.t_producer < 0) & t_data & (cols.t_mb >= 0))
        first: dict[tuple, int] = {}
        for t in data.tolist():
            tid = int(cols.t_tid[t])
            for k in self.batch.get(tid, ()):
                if k < cols.slice_off[t + 1] - cols.slice_off[t]:
                    start = int(slices[cols.slice_off[t] + k, 0])
                    key = (*self.mesh.split(int(cols.t_rank[t])), int(cols.t_mb[t]))
                    first[key] = min(first.get(key, start), start)
        self.offset, found = block_offsets(first, self.rows, self.fold.dp * self.fold.nm)
        if found is not None:
            raise StructureError("symmetry", (
                f"the blocks start at batch rows {_short(found)}, not every {self.rows} rows "
                f"from 0: its replicas and microbatches do not split the batch into blocks"))

    def input_views(self, t_input: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For every input tensor (``t_input``), an id of its slices relative to its
        block's first row and its parts (-1 for computed tensors); and
        the tensors (sorted) that hold rows outside their block. Only the
        input tensors' slices are copied."""
        cols, tc = self.cols, self.p.tensors
        nt = len(cols.t_rank)
        bad = np.zeros(nt, dtype=bool)
        inputs = np.flatnonzero(t_input)
        ndim = (cols.slice_off[inputs + 1] - cols.slice_off[inputs]).astype(np.int64)
        width = int(ndim.max(initial=0))
        owner = np.repeat(np.arange(len(inputs)), ndim)
        col = np.arange(len(owner)) - np.repeat(np.cumsum(ndim) - ndim, ndim)
        rows = cols.slice_off[inputs[owner]].astype(np.int64) + col
        shifted = tc.slices[rows].astype(np.int64)  # moved to block coordinates below
        at = {int(r): k for k, r in enumerate(rows.tolist())} if len(rows) < 1 << 22 else None
        dims_of = {tid: dims for tid, dims in self.batch.items() if dims}
        # the logical tensors with batch dims (the single plan's tids index the same table)
        batched = np.zeros(max([len(self.p.logical), *(k + 1 for k in dims_of)]), dtype=bool)
        batched[list(dims_of)] = True
        for t in inputs[batched[cols.t_tid[inputs]]].tolist():
            row = self.offset.get((*self.mesh.split(int(cols.t_rank[t])), int(cols.t_mb[t])), -1)
            if row < 0:
                continue
            for k in dims_of[int(cols.t_tid[t])]:
                r = int(cols.slice_off[t]) + k
                j = at[r] if at is not None else int(np.searchsorted(rows, r))
                a, b = int(shifted[j, 0]) - row, int(shifted[j, 1]) - row
                bad[t] |= not (0 <= a < b <= self.rows)
                shifted[j] = (a, b)
        owned, dim, off = self.owned.shifts  # an owned shard: relative to its offset
        where = cols.slice_off[owned].astype(np.int64) + dim
        at_owned = np.minimum(np.searchsorted(rows, where), max(len(rows) - 1, 0))
        if len(owned) and not (rows[at_owned] == where).all():
            raise StructureError("symmetry", "an owned shard is not an input tensor")
        shifted[at_owned] -= off[:, None]
        view = np.full((len(inputs), 2 * width + 3), -1, dtype=np.int64)
        if len(inputs) and width:
            view[owner, 2 * col] = shifted[:, 0]
            view[owner, 2 * col + 1] = shifted[:, 1]
        view[:, 2 * width:] = tc.parts[inputs]
        distinct = row_ids(view)
        del view
        ids = np.full(nt, -1, dtype=fitting(-1, int(distinct.max(initial=0))))
        ids[inputs] = distinct
        return ids, np.flatnonzero(bad)

    def representatives(self, only: np.ndarray | None = None) -> np.ndarray:
        """For each node, the node at its position in its class's
        representative program ((class, 0, 0) for a block, (class, 0) for
        a step program; (class, rep(d), rep(m)) and (class, rep(d)) when
        ``rep_of_d``/``rep_of_m`` are set); -1 where that program is shorter. Raises when a
        class lacks a block or a step program of some replica.

        Three passes over the nodes, a chunk at a time: the blocks present
        and their sizes; each node's position in its block and the blocks'
        nodes in order (a stable counting sort); each node's representative.
        Only those two and the answer span the whole plan (the position in
        the narrowest type that holds the largest block's size)."""
        nn = len(self.cols.n_rank)
        ids = self.block_ids()
        self.check_present(ids)
        kind = np.int32 if max(len(ids), 2 * nn) < I32.max else np.int64
        counts = np.zeros(len(ids), dtype=np.int64)
        for lo, hi in chunks(nn):
            b = np.searchsorted(ids, self.block_of(lo, hi, False))
            counts += np.bincount(b, minlength=len(ids))
        starts = np.zeros(len(ids), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        order = np.empty(nn, dtype=kind)  # the nodes block by block, in node order within one
        # each node's position in its block
        pos = np.empty(nn, dtype=fitting(int(counts.max(initial=0))))
        filled = np.zeros(len(ids), dtype=np.int64)
        for lo, hi in chunks(nn):
            b = np.searchsorted(ids, self.block_of(lo, hi, False))
            sort = np.argsort(b, kind="stable")
            first = np.searchsorted(b[sort], b[sort], side="left")
            within = np.empty(len(b), dtype=np.int64)
            within[sort] = np.arange(len(b)) - first
            at = filled[b] + within
            pos[lo:hi] = at
            order[starts[b] + at] = np.arange(lo, hi, dtype=kind)
            filled += np.bincount(b, minlength=len(ids))
        rep = np.empty(nn, dtype=index_array(np.array([nn])).dtype)
        for lo, hi in chunks(nn):
            own_size = counts[np.searchsorted(ids, self.block_of(lo, hi, False))]
            rep_block = self.block_of(lo, hi, True)
            where = np.minimum(np.searchsorted(ids, rep_block), len(ids) - 1)
            found = ids[where] == rep_block
            size = np.where(found, counts[where], 0)
            at = pos[lo:hi]
            found &= at < size
            got = np.where(found, order[np.minimum(starts[where] + at, nn - 1)], -1)
            rep[lo:hi] = got
            if only is not None:
                own_size = np.where(only[lo:hi], own_size, size)
            self.flag(own_size != size, np.arange(lo, hi), "its block has another number of "
                      "nodes than the representative's",
                      np.where(got >= 0, got, order[starts[where]]))
        return rep

    def block_ids(self) -> np.ndarray:
        """The distinct blocks of the nodes (:meth:`block_of`), sorted."""
        found = [np.unique(self.block_of(lo, hi, False))
                 for lo, hi in chunks(len(self.cols.n_rank))]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)

    def block_of(self, lo: int, hi: int, representative: bool) -> np.ndarray:
        """The block of nodes lo..hi-1 (class, replica, microbatch + 1, 0:
        outside microbatches) as one int64, or with ``representative`` the
        block of their representative (``rep_of_d``, ``rep_of_m``)."""
        dp, nm = self.fold.dp, self.fold.nm
        rank = self.cols.n_rank[lo:hi]
        d = self.rank_d[rank].astype(np.int64)
        mb = self.cols.n_mb[lo:hi].astype(np.int64)
        slot = mb + 1
        if representative:
            d = 0 if self.rep_of_d is None else self.rep_of_d.astype(np.int64)[d]
            slot = np.minimum(slot, 1) if self.rep_of_m is None else \
                np.where(slot > 0, self.rep_of_m.astype(np.int64)[np.maximum(mb, 0)] + 1, 0)
        return (self.rank_cls[rank].astype(np.int64) * dp + d) * (nm + 1) + slot

    def check_present(self, ids: np.ndarray) -> None:
        """Every class with a block program has one for each (d, m), and a
        class with a step program on replica 0 has one on every replica."""
        dp, nm = self.fold.dp, self.fold.nm
        slot = ids % (nm + 1)
        cls_d = ids // (nm + 1)
        cls = cls_d // dp
        for which, mask, want in (("blocks (replica, microbatch)", slot > 0, dp * nm),
                                  ("step programs (outside microbatches)", slot == 0, dp)):
            classes, counts = np.unique(cls[mask], return_counts=True)
            short = classes[counts != want]
            if short.size:
                raise StructureError("symmetry", (
                    f"rank class {self.class_name(int(short[0]))} runs "
                    f"{int(counts[counts != want][0])} {which}, not {want}: a replica or "
                    f"microbatch lacks its program"))

    def class_name(self, cls: int) -> tuple[int, int, int]:
        t = cls % self.tp
        c = (cls // self.tp) % self.cp
        return cls // (self.tp * self.cp), c, t

    def orbits(self) -> np.ndarray:
        """Nodes of a group operator that read another replica's tensor, a
        chunk of nodes at a time."""
        cols = self.cols
        group = np.array([get_op(op).group for op in cols.ops], dtype=bool)
        orbit = np.zeros(len(cols.n_op), dtype=bool)
        for lo, hi in chunks(len(orbit)):
            g = np.flatnonzero(group[cols.n_op[lo:hi]]) + lo
            if g.size:
                orbit[g] = self.reads_other_replicas(g)
        return orbit

    def reads_other_replicas(self, g: np.ndarray) -> np.ndarray:
        """Whether each node ``g`` reads a tensor of a replica not its own."""
        cols = self.cols
        tuples, inverse = np.unique(cols.n_ins[g], return_inverse=True)
        ts = cols.flat[spans(cols.ptr, tuples)]
        lengths = cols.ptr[tuples + 1] - cols.ptr[tuples]
        d = self.rank_d[cols.t_rank[np.maximum(ts, 0)]]
        big = self.fold.dp
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        nonempty = lengths > 0
        low = np.full(len(tuples), big)
        high = np.full(len(tuples), -1)
        low[nonempty] = np.minimum.reduceat(np.where(ts >= 0, d, big), starts[nonempty])
        high[nonempty] = np.maximum.reduceat(np.where(ts >= 0, d, -1), starts[nonempty])
        own = self.rank_d[cols.n_rank[g]]
        low, high = low[inverse.reshape(-1)], high[inverse.reshape(-1)]
        return ((low != own) & (low != big)) | ((high != own) & (high != -1))

    def check_kwargs(self, rep: np.ndarray, orbit: np.ndarray,
                     only: np.ndarray | None = None) -> None:
        """Operator, direction and kwargs equal the representative's (of the
        nodes ``only``, default all); an orbit's ``index`` is compared as
        its own position (checked in :meth:`check_glue`), a send/receive
        peer as its class, in the replica."""
        cols = self.cols
        special, special_kw = self.normal_kwargs(orbit)

        def kwargs_code(nodes: np.ndarray) -> np.ndarray:
            """The kwargs code of nodes, the normalized one where there is one."""
            kw = cols.n_kw[nodes].astype(np.int64)
            at = np.minimum(np.searchsorted(special, nodes), max(len(special) - 1, 0))
            hit = special[at] == nodes if len(special) else np.zeros(len(nodes), dtype=bool)
            kw[hit] = special_kw[at[hit]]
            return kw

        for lo, hi in chunks(len(cols.n_kw)):
            nodes = np.arange(lo, hi)
            kw = kwargs_code(nodes)
            self.flag(kw == -1, nodes, "its send/receive peer is in another replica")
            ok = rep[lo:hi] >= 0
            if only is not None:
                ok &= only[lo:hi]
            r = np.maximum(rep[lo:hi], 0)
            self.flag(ok & ((cols.n_op[lo:hi] != cols.n_op[r]) | (cols.n_dir[lo:hi] != cols.n_dir[r])),
                      nodes, "another operator or direction", rep[lo:hi])
            self.flag(ok & (kw != kwargs_code(r)), nodes, "other kwargs", rep[lo:hi])
            for tuples, what in ((cols.n_ins, "inputs"), (cols.n_outs, "outputs")):
                own, of_r = tuples[lo:hi], tuples[r]
                n = cols.ptr[own + 1] - cols.ptr[own]
                self.flag(ok & (n != cols.ptr[of_r + 1] - cols.ptr[of_r]), nodes,
                          f"another number of {what}", rep[lo:hi])

    def normal_kwargs(self, orbit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The nodes whose kwargs are compared normalized, in order, and
        their normalized codes (-1: a send/receive peer in another replica).
        An orbit's or an owned shard's ``index`` is left out (checked in
        :meth:`check_glue` and verdict/symmetry/owned.py), a send/receive peer is
        its class, in the replica."""
        cols, p = self.cols, self.p
        is_send = np.array([op == "send_recv" for op in cols.ops] or [False])
        owned = np.flatnonzero(self.owned.nodes)
        found = [np.flatnonzero(orbit[lo:hi] | member_mask(owned, lo, hi) | is_send[cols.n_op[lo:hi]])
                 + lo for lo, hi in chunks(len(cols.n_kw))]
        special = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        if not len(special):
            return special, np.zeros(0, dtype=np.int64)
        own_index = orbit[special] | np.isin(special, owned)
        # one normalization per (kwargs code, replica, own index), made as its first node has it
        own_d = self.rank_d[cols.n_rank[special]].astype(np.int64)
        keys = np.stack((cols.n_kw[special].astype(np.int64), own_d,
                         own_index.astype(np.int64)), axis=1)
        distinct, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        table: dict[str, int] = {}
        normal = np.empty(len(distinct), dtype=np.int64)
        for k, ((code, own_d, own), i) in enumerate(zip(distinct.tolist(), special[first].tolist())):
            kwargs = p.kwargs_of(code)
            if own:
                kwargs.pop("index", None)
            off = False
            for name in ("src", "dst"):
                if is_send[cols.n_op[i]] and isinstance(kwargs.get(name), int):
                    cls, d = self.mesh.split(kwargs[name])
                    off |= d != own_d
                    kwargs[name] = list(cls)
            text = json.dumps(kwargs, sort_keys=True)
            normal[k] = -1 if off else len(p.kwargs) + table.setdefault(text, len(table))
        codes = normal[inverse.reshape(-1)]
        return special, codes

    def check_entries(self, rep: np.ndarray, orbit: np.ndarray, bad_rows: np.ndarray,
                      only: np.ndarray | None = None) -> None:
        """Each tensor a node (of ``only``, default all) reads or writes
        against the one its representative reads or writes at that
        position, a chunk of nodes at a time."""
        cols = self.cols
        for outputs, tuples in ((False, cols.n_ins), (True, cols.n_outs)):
            for lo, hi in chunks(len(tuples)):
                own, r = tuples[lo:hi], np.maximum(rep[lo:hi], 0)
                lengths = cols.ptr[own + 1] - cols.ptr[own]
                same = (rep[lo:hi] >= 0) & (lengths == cols.ptr[tuples[r] + 1] - cols.ptr[tuples[r]])
                if only is not None:
                    same &= only[lo:hi]
                # an orbit reading the same tuple as its representative reads the same tensors
                skip = orbit[lo:hi] & (own == tuples[r]) & (not outputs)
                picked = np.flatnonzero(same & ~skip)
                if not len(picked):
                    continue
                count = lengths[picked].astype(np.int64)
                node = np.repeat(picked + lo, count)
                k = np.arange(len(node)) - np.repeat(np.cumsum(count) - count, count)
                t = cols.flat[cols.ptr[tuples[node]] + k]
                r = cols.flat[cols.ptr[tuples[rep[node]]] + k]
                chain = self.is_acc(node) & ((k == 0) | outputs)
                self.compare(node, rep[node], t, r, chain, orbit[node] & (not outputs),
                             "output" if outputs else "input", bad_rows)
                drop_pages(self.p.tensors.slices)  # read by shapes_differ

    def compare(self, node, rep, t, r, chain, orbit, what: str, bad_rows) -> None:
        cols = self.cols
        self.flag((t < 0) != (r < 0), node, f"an {what} present in one and absent in the other",
                  rep)
        live = (t >= 0) & (r >= 0)
        node, rep, t, r, chain, orbit = (a[live] for a in (node, rep, t, r, chain, orbit))
        mb = cols.n_mb[node]
        t_mb, r_mb = cols.t_mb[t], cols.t_mb[r]

        def relation(x_mb, n_mb):
            return np.where(n_mb < 0, x_mb, np.where(x_mb == n_mb, -2, np.where(x_mb < 0, -1, -3)))

        rel_t, rel_r = relation(t_mb, mb), relation(r_mb, cols.n_mb[rep])
        self.flag((rel_t == -3) & ~chain, node, f"its {what} is another microbatch's tensor")
        made = cols.t_producer[t]
        constant = np.array([op in CONSTANTS for op in cols.ops], dtype=bool)
        self.flag(reads_outside(mb, t_mb, made >= 0, constant[cols.n_op[np.maximum(made, 0)]])
                  & ~self.owned.gathered[t], node, READS_OUTSIDE)
        d, t_rank, r_rank = self.rank_d, cols.t_rank[t], cols.t_rank[r]
        self.flag((d[t_rank] != d[cols.n_rank[node]]) & ~orbit, node,
                  "it reads another replica's tensor outside a sum over the replicas")
        self.flag(np.isin(t, bad_rows) if len(bad_rows) else np.zeros(len(t), dtype=bool), node,
                  f"its {what} holds rows outside its block")
        differ = ((self.rank_cls[t_rank] != self.rank_cls[r_rank]) | (cols.t_tid[t] != cols.t_tid[r])
                  | self.shapes_differ(t, r)
                  | (self.t_view[t] != self.t_view[r])
                  | (~chain & ((rel_t != rel_r) | (cols.t_version[t] != cols.t_version[r])
                               | (cols.t_lver[t] != cols.t_lver[r]))))
        self.flag(differ, node, f"another {what} tensor, shape, slice or dataflow", rep)

    def shapes_differ(self, t: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Whether tensors ``t`` and ``r`` (pairwise) differ in local shape:
        in number of dims or in some dim's extent (its slice's end - start)."""
        off, slices = self.cols.slice_off, self.p.tensors.slices
        t_off, r_off = off[t], off[r]
        nd = off[t + 1] - t_off
        differ = nd != off[r + 1] - r_off
        for k in range(int(nd.max(initial=0))):
            m = np.flatnonzero((k < nd) & ~differ)
            a = slices[t_off[m] + k].astype(np.int64)
            b = slices[r_off[m] + k].astype(np.int64)
            differ[m] = (a[:, 1] - a[:, 0]) != (b[:, 1] - b[:, 0])
        return differ

    def check_chains(self) -> np.ndarray:
        """Rule (b), :func:`~verdict.symmetry.rules.accumulation_chains`, per
        rank and gradient buffer, every accumulation that breaks it flagged.
        Returns the chains' ends (tensors, sorted), which rules (d) and (f)
        read."""
        cols = self.cols
        found = [np.flatnonzero(self.is_acc(slice(lo, hi))) + lo
                 for lo, hi in chunks(len(cols.n_rank))]
        acc = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        if not acc.size:
            return np.zeros(0, dtype=np.int64)
        lengths = cols.ptr[cols.n_ins[acc] + 1] - cols.ptr[cols.n_ins[acc]]
        buf = np.where(lengths > 0, cols.flat[cols.ptr[cols.n_ins[acc]]], -1)
        out = cols.flat[cols.ptr[cols.n_outs[acc]]]
        key_tid = np.where(buf >= 0, cols.t_tid[np.maximum(buf, 0)], -1)
        key = cols.n_rank[acc].astype(np.int64) * (len(self.p.logical) + 1) + key_tid + 1
        zeros_op = np.array([op == "zeros" for op in cols.ops], dtype=bool)
        made = cols.t_producer[np.maximum(buf, 0)]
        from_zeros = (buf >= 0) & (made >= 0) & zeros_op[cols.n_op[np.maximum(made, 0)]] & \
            (cols.t_mb[np.maximum(buf, 0)] == -1)
        order, ok, first, last = accumulation_chains(acc, key, buf, out, from_zeros)
        acc, buf, out = acc[order], buf[order], out[order]
        self.flag(~ok, acc, NOT_RUNNING_BUFFER)
        #: (rank, gradient buffer) -> the zeros buffer its chain starts from
        self.chain_start = {(int(cols.n_rank[a]), int(cols.t_tid[o])): int(b)
                            for a, b, o in zip(acc[first], buf[first], out[first])}
        self.chain_end = {(int(cols.n_rank[a]), int(cols.t_tid[o])): int(o)
                          for a, o in zip(acc[last], out[last])}
        return np.unique(out[last])

    def sums_of_ends(self, is_end: np.ndarray) -> np.ndarray:
        """The nodes (in order) of an orbit-sum operator whose inputs are
        all chain ends (``is_end``). Each distinct input tuple is read once
        (the replicas of a reducer share theirs: a tuple of dp entries read
        per node would be dp times the plan's entries), a bounded number of
        entries at a time."""
        cols = self.cols
        sums_op = np.array([op in ORBIT_SUMS for op in cols.ops], dtype=bool)
        found = [np.flatnonzero(sums_op[cols.n_op[lo:hi]]) + lo
                 for lo, hi in chunks(len(cols.n_rank))]
        cand = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        groups, inverse = np.unique(cols.n_ins[cand], return_inverse=True)
        lengths = (cols.ptr[groups + 1] - cols.ptr[groups]).astype(np.int64)
        upto = np.cumsum(lengths)
        ok = np.ones(len(groups), dtype=bool)  # an empty input tuple holds no other tensor
        lo = 0
        while lo < len(groups):
            hi = max(lo + 1, int(np.searchsorted(upto, upto[lo] - lengths[lo] + NODE_CHUNK,
                                                 side="right")))
            ln = lengths[lo:hi]
            ts = cols.flat[spans(cols.ptr, groups[lo:hi])]
            bad = (ts < 0) | ~is_end[np.maximum(ts, 0)]
            nonempty = np.flatnonzero(ln > 0)
            if len(nonempty):
                starts = (np.cumsum(ln) - ln)[nonempty]
                ok[lo + nonempty] = ~np.logical_or.reduceat(bad, starts)
            lo = hi
        return cand[ok[inverse]]

    def check_glue(self, orbit: np.ndarray, ends: np.ndarray) -> None:
        """(a), (d), (f): orbits are sums of chain ends (``ends``) over
        the whole orbit, at their own index; a rank's last gradient buffer
        is a chain end or such a sum."""
        cols, p = self.cols, self.p
        is_end = np.zeros(len(cols.t_rank), dtype=bool)
        is_end[ends] = True
        sums_ends = self.sums_of_ends(is_end)
        found = [np.flatnonzero(orbit[lo:hi]) + lo for lo, hi in chunks(len(orbit))]
        orbits = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        of_ends = np.isin(orbits, sums_ends)  # of an op of ORBIT_SUMS (sums_of_ends)
        is_sum = np.array([op in ORBIT_SUMS for op in cols.ops], dtype=bool)[cols.n_op[orbits]]
        self.flag(~self.owned.nodes[orbits] & ~sum_of_ends(is_sum, cols.n_mb[orbits], of_ends),
                  orbits, NOT_A_SUM_OF_ENDS)
        sums = orbits[of_ends]
        groups = cols.n_ins[sums]
        whole = {int(g): self.whole_orbit(cols.flat[cols.ptr[g]:cols.ptr[g + 1]])
                 for g in np.unique(groups)}
        not_whole = np.array([not whole[int(g)] for g in groups], dtype=bool)
        self.flag(not_whole, sums, NOT_WHOLE_ORBIT)
        index_of = {code: index_kwarg(self.p.kwargs_of(code))  # kwargs code -> its index
                    for code in np.unique(cols.n_kw[sums]).tolist()}
        index = np.array([index_of[c] for c in cols.n_kw[sums].tolist()], dtype=np.int64)

        def rank_at(valid: np.ndarray, index: np.ndarray) -> np.ndarray:
            member = cols.flat[np.where(valid, cols.ptr[groups] + index, 0)]
            return np.where(member >= 0, cols.t_rank[np.maximum(member, 0)], -1)

        own = own_index(index, cols.ptr[groups + 1] - cols.ptr[groups], rank_at,
                        cols.n_rank[sums])
        self.flag(~not_whole & ~own, sums, NOT_OWN_INDEX)
        # (f) the gradient buffer a rank ends with
        t, writer = self.gradbuf_writes(len(cols.ptr) - 1 - len(cols.n_rank))
        if not len(t):
            return
        key = cols.t_rank[t].astype(np.int64) * (len(p.logical) + 1) + cols.t_tid[t]
        last = last_writes(key, writer)
        w, out = writer[last], t[last]
        ok = ends_with_chains(self.is_acc(w) & is_end[out], np.isin(w, sums_ends)) | \
            self.owned.keeps[w]
        self.flag(~ok, w, NOT_LAST_BUFFER)

    def gradbuf_writes(self, n_in: int) -> tuple[np.ndarray, np.ndarray]:
        """The gradient buffers written and their writers, in node order:
        the output tuples lie after the ``n_in`` input tuples in flat, one
        per node (arrays()); read a chunk of nodes at a time."""
        cols = self.cols
        nn = len(cols.n_rank)
        out_ptr = cols.ptr[n_in:]
        found_t, found_w = [np.zeros(0, dtype=cols.flat.dtype)], [np.zeros(0, dtype=np.int64)]
        for lo in range(0, nn, NODE_CHUNK):
            hi = min(lo + NODE_CHUNK, nn)
            t = cols.flat[int(out_ptr[lo]): int(out_ptr[hi])]
            writer = np.repeat(np.arange(lo, hi), np.diff(out_ptr[lo: hi + 1]))
            keep = t >= 0
            t, writer = t[keep], writer[keep]
            g = self.gradbuf_tid[cols.t_tid[t]]
            found_t.append(t[g])
            found_w.append(writer[g])
        return np.concatenate(found_t), np.concatenate(found_w)

    def whole_orbit(self, members: np.ndarray) -> bool:
        """Rule (a), :func:`~verdict.symmetry.rules.whole_orbit`, of a
        collective's input tensors (none absent)."""
        if (members < 0).any():
            return False
        rank = self.cols.t_rank[members]
        return whole_orbit(self.rank_cls[rank], self.rank_d[rank], self.fold.dp)


def label(plan: Columns, i: int) -> str:
    n = plan.nodes
    return (f"node {i} (rank {int(n.rank[i])}, mb {int(n.mb[i])}, {plan.ops[int(n.op[i])]} "
            f"{DIRECTIONS[int(n.dir[i])]} '{plan.names[int(n.name[i])]}')")


def _short(rows: list[int]) -> str:
    return str(rows) if len(rows) <= 8 else f"[{', '.join(map(str, rows[:8]))}, ...]"
