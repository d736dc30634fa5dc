"""Materialized plans of many microbatches, by array arithmetic.

The plan of N microbatches is not built one Python object per node. The
generator emits the same run at 3, 4 and 5 microbatches (the same rows per
microbatch), whose size does not depend on N, and expands them to N with
numpy (docs/plan-format.md, "Replicated generation"):

* On every rank each microbatch runs the same block program: the nodes of
  (rank, m) are, position by position, the same operator, direction, name
  and kwargs for every m (checked on all 12 microbatches of the three
  plans). A node *lineage* is (rank, position in the block), a node is a
  lineage at one microbatch; a tensor lineage is (node lineage, output
  slot), or (rank, tid, version) for an input no node writes.
* Every integer of a microbatch's tensor (rank, tid, version, lver, parts,
  slices) is affine in (N, m), ``v = a + b N + c m``, fitted from three of
  the twelve points and checked on the other nine; the step program's
  tensors (outside microbatches) are affine in N, checked on the third size.
  A scale must be the same everywhere.
* A microbatch node reads a step tensor, or the tensor of a lineage at
  microbatch ``m + k`` with ``k`` the same for every m >= 1 (k = -1: the
  running gradient buffer of the accumulation chain); microbatch 0 may read
  otherwise (the chain's zeros), the same on every size. A step node reads
  a lineage at microbatch ``a + b N`` (the chain's end), checked on the third
  size. Anything else refuses the array path (:class:`NotReplicable`).

The node order is microbatch-major: the step nodes that come before
every microbatch node of their rank, then microbatch 0 to N - 1 (each in
the 3-microbatch plan's order of its template), then the other step
nodes. That is an execution order when no microbatch reads a later one
and no microbatch node reads a later step node (checked when the columns
are validated); it keeps every microbatch's node sequence on each rank
but not the schedule's interleaving of microbatches (a renumbering of
the same DAG).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gen_model.config import Parallelism
from gen_model.parallelize import Policy
from gen_model.replicate import NotReplicable, _runs
from verdict.columns import Columns, NodeColumns, TensorColumns, narrow
from verdict.plan import Logical

Array = np.ndarray
#: The microbatch counts of the small plans: templates (3) and checks (4, 5).
SIZES = (3, 4, 5)


def microbatches_replicable(par: Parallelism, policy: Policy, variant: str) -> bool:
    """Whether the microbatch expansion applies: more than 5 microbatches,
    no interleaved stages (their schedule ties nm to pp), and no bug
    variant (edited per node)."""
    return par.nm > max(SIZES) and policy.virtual_stages == 1 and variant == "default"


def _positions(keys: Array) -> Array:
    """Each element's position among the elements of equal key, in order."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_keys)) + 1]
    run = np.repeat(starts, np.diff(np.r_[starts, len(keys)]))
    pos = np.empty(len(keys), dtype=np.int64)
    pos[order] = np.arange(len(keys)) - run
    return pos


@dataclass
class _Small:
    """One small plan with its nodes and tensors named size-independently:
    node (rank, mb, position), tensor lineage or step-tensor keys."""

    cols: Columns
    n: int

    def __post_init__(self) -> None:
        c = self.cols
        nodes, tensors = c.nodes, c.tensors
        self.n_rank = nodes.rank.astype(np.int64)
        self.n_mb = nodes.mb.astype(np.int64)
        if len(self.n_mb) and (self.n_mb.max() >= self.n or self.n_mb.min() < -1):
            raise NotReplicable("a node's microbatch is outside the plan's")
        self.n_pos = _positions(self.n_rank * (self.n + 1) + self.n_mb + 1)
        self.t_mb = tensors.mb.astype(np.int64)
        out_len = np.diff(nodes.out_off.astype(np.int64))
        owner, slot = _runs(out_len)
        outs = nodes.outputs.astype(np.int64)
        self.t_producer = np.full(len(tensors), -1, dtype=np.int64)
        self.t_slot = np.full(len(tensors), -1, dtype=np.int64)
        written = outs >= 0
        self.t_producer[outs[written]] = owner[written]
        self.t_slot[outs[written]] = slot[written]

    def tensor_key(self, t: int) -> tuple:
        """A tensor's name up to its microbatch (its lineage, or a step tensor)."""
        p = int(self.t_producer[t])
        if p >= 0:
            return ("made", int(self.n_rank[p]), int(self.n_mb[p] >= 0), int(self.n_pos[p]),
                    int(self.t_slot[t]))
        tc = self.cols.tensors
        return ("input", int(tc.rank[t]), int(self.t_mb[t] >= 0), int(tc.tid[t]),
                int(tc.version[t]))


class _Expander:
    def __init__(self, smalls: list[_Small], nm: int):
        self.s, self.nm = smalls, nm
        three = smalls[0]
        # node lineages: the (rank, position) of microbatch 0 of the 3-plan
        blk = np.flatnonzero(three.n_mb == 0)
        self.lineage_of = {(r, p): k for k, (r, p) in enumerate(
            zip(three.n_rank[blk].tolist(), three.n_pos[blk].tolist()))}
        steps = np.flatnonzero(three.n_mb < 0)
        self.step_of = {(r, p): k for k, (r, p) in enumerate(
            zip(three.n_rank[steps].tolist(), three.n_pos[steps].tolist()))}
        self.n_lin, self.n_step = len(blk), len(steps)
        # per small plan: each node's lineage or step index, checked to cover all
        self.node_id = [self.name_nodes(s) for s in smalls]
        self.tensor_names()

    # ------------------------------------------------------------ naming
    def name_nodes(self, s: _Small) -> Array:
        ids = np.empty(len(s.n_rank), dtype=np.int64)
        seen_lin = np.zeros((self.n_lin, s.n), dtype=bool)
        seen_step = np.zeros(self.n_step, dtype=bool)
        for i, (r, m, p) in enumerate(zip(s.n_rank.tolist(), s.n_mb.tolist(),
                                          s.n_pos.tolist())):
            table = self.lineage_of if m >= 0 else self.step_of
            k = table.get((r, p))
            if k is None:
                raise NotReplicable(f"rank {r} runs another program at {s.n} microbatches")
            ids[i] = k
            if m >= 0:
                seen_lin[k, m] = True
            else:
                seen_step[k] = True
        if not (seen_lin.all() and seen_step.all()):
            raise NotReplicable("a microbatch or the step program is shorter on some size")
        return ids

    def tensor_names(self) -> None:
        """Tensor lineages and step tensors: ids and, per small plan, each
        tensor's (is_step, id)."""
        lin: dict[tuple, int] = {}
        step: dict[tuple, int] = {}
        self.t_id: list[Array] = []
        self.t_step: list[Array] = []
        for s in self.s:
            keys = [s.tensor_key(t) for t in range(len(s.t_mb))]
            is_step = s.t_mb < 0
            ids = np.array([(step if st else lin).setdefault(k, len(step if st else lin))
                            for k, st in zip(keys, is_step.tolist())], dtype=np.int64)
            self.t_id.append(ids)
            self.t_step.append(is_step)
        self.n_tlin, self.n_tstep = len(lin), len(step)
        for s, ids, st in zip(self.s, self.t_id, self.t_step):
            count_lin = np.bincount(ids[~st], minlength=self.n_tlin)
            count_step = np.bincount(ids[st], minlength=self.n_tstep)
            if not ((count_lin == s.n).all() and (count_step == 1).all()):
                raise NotReplicable(f"the plan at {s.n} microbatches holds other tensors")

    def tensor_index(self, ids: Array, m: Array, step: Array) -> Array:
        """Index in the result of step tensor ``ids`` or lineage ``ids`` at ``m``."""
        return np.where(step, ids, self.n_tstep + m * self.n_tlin + ids)

    # ------------------------------------------------------------ tensors
    def tensor_points(self, values: list[Array]) -> tuple[Array, Array]:
        """Per lineage the values at every (size, m), shape (sizes, nm_max,
        lineages, ...), and per step tensor at every size (sizes, steps, ...)."""
        lin_vals, step_vals = [], []
        for s, v, ids, st in zip(self.s, values, self.t_id, self.t_step):
            lv = np.zeros((max(SIZES), self.n_tlin, *v.shape[1:]), dtype=np.int64)
            mb = s.t_mb[~st]
            lv[mb, ids[~st]] = v[~st]
            sv = np.zeros((self.n_tstep, *v.shape[1:]), dtype=np.int64)
            sv[ids[st]] = v[st]
            lin_vals.append(lv)
            step_vals.append(sv)
        return np.stack(lin_vals), np.stack(step_vals)

    def fit_tensors(self, values: list[Array], what: str) -> tuple[Array, Array]:
        """The expanded values: steps first, then lineages microbatch-major.
        Microbatches 1 to N - 2 are fitted as ``a + b N + c m``, checked on
        the six such points; microbatch 0, N - 1 and the step tensors as
        ``a + b N``, checked on the third size (the first and last differ
        where a value is normalized: a sum of all N parts is parts 0-1 of 1)."""
        lv, sv = self.tensor_points(values)
        n3 = SIZES[0]
        c = lv[1, 2] - lv[1, 1]
        b = lv[1, 1] - lv[0, 1]
        a = lv[0, 1] - n3 * b - c
        for k, n in enumerate(SIZES):
            for m in range(1, n - 1):
                if not np.array_equal(a + b * n + c * m, lv[k, m]):
                    raise NotReplicable(f"tensor {what} is not affine in the microbatches")

        def by_size(points: list[Array], where: str) -> Array:
            slope = points[1] - points[0]
            base = points[0] - n3 * slope
            if not np.array_equal(base + slope * SIZES[2], points[2]):
                raise NotReplicable(f"{where} {what} is not affine in the microbatches")
            return base + slope * self.nm

        first = by_size([lv[k, 0] for k in range(len(SIZES))], "the first microbatch's tensor")
        last = by_size([lv[k, n - 1] for k, n in enumerate(SIZES)],
                       "the last microbatch's tensor")
        steps = by_size(list(sv), "step tensor")
        base = a + b * self.nm
        m = np.arange(self.nm).reshape(-1, *([1] * base.ndim))
        lines = base[None] + c[None] * m
        lines[0], lines[-1] = first, last
        return steps, lines.reshape(-1, *base.shape[1:])

    def tensors(self) -> TensorColumns:
        out = {}
        for name in ("rank", "tid", "version", "lver"):
            steps, lines = self.fit_tensors(
                [getattr(s.cols.tensors, name).astype(np.int64) for s in self.s], name)
            out[name] = narrow(np.concatenate((steps, lines)))
        steps, lines = self.fit_tensors([s.cols.tensors.parts.astype(np.int64) for s in self.s],
                                        "parts")
        out["parts"] = narrow(np.concatenate((steps, lines)))
        out["mb"] = narrow(np.concatenate((np.full(self.n_tstep, -1),
                                           np.repeat(np.arange(self.nm), self.n_tlin))))
        out["scale"] = self.scales()
        out["slices"] = self.slices(out["tid"])
        return TensorColumns(**out)

    def scales(self) -> Array | None:
        """The tensors' scales (None: none scaled), the same on every
        microbatch and size."""
        vals = [np.ones((len(s.t_mb), 2), dtype=np.int64) if s.cols.tensors.scale is None
                else s.cols.tensors.scale.astype(np.int64) for s in self.s]
        lv, sv = self.tensor_points(vals)
        if not (all((lv[k, :n] == lv[0, 0]).all() for k, n in enumerate(SIZES))
                and (sv == sv[0]).all()):
            raise NotReplicable("a tensor's scale differs between microbatches or sizes")
        steps, lines = self.fit_tensors(vals, "scale")
        scale = np.concatenate((steps, lines))
        return None if (scale == 1).all() else narrow(scale)

    def slices(self, tid: Array) -> Array:
        """Each tensor's slices, padded to the widest logical rank for the fit."""
        logical = self.s[0].cols.logical
        ndim = np.array([len(t.shape) for t in logical], dtype=np.int64)
        width = int(ndim.max(initial=1))
        padded = []
        for s in self.s:
            t = s.cols.tensors
            off = t.slice_offsets(s.cols.logical)
            nd = np.diff(off)
            pad = np.zeros((len(t), width, 2), dtype=np.int64)
            owner, within = _runs(nd)
            pad[owner, within] = t.slices
            padded.append(pad.reshape(len(t), 2 * width))
        steps, lines = self.fit_tensors(padded, "slices")
        full = np.concatenate((steps, lines)).reshape(-1, width, 2)
        nd = ndim[tid.astype(np.int64)]
        owner, within = _runs(nd)
        return narrow(full[owner, within])

    # ------------------------------------------------------------ nodes
    def same_program(self) -> tuple[Array, Array]:
        """Op, dir, name and kwargs texts of every lineage and step node, the
        same at every microbatch and size; returns the 3-plan's node of each
        lineage (at microbatch 0) and of each step node."""
        three = self.s[0]
        lin = np.flatnonzero(three.n_mb == 0)
        lin = lin[np.argsort(self.node_id[0][lin])]
        steps = np.flatnonzero(three.n_mb < 0)
        steps = steps[np.argsort(self.node_id[0][steps])]

        def texts(s: _Small, idx: Array) -> list[tuple]:
            n = s.cols.nodes
            return list(zip((s.cols.ops[k] for k in n.op[idx].tolist()), n.dir[idx].tolist(),
                            (s.cols.names[k] for k in n.name[idx].tolist()),
                            (s.cols.kwargs[k] for k in n.kwargs[idx].tolist())))

        ref_lin, ref_step = texts(three, lin), texts(three, steps)
        for s, ids in zip(self.s, self.node_id):
            for m in range(-1, s.n):
                idx = np.flatnonzero(s.n_mb == m)
                idx = idx[np.argsort(ids[idx])]
                if texts(s, idx) != (ref_step if m < 0 else ref_lin):
                    raise NotReplicable("microbatches or sizes run other ops, names or kwargs")
        return lin, steps

    def references(self, kind: str) -> tuple[Array, Array]:
        """Per lineage and step node, the rule of each input (or output)
        slot. Lineage slots: (kind, id, k) with kind 0 absent, 1 step
        tensor, 2 lineage at m + k, for microbatches 1 to N - 2, then for
        microbatch 0, then for N - 1 (9 columns). Step slots: (kind, id, a,
        b), a lineage at microbatch a + b N."""
        lin_rules: list[Array] = []
        step_rules: list[Array] = []
        for s, nid, tid_, tstep in zip(self.s, self.node_id, self.t_id, self.t_step):
            n = s.cols.nodes
            if kind == "in":
                start, count = n.in_start.astype(np.int64), n.in_count.astype(np.int64)
                pool = n.inputs.astype(np.int64)
            else:
                off = n.out_off.astype(np.int64)
                start, count = off[:-1], np.diff(off)
                pool = n.outputs.astype(np.int64)
            owner, within = _runs(count)
            e = pool[start[owner] + within]
            present = e >= 0
            ek = np.where(present, np.where(tstep[np.maximum(e, 0)], 1, 2), 0)
            eid = np.where(present, tid_[np.maximum(e, 0)], -1)
            em = np.where(ek == 2, s.t_mb[np.maximum(e, 0)], -1)
            node_mb = s.n_mb[owner]
            rel = np.where(ek == 2, em - node_mb, 0)
            place = np.where(node_mb == 0, 1, np.where(node_mb == s.n - 1, 2, 0))
            lin_rules.append(np.stack([s.n_mb[owner], nid[owner], within, ek, eid, rel, em,
                                       place], axis=1))
            step_rules.append(lin_rules[-1])
        return self.lineage_rules(lin_rules), self.step_rules(step_rules)

    def lineage_rules(self, entries: list[Array]) -> Array:
        """Rules of the microbatch nodes' slots, checked on every size and m."""
        e = np.concatenate(entries)
        e = e[e[:, 0] >= 0]
        width = int(e[:, 2].max(initial=-1)) + 1
        rules = np.full((self.n_lin, width, 9), -2, dtype=np.int64)
        for place in range(3):
            part = e[e[:, 7] == place]
            cols = slice(3 * place, 3 * place + 3)
            vals = part[:, [3, 4, 5]]
            rules[part[:, 1], part[:, 2], cols] = vals
            if not np.array_equal(rules[part[:, 1], part[:, 2], cols], vals):
                raise NotReplicable("a microbatch node reads or writes other tensors on "
                                    "another microbatch or size")
        present = rules[:, :, ::3] != -2
        if not (present == present[:, :, :1]).all():
            raise NotReplicable("microbatches have other numbers of entries")
        return rules

    def step_rules(self, entries: list[Array]) -> Array:
        """Rules of the step nodes' slots: a lineage at a + b N."""
        rows = []
        for e in entries:
            rows.append(e[e[:, 0] < 0])
        order = [np.lexsort((r[:, 2], r[:, 1])) for r in rows]
        rows = [r[o] for r, o in zip(rows, order)]
        if not all(len(r) == len(rows[0]) and np.array_equal(r[:, [1, 2, 3, 4]],
                                                              rows[0][:, [1, 2, 3, 4]])
                   for r in rows):
            raise NotReplicable("the step program reads or writes other tensors on another size")
        m = [r[:, 6] for r in rows]
        b = m[1] - m[0]
        a = m[0] - SIZES[0] * b
        if not np.array_equal(a + b * SIZES[2], m[2]):
            raise NotReplicable("the step program reads a microbatch that is not affine in "
                                "the microbatches")
        return np.concatenate((rows[0][:, [1, 2, 3, 4]], a[:, None], b[:, None]), axis=1)

    def order(self) -> tuple[Array, Array, Array]:
        """Nodes in output order, microbatch-major: the step nodes that
        precede every microbatch node of their rank, then microbatch 0,
        1, ..., N - 1 (each in the 3-plan's order of its template
        microbatch), then the other step nodes, all in the 3-plan's order.
        Returns (is_step, id, m)."""
        three = self.s[0]
        mb, rank = three.n_mb, three.n_rank
        idx = np.arange(len(mb))
        first = np.full(int(rank.max(initial=0)) + 1, len(mb), dtype=np.int64)
        np.minimum.at(first, rank[mb >= 0], idx[mb >= 0])
        front = (mb < 0) & (idx < first[rank])
        middle = np.flatnonzero(mb == 1)
        parts = [np.flatnonzero(front), np.flatnonzero(mb == 0),
                 np.tile(middle, self.nm - 2), np.flatnonzero(mb == 2),
                 np.flatnonzero((mb < 0) & ~front)]
        ms = [np.full(len(parts[0]), -1), np.zeros(len(parts[1]), dtype=np.int64),
              np.repeat(np.arange(1, self.nm - 1), len(middle)),
              np.full(len(parts[3]), self.nm - 1), np.full(len(parts[4]), -1)]
        nodes, m = np.concatenate(parts), np.concatenate(ms)
        return mb[nodes] < 0, self.node_id[0][nodes], m

    def entries(self, rules: Array, steps: Array, is_step: Array, nid: Array, m: Array,
                kind: str) -> tuple[Array, Array]:
        """Each node's entries (tensor indices, -1 absent) and their counts."""
        lin_count = (rules[:, :, 0] != -2).sum(axis=1)
        step_count = np.bincount(steps[:, 0], minlength=self.n_step)
        counts = np.where(is_step, step_count[np.where(is_step, nid, 0)],
                          lin_count[np.where(is_step, 0, nid)])
        owner, within = _runs(counts)
        # lineage entries
        lo = ~is_step[owner]
        ln, lm, lw = nid[owner[lo]], m[owner[lo]], within[lo]
        place = np.where(lm == 0, 1, np.where(lm == self.nm - 1, 2, 0))
        r = rules[ln, lw]
        kind_, ident, k = (r[np.arange(len(r)), 3 * place + j] for j in range(3))
        lin_idx = np.where(kind_ == 0, -1, self.tensor_index(ident, lm + k, kind_ == 1))
        if ((kind_ == 2) & ((lm + k < 0) | (lm + k >= self.nm))).any():
            raise NotReplicable(f"a microbatch node's {kind} fall outside the microbatches")
        # step entries: rows of ``steps`` in (node, slot) order
        st = is_step[owner]
        step_start = np.cumsum(step_count) - step_count
        srow = steps[step_start[nid[owner[st]]] + within[st]]
        sm = srow[:, 4] + srow[:, 5] * self.nm
        step_idx = np.where(srow[:, 2] == 0, -1,
                            self.tensor_index(srow[:, 3], sm, srow[:, 2] == 1))
        out = np.empty(len(owner), dtype=np.int64)
        out[lo] = lin_idx
        out[st] = step_idx
        return out, counts

    def nodes(self) -> tuple[NodeColumns, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        lin, steps = self.same_program()
        is_step, nid, m = self.order()
        n3 = self.s[0].cols.nodes
        src = np.where(is_step, steps[np.where(is_step, nid, 0)], lin[np.where(is_step, 0, nid)])
        ranks = n3.rank.astype(np.int64)[src]
        cols = {"rank": narrow(ranks), "mb": narrow(np.where(is_step, -1, m))}
        for name in ("op", "dir", "name", "kwargs"):
            cols[name] = getattr(n3, name)[src]
        in_rules, in_steps = self.references("in")
        out_rules, out_steps = self.references("out")
        ins, in_count = self.entries(in_rules, in_steps, is_step, nid, m, "inputs")
        outs, out_count = self.entries(out_rules, out_steps, is_step, nid, m, "outputs")
        cols["in_start"] = narrow(np.cumsum(in_count) - in_count)
        cols["in_count"] = narrow(in_count)
        cols["inputs"] = narrow(ins)
        off = np.zeros(len(out_count) + 1, dtype=np.int64)
        np.cumsum(out_count, out=off[1:])
        cols["out_off"] = narrow(off)
        cols["outputs"] = narrow(outs)
        c3 = self.s[0].cols
        return NodeColumns(**cols), c3.ops, c3.names, c3.kwargs


def real_logical(smalls: list[Columns], nm: int) -> tuple[Logical, ...]:
    """The logical tensors at ``nm`` microbatches: batch dims grow linearly
    with the microbatches (fitted from 3 and 4, checked on 5)."""
    out = []
    for rows in zip(*(s.logical for s in smalls), strict=True):
        a, b, c = rows
        if len({(x.name, x.kind, len(x.shape)) for x in rows}) != 1:
            raise NotReplicable(f"logical tensor {a.name} differs between sizes")
        grow = [y - x for x, y in zip(a.shape, b.shape)]
        if [x + 2 * g for x, g in zip(a.shape, grow)] != list(c.shape):
            raise NotReplicable(f"logical tensor {a.name} does not grow linearly")
        out.append(Logical(a.name, tuple(x + g * (nm - SIZES[0]) for x, g in zip(a.shape, grow)),
                           a.kind))
    return tuple(out)


def expand_microbatches(smalls: list[Columns], nm: int, world: dict) -> Columns:
    """The columns of the run at ``nm`` microbatches (more than 5) from its
    plans at 3, 4 and 5 (``smalls``, in that order): see the module docstring."""
    if nm <= max(SIZES) or [int(s.world.get("nm", 1)) for s in smalls] != list(SIZES):
        raise NotReplicable(f"expands plans of {SIZES} microbatches to more than {max(SIZES)}")
    first = smalls[0]
    if any((s.loss, s.grads) != (first.loss, first.grads) for s in smalls[1:]):
        raise NotReplicable("the loss or gradients differ between sizes")
    logical = real_logical(smalls, nm)
    ex = _Expander([_Small(c, n) for c, n in zip(smalls, SIZES)], nm)
    tensors = ex.tensors()
    nodes, ops, names, kwargs = ex.nodes()
    return Columns(world=dict(world), logical=logical, loss=first.loss,
                   grads=dict(first.grads), tensors=tensors, nodes=nodes, ops=ops,
                   names=names, kwargs=kwargs)
