"""One rank's lowered trace aligned with the single-device step: the
parts of ``tracer/align/`` joined into one object, with the tables they
share (claims, matches, copies, pending sums). ``tracer/build.py`` makes one
per rank and writes the parallel plan from them."""

from __future__ import annotations

from dataclasses import replace

from backends.torch.lowering import LNode, Lowered
from backends.torch.tracer.align.claim import DP_SUBAXES, Claim, rank_coords
from backends.torch.tracer.align.collectives import Collectives
from backends.torch.tracer.align.dims import Dims
from backends.torch.tracer.align.inputs import InputMatching
from backends.torch.tracer.align.loose import Loose
from backends.torch.tracer.align.messages import Messages
from backends.torch.tracer.align.nodes import NodeMatching
from backends.torch.tracer.align.rechoice import Rechoice
from backends.torch.tracer.align.recut import Recuts
from backends.torch.tracer.align.ring import Ring
from backends.torch.tracer.align.rows import Rows
from backends.torch.tracer.align.strided import Strided
from backends.torch.tracer.align.sums import Sums
from backends.torch.tracer.align.zeros import Zeros
from backends.torch.tracer.single_plan import Builder


class AlignedRank(InputMatching, NodeMatching, Collectives, Rows, Sums, Zeros, Dims, Ring, Loose,
            Recuts, Strided, Messages, Rechoice):
    """Alignment and claims of one rank's lowered trace (its parts:
    ``tracer/align/``)."""

    def __init__(self, b: Builder, low: Lowered, sizes: dict[str, int]):
        # the rank's own copy of its coordinates and shapes (fresh values
        # are added to its shapes): the lowered trace is left as it is
        low = replace(low, coords=rank_coords(low.coords, sizes), shapes=dict(low.shapes))
        self.b, self.low, self.sizes = b, low, sizes
        #: the atomic axes "dp" stands for (HSDP: its sub-axes)
        self.dp = list(DP_SUBAXES) if "dps" in sizes else ["dp"]
        self.axes = (*self.dp, "cp", "tp")
        #: the order of part numbering of a partial sum (microbatches fastest,
        #: as in docs/parallelism.md "Partial-sum part numbering")
        self.part_axes = (*self.dp, "cp", "tp", "step", "mb")
        self.sv: dict[int, int] = {}  # P value -> S value
        self.claim: dict[int, Claim] = {}
        self.used: set[tuple[int, int]] = set()  # (microbatch, S node) matched
        self.pending: dict[int, list[int]] = {}  # P value -> P leaves of a deferred sum
        self.mb: dict[int, int] = {}  # P value -> its microbatch (-1: none)
        #: a constant's copy for one microbatch -> the constant (``per_microbatch``)
        self.split_from: dict[int, int] = {}
        self.fresh = 10**9
        self.own_tid: dict[int, int] = {}  # a constant of this rank only -> its logical tensor
        #: a constant equal to the slice of several single-device constants ->
        #: all of them (each a true claim), until a reader chooses one
        self.alternatives: dict[int, list[tuple[int, Claim]]] = {}
        #: every match of such a constant, kept after a reader chose (a later
        #: reader may read a copy matched otherwise: ``choose_constants``; or be
        #: matched again where it matched nothing: ``Rechoice``, item 100)
        self.matches: dict[int, list[tuple[int, Claim]]] = {}
        self.copies: list[int] = []  # such copies, not written yet (the writer writes them)
        #: (constant, its copy, the reader given it) made by ``Rechoice`` (item 100)
        self.copied: list[tuple[int, int, LNode]] = []
        #: a constant equal to a single-device constant's slice at several
        #: cuts -> that constant -> every true claim (``Recuts``, item 68)
        self.recuts: dict[int, dict[int, list[Claim]]] = {}
        # a value matched with one of several single-device nodes of one key
        # (equal values: the same op on the same inputs), not read yet -> the
        # others' outputs; its first reader may take any of them
        self.twins: dict[int, list[int]] = {}
        self.retagged: list[int] = []  # values whose match a twin replaced (the writer retags)
        #: values whose claim changed after they were written: constants of this
        #: rank only whose claim a reader set (``stand_in_piece``), values a
        #: constant's re-cut changed (``Recuts.settle``)
        self.reclaimed: list[int] = []
        self.pieced: set[int] = set()  # every such constant
        self.stood: set[int] = set()  # outputs standing in for a value (``stands_in``)
        self.strided_loose: dict[int, int] = {}
        self.undone: set[int] = set()  # reshapes left out, every reader undoing them
        self.made_at: dict[int, int] | None = None  # single-device value -> its node (claimed_alike)
        self.fw_readers: dict[int, list[int]] | None = None  # value -> forward readers' outputs
        self.alike = False  # a claim of ``claimed_alike`` made on this rank
        self.consumers: dict[int, list[LNode]] = {}
        self.producer: dict[int, LNode] = {o: node for node in low.nodes for o in node.outs}
        self.zero_memo: dict[int, bool] = {}  # value -> exactly zero by its making
        self.sent = {}  # a received value -> what it was sent as (``Messages``)
        self.misdelivered: list[int] = []  # received values read as another message
        self.read_at: dict[int, str] = {}
        for node in low.nodes:
            for v in node.ins:
                if v >= 0:
                    self.consumers.setdefault(v, []).append(node)
        #: exact zeros only all-reduced (a rank that counts no term of a sum:
        #: lowering/norm_sums), no term of the sum (``sum_across``)
        self.zeros = {node.outs[0] for node in low.nodes
                      if node.op == "zeros" and not node.ins and not low.shapes[node.outs[0]]
                      and node.outs[0] not in low.empty_sums and self.consumers.get(node.outs[0])
                      and all(c.op == "all_reduce" for c in self.consumers[node.outs[0]])}
        self.match_inputs()

    def step(self, node: LNode, coords: dict[int, dict[str, int]]) -> list[LNode]:
        """The nodes to emit for this node (additions may be deferred and
        regrouped in the single-device order)."""
        if node.op == "send" or (node.outs and node.outs[0] in self.zeros) \
                or self.undoes_reshape(node) or self.undone_by_readers(node):
            return []
        if node.outs and node.outs[0] in self.low.range_sums:
            emitted = [n for v in node.ins if v in self.pending for n in self.materialize(v)]
            self.range_sum(node, coords)  # item 80
            return self.anchored([*emitted, node])
        ring = self.ring_step(node)
        if ring is not None:
            return self.anchored(ring)
        if node.op == "add":
            ready = [self.root_of(v) for v in node.ins]
            if None not in ready and ready[0] == ready[1]:
                emitted = [n for v in node.ins if v in self.pending for n in self.materialize(v)]
                if self.accumulates(node):
                    self.accumulate(node)
                    return [*emitted, node]
                if emitted:
                    self.one(node, coords)
                    return [*emitted, node]
        if node.op == "add" and (any(v in self.pending for v in node.ins)
                                 or not self.aligns(node) or self.part_of_grad(node)):
            leaves = []
            for v in node.ins:
                leaves += self.pending.pop(v, [v])
            self.pending[node.outs[0]] = leaves
            return []
        emitted: list[LNode] = []
        for v in node.ins:
            if v in self.pending:
                emitted += self.materialize(v)
        node, zeros = self.zeros_at_common_scale(node)
        self.one(node, coords)
        return self.anchored([*emitted, *zeros, node])

    def one(self, node: LNode, coords: dict[int, dict[str, int]]) -> None:
        souts = self.computed_split(node)
        if souts is not None:
            self.split_as_single(node, souts)
            return
        if self.strided_split(node) or self.strided_join(node) or self.split_of_cut(node):
            return  # a strided value's part, or the join of parts (item 87)
        if node.group is not None or node.op == "split":
            self.layout_step(node, coords)
            return
        if node.op == "cat" and not self.aligns(node) and (
                self.rejoins(node) or self.joins(node) or self.joins_block(node)
                or self.cat_block(node)):
            return
        if node.op == "zeros" and node.outs[0] in self.low.empty_sums:
            self.empty_sum(node, coords)
            return
        if node.outs[0] in self.low.row_cuts:
            self.cut_rows(node, coords)
            return
        if node.op == "narrow" and node.dir == "fw" and self.narrows_piece(node):
            return
        if node.op == "narrow" and node.dir == "fw" and not self.aligns(node) \
                and (self.takes_cp_piece(node) or self.takes_piece(node)
                     or self.takes_inner_piece(node, "tp")):
            return
        if node.op == "narrow" and node.dir == "bw" and self.pads_into_piece(node):
            return
        if node.op == "narrow" and node.dir == "bw" and not self.aligns(node) \
                and not self.sliced_alike(node) and self.pads_piece(node):
            return
        if any(o in self.low.mixed for o in node.outs) and not self.aligns(node):
            self.make_mixed_loose(node)  # elements of several values (91 (b))
            return
        if self.cuts_loose_block(node) and not self.aligns(node):
            self.make_loose(node, [self.sv[node.ins[0]]])  # a flat range's block (item 80)
            return
        if self.zeros_of_no_piece(node):
            self.make_loose(node)  # zeros of no single-device zeros' shape (122 (a))
            return
        if node.op == "zeros" and not node.ins and not self.aligns(node) \
                and all(c.op == "add" for c in self.consumers.get(node.outs[0], [None])):
            self.make_loose(node)  # a ring's accumulator or skipped block (ring_step)
            return
        souts = self.align(node)
        if souts is None:
            self.make_loose(node, self.first_fits(node))  # ``claimed_alike`` (b)
            return
        mb = node.mb if node.mb >= 0 else max((self.mb.get(v, -1) for v in node.ins), default=-1)
        for o, so in zip(node.outs, souts):
            if o >= 0:
                self.sv[o] = so
                self.mb[o] = mb
        if self.standing is not None:
            c = self.claim[self.standing]
            self.claim[node.outs[0]] = Claim([list(d) for d in c.dims], c.partial, c.mbs,
                                             c.scale, c.at, c.steps)
            return
        if node.op == "attention" and not self.whole_rows(node.ins[1]):
            self.make_loose(node, souts)  # a block over some of the keys: a piece of nothing
            return
        if node.op == "attention_grad":
            self.infer_attention_grad(node)
        else:
            if self.recuts:
                self.settle(node)
            self.infer(node)
        if self.padded is not None:
            d, axes = self.padded
            c = self.claim[node.outs[0]]
            c.dims[d] = []
            self.claim[node.outs[0]] = Claim(c.dims, c.partial | frozenset(axes), c.mbs, c.scale)
            self.check(node.outs[0])
        for o, f in zip(node.outs, self.scales_of(node)):
            if o >= 0:
                self.claim[o].scale = f * self.applied
