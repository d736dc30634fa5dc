"""Claims moved by collectives and splits: a collective's output is its
input's value with the axes its group runs along gathered, reduced or
scattered; a received value is the piece its sender held."""

from __future__ import annotations

from backends.torch.errors import AlignError
from backends.torch.lowering import LNode, LoweringError
from backends.torch.tracer.align.claim import Claim, Pieces, key_kwargs, scope
from backends.torch.tracer.align.group_axes import product_axes

#: Averaging collectives divide by their group's size.
AVERAGES = ("all_reduce_avg", "reduce_scatter_avg")


class Collectives(Pieces):
    """The claims of collectives, splits and received values."""

    def axis_of(self, group: tuple[int, ...], coords: dict[int, dict[str, int]]) -> list[str]:
        """The mesh axes a collective's group runs along, outer first: one
        axis, or under HSDP both data-parallel sub-axes (the whole of "dp"),
        or the product of several axes its members hold (``product_axes``);
        none for a group of one rank (a mesh dim of size 1), where every
        collective is the identity."""
        if len(group) == 1:
            return []
        varying = [a for a in self.axes if len({coords[r][a] for r in group}) > 1]
        if varying == [*self.dp, "cp"] and list(group) == sorted(group):
            return varying  # the data- and context-parallel ranks together (torchtitan's fsdp)
        if len(varying) == 1 or varying == self.dp:
            return varying
        # a library's own group of several axes (Megatron's expert-data-parallel
        # group at dp x tp): their product, read from the members (item 113)
        product = product_axes(group, coords, self.axes, self.sizes)
        if product is None:
            raise LoweringError(f"rank {self.low.rank}: a collective over ranks {list(group)} "
                                f"is neither along one mesh axis nor the product of the axes "
                                f"{varying} in rank order")
        return product

    def layout_step(self, node: LNode, coords: dict[int, dict[str, int]]) -> None:
        """A collective's or a split's output: its input's value, the claim
        moved by the op (a pipeline's microbatch of the batch; a split by a
        mesh axis, or else the single-device split it computes; the axes
        the collective's group runs along gathered, reduced or
        scattered)."""
        x = node.ins[0]
        out = node.outs[0]
        self.sv[out] = self.sv[x]
        self.mb[out] = node.mb if node.mb >= 0 else self.mb.get(x, -1)
        c = self.claim[x]
        dims = [list(d) for d in c.dims]
        partial = set(c.partial)
        if node.op == "split" and self.low.inputs.get(x, ("",))[0] == "tokens" \
                and node.kwargs["dim"] == 0:
            # a pipeline schedule's microbatch of the batch
            if node.kwargs["parts"] != self.sizes["mb"]:
                raise LoweringError(f"rank {self.low.rank} cuts the batch in "
                                    f"{node.kwargs['parts']}, not in its "
                                    f"{self.sizes['mb']} microbatches")
            dims[0].append("mb")
            self.mb[out] = node.kwargs["index"]
        elif node.op == "split":
            try:
                dims[node.kwargs["dim"]] += self.split_axes(node, coords)
            except LoweringError:
                souts = self.computed_split(node, cut=True)
                if souts is None and self.low.reordered and self.low.anchors \
                        and self.splits_piece(node):
                    return
                if souts is None and self.low.coords.get("cp") != node.kwargs["index"] \
                        and self.splits_whole(node):
                    return
                if souts is None and self.low.coords.get("cp") != node.kwargs["index"]:
                    raise LoweringError(
                        f"rank {self.low.rank}: a split at {scope(node.name)} reads piece "
                        f"{node.kwargs['index']} of {node.kwargs['parts']}, not the piece "
                        f"of its cp index ({self.low.coords.get('cp', 0)}) nor one that "
                        f"another axis or the single-device step names") from None
                if souts is None:
                    # a piece at the rank's cp index (a head group's sinks under
                    # Ulysses): claimed so, proved or refuted (soundness.md, 101)
                    dims[node.kwargs["dim"]] += self.guess(1, node.kwargs["parts"],
                                                           order=(("cp",),))
                else:
                    self.split_as_single(node, souts)
                    return
        else:
            axes = self.axis_of(node.group, coords)
            if node.op in ("all_reduce", "all_reduce_avg"):
                partial -= set(axes)
            elif node.op == "all_gather":
                d = dims[node.kwargs["dim"]]
                for axis in axes:
                    if axis in d:
                        d.remove(axis)
            elif node.op in ("reduce_scatter", "reduce_scatter_avg"):
                partial -= set(axes)
                dims[node.kwargs["dim"]].extend(axes)
        scale = c.scale / len(node.group) if node.op in AVERAGES else c.scale
        self.claim[out] = Claim(dims, frozenset(partial), c.mbs, scale,
                                steps=c.steps if "step" in partial else None)
        self.check(out, uneven=True)

    def splits_whole(self, node: LNode) -> bool:
        """A split of a dim its input holds whole (a chunk of the gathered
        keys' scores), at an index no mesh axis names: claimed as that
        piece of the single-device value, by an axis of its own,
        ``split{parts}``, read at ``index`` (``splits_piece``'s claim on a
        whole dim; docs/soundness.md, "Plans traced from PyTorch", 130
        (b)). The claim names the rows the split reads, and is proved. False
        for a value cut, loose or partial."""
        x, out = node.ins[0], node.outs[0]
        c = self.claim.get(x)
        d = node.kwargs["dim"] % len(self.low.shapes[x])
        parts = node.kwargs["parts"]
        if c is None or c.loose or c.partial or c.dims[d] or c.at \
                or self.gshape(x)[d] != self.low.shapes[x][d] or self.gshape(x)[d] % parts:
            return False
        axis = f"split{parts}"
        self.sizes[axis] = parts
        dims = [[axis] if k == d else list(axes) for k, axes in enumerate(c.dims)]
        self.claim[out] = Claim(dims, c.partial, c.mbs, c.scale, {axis: node.kwargs["index"]})
        self.sv[out], self.mb[out] = self.sv[x], self.mb.get(x, -1)
        return True

    def split_axes(self, node: LNode, coords: dict[int, dict[str, int]]) -> list[str]:
        """The mesh axes a split's piece is claimed cut by: the guess
        (``guess``), unless it is one axis at whose coordinate this rank
        does not read its piece and another axis of the same size is one
        at which it does (a head group's sinks at the rank's cp index on a
        mesh with dp beside cp: docs/soundness.md, "Plans traced from
        PyTorch", 101 (c)). Either is a claim its stage proves."""
        axes = self.guess(1, node.kwargs["parts"])
        mine, index = coords[self.low.rank], node.kwargs["index"]
        if len(axes) != 1 or mine.get(axes[0]) == index:
            return axes
        other = [a for a in self.axes if a in mine and a not in self.dp
                 and self.sizes.get(a) == node.kwargs["parts"] and mine[a] == index]
        return other[:1] or axes

    def splits_piece(self, node: LNode) -> bool:
        """A split of a piece along a dim axes cut, into ``parts`` at
        ``index``, where the sequence is laid out in a load balancer's order
        (a load-balanced ring's half of a rank's query, keys, output
        gradient, merged out or lse): the piece's own piece ``index`` of
        ``parts``, claimed cut by its axes and one more, ``split{parts}``,
        read at ``index`` (docs/soundness.md, "Plans traced from PyTorch",
        66). The claim is proved like any. False for a value that is not a
        piece along the dim, partial, or split so already."""
        x, out = node.ins[0], node.outs[0]
        c = self.claim.get(x)
        d = node.kwargs["dim"] % len(self.low.shapes[x])
        axis = f"split{node.kwargs['parts']}"
        if c is None or c.loose or c.partial or not c.dims[d] or any(
                axis in axes for axes in c.dims):
            return False
        self.sizes[axis] = node.kwargs["parts"]
        dims = [[*axes, axis] if k == d else list(axes) for k, axes in enumerate(c.dims)]
        self.claim[out] = Claim(dims, c.partial, c.mbs, c.scale,
                                {**(c.at or {}), axis: node.kwargs["index"]})
        self.sv[out], self.mb[out] = self.sv[x], self.mb.get(x, -1)
        return True

    def rejoins(self, node: LNode) -> bool:
        """A ``cat`` along a dim of the pieces ``splits_piece`` claimed, one
        of each index of its ``split{parts}``, in any order: claimed as the
        piece they were split from (the claim is proved, so pieces joined
        in another order than the split's fail: a load balancer's chunks
        put back wrongly). False for any other cat."""
        d = node.kwargs["dim"] % len(self.low.shapes[node.ins[0]])
        claims = [self.claim.get(v) for v in node.ins]
        if any(c is None or c.loose or not c.dims[d] for c in claims):
            return False
        axis = claims[0].dims[d][-1]
        if not axis.startswith("split") or len(claims) != self.sizes.get(axis) \
                or len({self.sv[v] for v in node.ins}) != 1:
            return False
        rest = [(c.dims, c.partial, c.scale, c.mbs,
                 {a: i for a, i in (c.at or {}).items() if a != axis}) for c in claims]
        if any(r != rest[0] for r in rest) or sorted(c.at[axis] for c in claims) \
                != list(range(len(claims))):
            return False
        first = claims[0]
        at = rest[0][4] or None
        out = node.outs[0]
        self.claim[out] = Claim([axes[:-1] if k == d else list(axes)
                                 for k, axes in enumerate(first.dims)], first.partial, first.mbs,
                                first.scale, at)
        self.sv[out], self.mb[out] = self.sv[node.ins[0]], self.mb.get(node.ins[0], -1)
        return True

    def receive(self, node: LNode, peer: Pieces, x: int) -> None:
        """A value received from ``peer``: the value it sent, the same piece
        (its axes read at the coordinates the peer reads them at, where they
        differ from this rank's; a dim the peer holds whole is whole)."""
        out = node.outs[0]
        self.sv[out] = peer.sv[x]
        self.mb[out] = peer.mb.get(x, -1)
        c = peer.claim[x]
        if c.loose:  # a ring's partial sums passed on: loose here too
            self.claim[out] = Claim([[] for _ in c.dims], loose=self.b.loose_number())
            return
        full = peer.gshape(x)
        dims = [[] if peer.extent(d, n) == n else list(d) for d, n in zip(c.dims, full)]
        # read at the peer's coordinates, or at those its own claim names (a
        # piece it received and passes on: a ring's keys)
        held = {**peer.low.coords, **(c.at or {})}
        at = {a: held[a] for d in dims for a in d
              if a != "mb" and held[a] != self.low.coords[a]}
        self.claim[out] = Claim(dims, c.partial, c.mbs, c.scale, at or None, c.steps)

    def range_sum(self, node: LNode, coords: dict[int, dict[str, int]]) -> None:
        """The square sum of a run of a reduce-scattered range that is part
        of a value (a distributed optimizer's shard of a gradient): this
        rank's part, over the group the ranges were cut for and the axes
        that cut the value (a tensor-parallel piece), of the square sum of
        the single-device value; the value must be a reduced piece (no
        partial sum: docs/soundness.md, "Plans traced from PyTorch", 80).
        Computed from loose blocks (the stage recomputes them), proved to
        add up with the other ranks' parts to the single-device square sum."""
        v, group = self.low.range_sums[node.outs[0]]
        c = self.claim.get(v)
        if c is None or c.loose or c.partial or c.at:
            raise AlignError(f"rank {self.low.rank} takes the norm of part of a reduce-scattered "
                             f"range of a value that is no reduced piece of a single-device "
                             f"value")
        self.part_of_square_sum(node.outs[0], v, group, coords,
                                {a for axes in c.dims for a in axes})

    def part_of_square_sum(self, out: int, g: int, group: tuple[int, ...],
                           coords: dict[int, dict[str, int]], cut: set[str] = frozenset()) -> None:
        """``out`` claimed as a part, over ``group``'s axes and ``cut``, of
        the single-device square sum of ``g``'s single-device value (the
        parts are proved to add up to it)."""
        whole = self.sv[g]
        by_key, nodes = self.b.s.by_key, self.b.s.low.nodes
        sums = [nodes[m].outs[0] for m in by_key.get(("mul", "fw", (whole, whole), ()), [])]
        sums = [nodes[c].outs[0] for sq in sums for c in by_key.get(
            ("sum", "fw", (sq,), key_kwargs({"dim": None, "keepdim": False})), [])]
        if not sums:
            raise AlignError(f"rank {self.low.rank} takes the norm of a gradient shard "
                             f"whose square sum the single-device step never takes")
        self.sv[out], self.mb[out] = sums[0], -1
        self.claim[out] = Claim([], frozenset(self.axis_of(group, coords)) | frozenset(cut))

    def empty_sum(self, node: LNode, coords: dict[int, dict[str, int]]) -> None:
        """The square sum (a zero) of a gradient's empty shard: this rank's
        part of the partial square sum of the gradient over the group that
        cuts it (a sum over no rows; the parts are proved to add up to the
        single-device square sum)."""
        g, group = self.low.empty_sums[node.outs[0]]
        self.part_of_square_sum(node.outs[0], g, group, coords)
