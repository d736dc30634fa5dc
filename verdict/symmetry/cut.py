"""The representatives' cut: a checked materialized plan's shown blocks as a folded plan.

After the block check (verdict/symmetry/blocks.py) found every block equal
to its class's representative, :class:`Cut` takes out two replicas and two
microbatches (of the base class, or a base one beside a class's
representative: the per-class cut) with their step programs and the glue
cut to the shown chain ends, renumbered as a folded plan that the folded
pipeline proves; ZeRO's owned shards give way to the values they stand for
(verdict/symmetry/owned.py). docs/soundness.md, "Materialized plans: the
symmetry found and checked", holds the argument.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from verdict.columns import Columns, drop_pages
from verdict.lineage import StructureError
from verdict.ops import get_op
from verdict.plan import DIRECTIONS, FOLD_KEYS, UNIT, Node, Plan, Slices, Tensor, lowest
from verdict.symmetry.arrays import chunks, spans
from verdict.symmetry.blocks import BlockCheck
from verdict.symmetry.fold import Fold, FoldError
from verdict.symmetry.rules import ACCUMULATE, inner_size

PlanLike = Plan | Columns
#: an input of the cut's sub plan held by a replica the cut does not show
#: (``Cut.drop_foreign`` takes it out)
FOREIGN = -2
#: How an n-way partial sum numbers the blocks: digit names major first, and
#: the size of digit b (see ``Cut.part_layout``)
Layout = tuple[tuple[str, ...], int]


def layout_view(cols: Columns) -> Plan:
    """The load-time facts ``check_layout`` reads, as a plan without nodes:
    the data and tokens tensors no node writes. A rank beyond the world's
    layout is a layout finding."""
    w = cols.world
    size = 1
    for k in ("pp", "dp", "cp", "tp"):
        size *= int(w.get(k, 1))
    t = cols.tensors
    top = int(max(t.rank.max(initial=0), cols.nodes.rank.max(initial=0)))
    if top >= size:
        raise StructureError("layout", f"rank {top} is outside the world's layout of "
                                       f"pp*dp*cp*tp = {size} ranks")
    written = cols.written()
    kinds = np.array([lg.kind in ("data", "tokens") for lg in cols.logical] or [False])
    data = np.flatnonzero(kinds[t.tid] & ~written)
    return Plan(world=dict(w), logical=list(cols.logical), tensors=tensor_rows(cols, data),
                loss=cols.loss, grads=dict(cols.grads))


def tensor_rows(cols: Columns, picked: np.ndarray, off: np.ndarray | None = None
                ) -> list[Tensor]:
    """The Tensor rows of the tensors ``picked`` (cost in their number, but
    for the slice offsets ``off`` when not given)."""
    t = cols.tensors
    off = t.slice_offsets(cols.logical) if off is None else off
    slices = t.slices.view(np.ndarray)  # not a memmap: indexed once per tensor
    rows = []
    scales = _gathered(t.scale, picked) if t.scale is not None else [UNIT] * len(picked)
    fields = zip(*(_gathered(a, picked) for a in (t.rank, t.mb, t.tid, t.version, t.lver,
                                                  t.parts)),
                 off[picked].tolist(), off[picked + 1].tolist(), scales)
    for rank, mb, tid, version, lver, parts, a, b, scale in fields:
        sl = tuple(tuple(x) for x in slices[a:b].tolist())
        rows.append(Tensor(rank, mb, tid, version, tuple(e - s for s, e in sl), lver, sl,
                           tuple(parts), lowest(*scale)))
    drop_pages(t.slices)
    return rows


def _gathered(column: np.ndarray, picked: np.ndarray) -> list:
    """``column[picked]`` as a list; a mapped column's pages are let go after
    (the picked rows are spread over the whole file)."""
    out = column[picked].tolist()
    drop_pages(column)
    return out


def columns_sub_plan(cols: Columns, nodes: np.ndarray, tensors: np.ndarray,
                     slice_off: np.ndarray | None = None) -> Plan:
    """The plan of ``nodes`` and the ``tensors`` they touch (sorted), with
    only those made into Python objects (``Columns.to_plan`` numbers them
    alike but reads every node); ``slice_off``: the tensors' slice offsets
    when the caller holds them (else computed for every tensor)."""
    n = cols.nodes
    inputs, outputs = n.inputs.view(np.ndarray), n.outputs.view(np.ndarray)
    renum = {t: k for k, t in enumerate(tensors.tolist())}
    kwargs: dict[int, dict] = {}
    out = []
    fields = zip(nodes.tolist(), *(_gathered(a, nodes) for a in (
        n.rank, n.mb, n.op, n.dir, n.kwargs, n.name, n.in_start, n.in_count)),
        n.out_off[nodes].tolist(), _gathered(n.out_off, nodes + 1))
    for _, rank, mb, op, dr, kw, name, start, count, o0, o1 in fields:
        if kw not in kwargs:
            kwargs[kw] = cols.kwargs_of(kw)
        ins = tuple(renum.get(x, FOREIGN) if x >= 0 else -1
                    for x in inputs[start:start + count].tolist())
        outs = tuple(renum[x] if x >= 0 else -1 for x in outputs[o0:o1].tolist())
        out.append(Node(rank, mb, cols.ops[op], DIRECTIONS[dr], ins, outs, dict(kwargs[kw]),
                        cols.names[name]))
    drop_pages(inputs, outputs)
    return Plan(world=dict(cols.world), logical=list(cols.logical),
                tensors=tensor_rows(cols, tensors, slice_off), nodes=out, loss=cols.loss,
                grads=dict(cols.grads))


class Cut:
    """The representatives of a checked plan as a folded plan: the ranks of
    the shown replicas renumbered to a mesh of ``fold.dp`` replicas, their
    shown microbatches and step programs, glue cut to the shown chain ends,
    batch rows and block parts moved to the shown blocks. Only these nodes
    become Node objects (``Columns.to_plan``)."""

    def __init__(self, parallel: PlanLike, check: BlockCheck, fold: Fold,
                 replicas: tuple[int, ...] | None = None,
                 microbatches: tuple[int, ...] | None = None):
        self.check, self.fold, self.source = check, fold, parallel
        #: position among the shown replicas of each replica, -1 when not shown
        self.pos = _positions(fold.real_dp, fold.dp, replicas)
        #: likewise among the shown microbatches
        self.pos_m = _positions(fold.real_nm, fold.nm, microbatches)
        w = parallel.world
        self.tp, self.cp = int(w.get("tp", 1)), inner_size(w)  # cp: ep x cp inner ranks
        self.ep = int(w.get("ep", 1))
        self.batch = check.batch
        self.rows = check.rows
        cols = check.cols
        # ZeRO-1's gathers give way to their value, the loaded parameter, and
        # its keeps are dropped: the cut is a plain data-parallel plan
        # (docs/soundness.md, "ZeRO-1: owned shards")
        nodes = self.shown_nodes()
        read = cols.flat[spans(cols.ptr, cols.n_ins[nodes])]
        read = read[read >= 0]
        # the orbit's collectives read every replica's tensor: those of
        # replicas not shown are left out of the cut (FOREIGN, _drop_foreign)
        read = read[self.pos[check.t_d[read]] >= 0]
        written = cols.flat[spans(cols.ptr, cols.n_outs[nodes])]
        rewired = [t for i in nodes.tolist() for t in check.owned.rewire.get(i, {}).values()]
        used = np.concatenate((read, written, np.array(rewired, dtype=written.dtype)))
        #: plan tensor of each tensor of ``self.p`` (as Columns.to_plan numbers them)
        self.orig = np.unique(used[used >= 0])
        self.p = (columns_sub_plan(parallel, nodes, self.orig, cols.slice_off)
                  if isinstance(parallel, Columns) else _sub_plan(parallel, nodes, self.orig))
        self.d = check.t_d[self.orig]  # replica of each tensor of self.p
        self.gathered = check.owned.gathered[self.orig]  # loaded parameters in the cut
        owned = check.owned
        #: node of self.p -> position -> tensor of self.p: an optimizer step on
        #: owned shards runs on the whole box in the cut
        self.rewire = {k: {pos: self.local(t) for pos, t in owned.rewire[i].items()}
                       for k, i in enumerate(nodes.tolist()) if i in owned.rewire}
        self.drop_foreign()
        #: tensor of self.p -> the box its shard widens to
        self.widen = {k: owned.widen[t] for k, t in enumerate(self.orig.tolist())
                      if t in owned.widen}
        #: ZeRO-3 gathers each use: one loaded parameter per (rank, parameter)
        self.canon: dict[int, int] = {}
        first: dict[tuple[int, int], int] = {}
        for k in np.flatnonzero(self.gathered).tolist():
            x = self.p.tensors[k]
            self.canon[k] = first.setdefault((x.rank, x.tid), k)
        # ZeRO-2/3 ("ZeRO-2 and ZeRO-3: reduce-scattered shards"): a scatter's
        # output gives way to its own input, the block's whole-box value, and
        # each chain of scattered shards is widened to the box, its end
        # summed over the shown replicas by a reducer of the cut
        self.subst = {k: self.local(owned.scattered[t]) for k, t in enumerate(self.orig.tolist())
                      if t in owned.scattered}
        self.reduced = owned.reduced
        for k, x in enumerate(self.p.tensors):
            if (x.rank, x.tid) in self.reduced:
                self.widen[k] = self.reduced[(x.rank, x.tid)]
        self.starts = self.block_starts()
        self.layouts: dict[int, Layout | None] = {}
        self.single_parts = self.own_parts()

    def shown_nodes(self) -> np.ndarray:
        """The nodes of the shown replicas and microbatches (steps and glue
        of the shown replicas too), but for ZeRO's gathers (in-block ones too) and keeps,
        picked a chunk of nodes at a time: the cut's cost in memory is that
        of what it shows, not of the plan."""
        check, picked = self.check, []
        n_d, dropped = check.n_d, check.owned.dropped  # each made once
        for a, b in chunks(len(n_d)):
            mb = check.cols.n_mb[a:b]
            keep = (self.pos[n_d[a:b]] >= 0) & ~dropped[a:b] & (
                (mb < 0) | (self.pos_m[np.maximum(mb, 0)] >= 0))
            picked.append(np.flatnonzero(keep) + a)
        return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)

    def drop_foreign(self) -> None:
        """Leave the tensors of replicas not shown (FOREIGN in ``self.p``)
        out of the inputs of the orbit's collectives outside microbatches,
        their ``index`` moved along, as :meth:`plan` does with any input of
        a replica not shown; any other node that reads one reads another
        replica's tensor (FoldError). Done here, so that the cut never
        makes those tensors into objects: a collective over dp replicas
        reads dp of them."""
        p = self.p
        for i, node in enumerate(p.nodes):
            if FOREIGN not in node.inputs:
                continue
            index = node.kwargs.get("index")
            if not (get_op(node.op).group and node.mb < 0) or i in self.rewire or (
                    isinstance(index, int) and node.inputs[index] == FOREIGN):
                raise FoldError(f"{label_of(p, i)} reads another replica's tensor")
            kwargs = dict(node.kwargs)
            if isinstance(index, int):
                kwargs["index"] = index - node.inputs[:index].count(FOREIGN)
            p.nodes[i] = node._replace(inputs=tuple(t for t in node.inputs if t != FOREIGN),
                                       kwargs=kwargs)

    def local(self, t: int) -> int:
        """The index in ``self.p`` of plan tensor ``t``, -1 when it holds none."""
        k = int(np.searchsorted(self.orig, t))
        return k if k < len(self.orig) and self.orig[k] == t else -1

    # -- ranks and blocks ------------------------------------------------------
    def new_rank(self, rank: int) -> int | None:
        (stage, c, t), real = self.check.mesh.split(rank)
        d = int(self.pos[real])
        if d < 0:
            return None
        return ((stage * self.fold.dp + d) * self.cp + c) * self.tp + t

    def new_mb(self, mb: int) -> int | None:
        """A microbatch's number in the cut (None: not shown); -1 stays."""
        if mb < 0:
            return mb
        k = int(self.pos_m[mb])
        return k if k >= 0 else None

    def block_starts(self) -> dict[tuple[int, int], int]:
        """(replica, microbatch) -> its first batch row in the plan, the same
        in every class that loads data (else the cut is refused)."""
        starts: dict[tuple[int, int], int] = {}
        for (_, d, m), row in self.check.offset.items():
            if row < 0:
                continue
            if starts.setdefault((d, m), row) != row:
                raise FoldError(f"replica {d}, microbatch {m} starts at different rows in "
                                f"different rank classes")
        return starts

    def new_start(self) -> dict[int, int]:
        """Plan row of a shown block's start -> its row in the folded plan:
        the shown blocks in their order, b rows apart from 0."""
        shown = sorted(row for (d, m), row in self.starts.items()
                       if self.pos[d] >= 0 and self.pos_m[m] >= 0)
        return {row: k * self.rows for k, row in enumerate(shown)}

    def part_layout(self, n: int) -> Layout | None:
        """How an n-way partial sum over the K = dp x nm blocks numbers them:
        the part index as digits (replica d, microbatch m, and the rest of
        size R = n / K as two digits a and b, r = a (R / b') + b with b' a
        divisor of R: a context-parallel index before the microbatch and a
        balanced chunk after it) in some order, major first; the first
        layout under which every single-part claim of a shown block's own
        tensors names its own d and m. None when none fits (the cut is then
        refused). Claims are what stages prove, so a layout chosen here can
        cost a proof, never soundness."""
        if n not in self.layouts:
            rest = n // (self.fold.real_dp * self.fold.real_nm)
            fits = [(order, b) for b in range(1, rest + 1) if rest % b == 0
                    for order in itertools.permutations("dmab")
                    if all(self.digits((order, b), n, lo, real=True)[:2] == block
                           for block, lo in self.single_parts.get(n, ()))]
            self.layouts[n] = fits[0] if fits else None
        return self.layouts[n]

    def digits(self, layout: Layout, n: int, i: int, real: bool) -> tuple[int, ...]:
        """(d, m, a, b) of part i of n under ``layout``."""
        size = self.radix(layout, n, real)
        out = {}
        for name in reversed(layout[0]):
            i, out[name] = divmod(i, size[name])
        return out["d"], out["m"], out["a"], out["b"]

    def radix(self, layout: Layout, n: int, real: bool) -> dict[str, int]:
        rest = n // (self.fold.real_dp * self.fold.real_nm)
        b = layout[1]
        if real:
            return {"d": self.fold.real_dp, "m": self.fold.real_nm, "a": rest // b, "b": b}
        return {"d": self.fold.dp, "m": self.fold.nm, "a": rest // b, "b": b}

    def own_parts(self) -> dict[int, list[tuple[tuple[int, int], int]]]:
        """n -> (block, part) of every single-part claim of n parts (n a
        multiple of K) made by a shown block's own tensors."""
        k = self.fold.real_dp * self.fold.real_nm
        out: dict[int, list] = {}
        for node in self.p.nodes:
            if node.mb < 0 or node.op == ACCUMULATE:
                continue
            block = (self.check.mesh.split(node.rank)[1], node.mb)
            for o in node.outputs:
                if o >= 0:
                    lo, hi, n = self.p.tensors[o].parts
                    if n > 1 and n % k == 0 and hi - lo == 1:
                        out.setdefault(n, []).append((block, lo))
        return out

    # -- tensors -----------------------------------------------------------------
    def slices(self, t: Tensor, start: dict[int, int]) -> Slices:
        full, shown = self.fold.real_gbs, self.fold.gbs
        out = list(t.slices)
        for k in self.batch.get(t.tid, ()):
            if k >= len(out):
                continue
            a, b = out[k]
            if (a, b) == (0, full):
                out[k] = (0, shown)
                continue
            base = next((row for row in start if row <= a and b <= row + self.rows), None)
            if base is None:
                raise FoldError(f"{self.p.logical[t.tid].name} holds rows [{a}, {b}) outside "
                                f"one shown block")
            out[k] = (start[base] + a - base, start[base] + b - base)
        return tuple(out)

    def parts(self, t: Tensor, running: bool = False) -> tuple[int, int, int]:
        """A claim's parts moved to the shown blocks (see part_layout). A
        ``running`` buffer (an accumulation's output, relinked in the cut)
        claims the blocks of the shown microbatches it sums: its parts of
        unshown blocks are dropped (a claim is what a stage proves, so this
        can cost a proof, never soundness)."""
        lo, hi, n = t.parts
        k = self.fold.real_dp * self.fold.real_nm
        if n <= 1 or n % k:
            return t.parts
        layout = self.part_layout(n)
        if layout is None:
            raise FoldError(f"{self.p.logical[t.tid].name}'s parts ({n}-way) number the blocks "
                            f"in no way the cut can follow")
        size = self.radix(layout, n, real=False)
        image = []
        for i in range(lo, hi):
            d, m, a, b = self.digits(layout, n, i, real=True)
            if running and self.pos[d] >= 0 and self.pos_m[m] < 0:
                continue
            if self.pos[d] < 0 or self.pos_m[m] < 0:
                raise FoldError(f"{self.p.logical[t.tid].name} claims parts of unshown blocks")
            value = {"d": int(self.pos[d]), "m": int(self.pos_m[m]), "a": a, "b": b}
            code = 0
            for name in layout[0]:
                code = code * size[name] + value[name]
            image.append(code)
        if not image or sorted(image) != list(range(min(image), min(image) + len(image))):
            raise FoldError(f"{self.p.logical[t.tid].name}'s parts are not contiguous among the "
                            f"shown blocks")
        return (min(image), min(image) + len(image), size["d"] * size["m"] * size["a"] * size["b"])

    # -- the folded plan ---------------------------------------------------------
    def chain_ends(self) -> tuple[dict[int, int], dict[int, Tensor]]:
        """A chain's end in the plan -> its end after the last shown
        microbatch, both as tensors of ``self.p``; and the plan's end each
        shown end stands for (whose claim it takes when that is the whole
        gradient: the last shown microbatch completes the shown blocks)."""
        last = int(np.flatnonzero(self.pos_m == self.fold.nm - 1)[0])
        ends, claims = {}, {}
        for node in self.p.nodes:
            if node.op == ACCUMULATE and node.mb == last:
                out = node.outputs[0]
                x = self.p.tensors[out]
                real = self.check.chain_end[(node.rank, x.tid)]
                if (node.rank, x.tid) not in self.reduced:  # else a reducer follows
                    claims[out] = real
                end = self.local(real)
                if end >= 0:  # read by a step node the representatives keep
                    ends[end] = out
        return ends, dict(zip(claims, self.source_tensors(list(claims.values()))))

    def reducers(self, ends: dict[int, int]) -> dict[int, list[Node]]:
        """ZeRO-2/3: node of ``self.p`` -> the reducers the cut runs after it:
        each shown chain end of a reduced buffer (widened to its box) summed
        over the shown replicas of its rank class (scattered in two levels:
        of every ep rank of it), at its own position; the
        real chain end, read by the optimizer step, becomes the sum
        (``ends`` updated), as the keep's reducer of ZeRO-1."""
        if not self.reduced:
            return {}
        last = int(np.flatnonzero(self.pos_m == self.fold.nm - 1)[0])
        groups: dict[tuple, list[tuple[int, int, int, int]]] = {}
        stride = int(self.source.world.get("cp", 1)) * self.tp  # between two ep ranks
        for i, node in enumerate(self.p.nodes):
            x = self.p.tensors[node.outputs[0]] if node.outputs else None
            if node.op == ACCUMULATE and node.mb == last and (node.rank, x.tid) in self.reduced:
                # two levels ("ZeRO-2 and ZeRO-3 with expert parallelism"): every
                # ep rank of the shown replicas, replica-major
                two = (node.rank, x.tid) in self.check.owned.reduced_ep
                e = node.rank // stride % self.ep if two else 0
                cls, d = self.check.mesh.split(node.rank - e * stride)
                groups.setdefault((cls, x.tid, two), []).append((d, e, i, node.outputs[0]))
        after: dict[int, list[Node]] = {}
        for (_, tid, two), members in groups.items():
            members.sort()
            ep = self.ep if two else 1
            if len(members) != self.fold.dp * ep or \
                    {e for _, e, _, _ in members} != set(range(ep)):
                raise FoldError(f"the chains of {self.p.logical[tid].name} are not shown on "
                                f"every shown replica")
            shown = tuple(out for _, _, _, out in members)
            for pos, (_, _, i, out) in enumerate(members):
                end = self.p.tensors[out]
                box = tuple(tuple(ab) for ab in self.reduced[(end.rank, tid)])
                self.p.tensors.append(end._replace(
                    mb=-1, version=end.version + 1, shape=tuple(b - a for a, b in box),
                    slices=box, parts=(0, 1, 1), scale=UNIT))
                total = len(self.p.tensors) - 1
                real = self.local(self.check.chain_end[(end.rank, tid)])
                if real >= 0:
                    ends[real] = total
                after[i] = [*after.get(i, ()), Node(
                    end.rank, -1, "reducer", "none", shown, (total,), {"index": pos},
                    f"{self.p.logical[tid].name}.reduce")]
        return after

    def running_claim(self, node: Node) -> tuple[int, int, int]:
        """ZeRO-2/3: what a widened running buffer claims in the plan's own
        numbering: the blocks (its replica, microbatches 0..m) its chain has
        summed by microbatch m, the parts of its contribution's block with the
        microbatch digit run over 0..m (moved by ``parts`` as any claim)."""
        v = self.p.tensors[node.inputs[1]]
        lo, hi, n = v.parts
        layout = self.part_layout(n) if n > 1 and n % (self.fold.real_dp *
                                                       self.fold.real_nm) == 0 else None
        if layout is None:
            raise FoldError(f"{self.p.logical[v.tid].name}'s claim numbers no blocks")
        size = self.radix(layout, n, real=True)
        codes = set()
        for i in range(lo, hi):
            d, _, a, b = self.digits(layout, n, i, real=True)
            for m in range(node.mb + 1):
                value = {"d": d, "m": m, "a": a, "b": b}
                code = 0
                for name in layout[0]:
                    code = code * size[name] + value[name]
                codes.add(code)
        if sorted(codes) != list(range(min(codes), min(codes) + len(codes))):
            raise FoldError(f"the running sum of {self.p.logical[v.tid].name} is not contiguous")
        return min(codes), min(codes) + len(codes), n

    def relinks(self) -> dict[int, int]:
        """Node of ``self.p`` -> the buffer its accumulation reads in the
        cut: the chain's zeros buffer for the first shown microbatch, the
        previous shown microbatch's output for the others (what they read
        already when microbatches 0 and 1 are shown)."""
        chains: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i, node in enumerate(self.p.nodes):
            if node.op == ACCUMULATE and node.mb >= 0:
                key = (node.rank, self.p.tensors[node.outputs[0]].tid)
                chains.setdefault(key, []).append((int(self.pos_m[node.mb]), i))
        out = {}
        for key, accs in chains.items():
            accs.sort()
            zeros = self.local(self.check.chain_start.get(key, -1))
            if zeros < 0:
                raise FoldError(f"the chain of {self.p.logical[key[1]].name} on rank {key[0]} "
                                f"starts from no buffer the representatives hold")
            previous = zeros
            for _, i in accs:
                out[i] = previous
                previous = self.p.nodes[i].outputs[0]
        return out

    def source_tensors(self, ts: list[int]) -> list[Tensor]:
        if isinstance(self.source, Plan):
            return [self.source.tensors[t] for t in ts]
        return tensor_rows(self.source, np.array(ts, dtype=np.int64), self.check.cols.slice_off)

    def plan(self) -> tuple[Plan, dict[int, int]]:
        p, fold = self.p, self.fold
        ends, claims = self.chain_ends()
        shown = self.pos[self.d] >= 0
        relinks = self.relinks()
        running = {p.nodes[i].outputs[0] for i in relinks}
        claim_of = {p.nodes[i].outputs[0]: self.running_claim(
            p.nodes[i]._replace(inputs=tuple(self.subst.get(t, t) for t in p.nodes[i].inputs)))
            for i in relinks if p.nodes[i].outputs[0] in self.widen}
        after = self.reducers(ends)
        shown = np.concatenate((shown, np.ones(len(p.tensors) - len(shown), dtype=bool)))
        nodes = []
        for i, node in enumerate(p.nodes):
            ins = [self.canon.get(t, t) for t in (ends.get(t, t) for t in
                                                  (self.subst.get(t, t) for t in node.inputs))]
            if i in relinks:
                ins[0] = relinks[i]
            for pos, t in self.rewire.get(i, {}).items():
                ins[pos] = self.canon.get(ends.get(t, t), ends.get(t, t))
            kwargs = dict(node.kwargs)
            for key in ("src", "dst"):  # peers are in the replica (checked): renumbered
                peer = kwargs.get(key)
                if node.op == "send_recv" and isinstance(peer, int) and \
                        self.new_rank(peer) is not None:
                    kwargs[key] = self.new_rank(peer)
            if any(t >= 0 and not shown[t] for t in node.inputs):
                if not (get_op(node.op).group and node.mb < 0):
                    raise FoldError(f"{label_of(p, i)} reads another replica's tensor")
                own = node.inputs[kwargs["index"]] if isinstance(kwargs.get("index"), int) else -1
                ins = [e for t, e in zip(node.inputs, ins) if t < 0 or shown[t]]
                if own >= 0:
                    kwargs["index"] = ins.index(ends.get(own, own))
            if node.op == "zeros" and node.outputs[0] in self.widen:
                kwargs["shape"] = [b - a for a, b in self.widen[node.outputs[0]]]
            nodes.append(node._replace(rank=self.new_rank(node.rank), mb=self.new_mb(node.mb),
                                       inputs=tuple(ins), kwargs=kwargs))
            nodes.extend(r._replace(rank=self.new_rank(r.rank)) for r in after.get(i, ()))
        used = sorted({t for n in nodes for t in (*n.inputs, *n.outputs) if t >= 0})
        index = {t: k for k, t in enumerate(used)}
        start = self.new_start()
        tensors, rank_of = [], {}
        for t in used:
            x = p.tensors[t]
            if t < len(self.gathered) and self.gathered[t]:  # a loaded parameter in the cut
                x = x._replace(version=0, mb=-1)
            if self.new_mb(x.mb) is None or not shown[t]:
                raise FoldError(f"the representatives read {p.logical[x.tid].name} of rank "
                                f"{x.rank}, microbatch {x.mb}, which they do not hold")
            rank = self.new_rank(x.rank)
            rank_of[rank] = x.rank
            if t in claims and claims[t].is_whole():  # the whole gradient, no reducer after
                real = claims[t]
                x = x._replace(lver=real.lver, slices=real.slices, parts=real.parts,
                               scale=real.scale)
            if t in claim_of:
                x = x._replace(parts=claim_of[t])
            if t in self.widen:
                box = tuple(tuple(ab) for ab in self.widen[t])
                x = x._replace(slices=box, shape=tuple(b - a for a, b in box))
            tensors.append(x._replace(rank=rank, mb=self.new_mb(x.mb), slices=self.slices(x, start),
                                      parts=self.parts(x, t in running)))
        nodes = [n._replace(inputs=tuple(index[t] if t >= 0 else -1 for t in n.inputs),
                            outputs=tuple(index[t] if t >= 0 else -1 for t in n.outputs))
                 for n in nodes]
        if after:  # a reducer reads chain ends of ranks that come later
            nodes = _in_dataflow_order(nodes)
        world = {**p.world, "dp": fold.dp * self.ep, "nm": fold.nm, "gbs": fold.gbs,
                 **dict(zip(FOLD_KEYS, (fold.real_dp * self.ep, fold.real_nm, fold.real_gbs)))}
        if self.gathered.any():
            world["zero"] = 0  # no shard left in the cut
        folded = Plan(world=world, logical=list(p.logical), tensors=tensors, nodes=nodes,
                      loss=p.loss, grads=dict(p.grads))
        return folded, rank_of


def _in_dataflow_order(nodes: list[Node]) -> list[Node]:
    """``nodes`` in their order but that a node waits for the producers of
    its inputs (a stable topological order: a plan lists its nodes in an
    order that can run, which the cut's reducers, placed after their own
    chain's end, can break for the other shown replicas' ends)."""
    made = {t: i for i, n in enumerate(nodes) for t in n.outputs if t >= 0}
    waits = [sorted({made[t] for t in n.inputs if t in made and made[t] != i})
             for i, n in enumerate(nodes)]
    blocks: dict[int, list[int]] = {}
    for i, deps in enumerate(waits):
        for j in deps:
            blocks.setdefault(j, []).append(i)
    left = [len(deps) for deps in waits]
    ready = [i for i, k in enumerate(left) if k == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(nodes[i])
        for j in blocks.get(i, ()):
            left[j] -= 1
            if not left[j]:
                heapq.heappush(ready, j)
    if len(out) != len(nodes):
        raise FoldError("the cut's nodes form a cycle")
    return out


def _positions(real: int, shown: int, picked: tuple[int, ...] | None) -> np.ndarray:
    """Position of each of ``real`` indices among the ``shown`` picked ones
    (0..shown-1 when None), -1 for the others."""
    pos = np.full(real, -1, dtype=np.int32)
    pos[list(range(shown)) if picked is None else sorted(picked)] = np.arange(shown)
    return pos


def _sub_plan(plan: Plan, nodes: np.ndarray, tensors: np.ndarray) -> Plan:
    """The plan of ``nodes`` and the ``tensors`` they touch (sorted), numbered
    as ``Columns.to_plan`` numbers them; every field of a tensor kept."""
    index = {t: k for k, t in enumerate(tensors.tolist())}

    def local(ts: tuple[int, ...], absent: int | None = None) -> tuple[int, ...]:
        return tuple((index[t] if absent is None else index.get(t, absent)) if t >= 0 else -1
                     for t in ts)

    return Plan(world=dict(plan.world), logical=list(plan.logical),
                tensors=[plan.tensors[t] for t in tensors.tolist()],
                nodes=[plan.nodes[i]._replace(inputs=local(plan.nodes[i].inputs, FOREIGN),
                                              outputs=local(plan.nodes[i].outputs))
                       for i in nodes.tolist()],
                loss=plan.loss, grads=dict(plan.grads))


def label_of(plan: Plan, i: int) -> str:
    n = plan.nodes[i]
    return f"node (rank {n.rank}, mb {n.mb}, {n.op} {n.dir} '{n.name}')"
