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

:class:`BlockCheck` holds the arrays, the findings, the passes, rule (c)
and the comparison of every tensor a node reads or writes; it inherits the
matching of nodes with their representatives' and the comparison of kwargs
(verdict/symmetry/programs.py) and the glue, rules (a), (b), (d) and (f)
(verdict/symmetry/glue.py).
"""

from __future__ import annotations

import numpy as np

from verdict.columns import Columns, drop_pages, row_ids, trim_heap
from verdict.layout import Layout
from verdict.lineage import StructureError
from verdict.plan import DIRECTIONS, INPUT_KINDS, Plan
from verdict.symmetry.arrays import arrays, chunks, fitting, index_array, small_array
from verdict.symmetry.fold import Fold, batch_dims
from verdict.symmetry.glue import GlueCheck
from verdict.symmetry.owned import find_owned
from verdict.symmetry.programs import ProgramMatch
from verdict.symmetry.rules import (
    ACCUMULATE,
    CONSTANTS,
    READS_OUTSIDE,
    block_offsets,
    inner_size,
    reads_outside,
)

#: No finding (BlockCheck's per-node codes)
_NONE = np.iinfo(np.int8).max


class BlockCheck(ProgramMatch, GlueCheck):
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


def label(plan: Columns, i: int) -> str:
    n = plan.nodes
    return (f"node {i} (rank {int(n.rank[i])}, mb {int(n.mb[i])}, {plan.ops[int(n.op[i])]} "
            f"{DIRECTIONS[int(n.dir[i])]} '{plan.names[int(n.name[i])]}')")


def _short(rows: list[int]) -> str:
    return str(rows) if len(rows) <= 8 else f"[{', '.join(map(str, rows[:8]))}, ...]"
