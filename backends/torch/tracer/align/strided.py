"""Strided values (docs/soundness.md, "Plans traced from PyTorch", 87): a
dim read as k equal parts, the rank holding its block of each part (a
``_StridedShard``: transformers' ``packed_colwise`` of the fused gate/up
columns). Such a value is k ranges of its single-device value, no block:
its claim names the dim's parts with a marker (``claim.STRIDED``) and the
plan writes it loose (a value no stage assumes). A split of it into its k
parts along that dim is a block again (the part's own axes), and the join
of k blocks cut alike along a dim is strided. A loaded strided parameter is
its k blocks joined by a ``cat`` (``pieces``), its final gradient the k
blocks ``narrow`` cuts (``build.strided_grads``)."""

from __future__ import annotations

from dataclasses import replace

from backends.torch.lowering import LNode, LoweringError
from backends.torch.tracer.align.claim import STRIDED, Claim, Pieces, key_kwargs, strided

Slices = tuple[tuple[int, int], ...]


class Strided(Pieces):
    """The claims of strided values: joins into them, splits out of them."""

    def strided_pieces(self, v: int) -> list[tuple[Slices, tuple[int, ...], tuple[int, int, int]]]:
        """The k blocks of the single-device value a strided value holds, in
        order: part j of the strided dim cut by the part's axes at this
        rank's coordinates, every other dim as its claim cuts it, each with
        the claim's partial-sum parts. Empty when
        the claim names no strided dim or names it out of form, or the
        sizes do not divide."""
        c = self.claim[v]
        found = strided(c.dims)
        if found is None or not found[1]:
            return []
        d, k, rest = found
        full, local = self.gshape(v), self.low.shapes[v]
        if full[d] % k or local[d] % k:
            return []
        part = full[d] // k
        lo, hi = self.piece(rest, part, {**self.low.coords, **(c.at or {})})
        if hi - lo != local[d] // k:
            return []
        plain = replace(c, dims=[list(rest) if e == d else list(a) for e, a in enumerate(c.dims)])
        self.claim[v] = plain
        try:
            slices, parts = self.view(v)
        finally:
            self.claim[v] = c
        shape = tuple(n // k if e == d else n for e, n in enumerate(local))
        return [(tuple((j * part + lo, j * part + hi) if e == d else s
                       for e, s in enumerate(slices)), shape, parts) for j in range(k)]

    def strided_split(self, node: LNode) -> bool:
        """A forward split of a strided value into its k parts along its
        strided dim, computing the single-device split of its value: part
        ``index`` is a block, cut by the part's axes (the claim is proved).
        False for any other node."""
        if node.op != "split" or node.dir != "fw" or not node.ins or node.ins[0] not in self.claim:
            return False
        x, out = node.ins[0], node.outs[0]
        c = self.claim[x]
        found = strided(c.dims)
        if found is None or not found[1] or c.loose:
            return False
        d, k, rest = found
        if node.kwargs.get("dim") != d or node.kwargs.get("parts") != k:
            return False
        souts = self.computed_split(node, cut=True)
        if souts is None:
            return False
        self.sv[out] = souts[0]
        self.mb[out] = node.mb if node.mb >= 0 else self.mb.get(x, -1)
        self.claim[out] = replace(c, dims=[list(rest) if e == d else list(a)
                                           for e, a in enumerate(c.dims)])
        self.check(out)
        return True

    def split_of_cut(self, node: LNode) -> bool:
        """A forward split into parts of a block along a dim mesh axes cut
        already, where reading it as one more cut by a mesh axis would name
        an axis cutting that dim twice (no claim): the rank's part j
        claimed as the single-device split's part j cut by the dim's axes,
        as a fused projection's chunk is when its weight is packed. The
        verifier proves the claim: a plain block of a packed weight (a
        ``colwise`` of the fused gate/up columns) FAILs at this split. False
        for any other node."""
        if node.op != "split" or node.dir != "fw" or not node.ins or node.ins[0] not in self.claim:
            return False
        c = self.claim[node.ins[0]]
        d = node.kwargs.get("dim")
        if c.loose or strided(c.dims) is not None or d is None or not c.dims[d]:
            return False
        try:
            guessed = self.guess(1, node.kwargs["parts"])
        except LoweringError:
            guessed = []
        if guessed and not set(guessed) & set(c.dims[d]):
            return False
        souts = self.computed_split(node, cut=True)
        if souts is None:
            return False
        self.split_as_single(node, souts)
        return True

    def strided_join(self, node: LNode) -> bool:
        """A forward ``cat`` of k >= 2 blocks claimed alike (every dim cut by
        the same axes, the joined dim by some), computing the single-device
        ``cat`` of their values: the k parts' blocks, a strided value (the
        backward of a split into parts). False for any other node."""
        if node.op != "cat" or node.dir != "fw" or len(node.ins) < 2 \
                or any(v < 0 or v not in self.claim or v not in self.sv for v in node.ins):
            return False
        d = node.kwargs.get("dim", 0) % len(self.low.shapes[node.outs[0]])
        claims = [self.claim[v] for v in node.ins]
        first = claims[0]
        if any(c.loose or strided(c.dims) is not None for c in claims) or not first.dims[d] \
                or any(replace(c, scale=first.scale) != first or c.scale != first.scale
                       for c in claims[1:]):
            return False
        key = (node.op, node.dir, tuple(self.sv[v] for v in node.ins), key_kwargs(node.kwargs))
        nodes = self.b.s.low.nodes
        souts = next((nodes[c].outs for c in self.b.s.by_key.get(key, [])
                      if nodes[c].kwargs == node.kwargs), None)
        if souts is None:
            return False
        k = len(node.ins)
        marker = f"{STRIDED}{k}"
        self.sizes.setdefault(marker, 1)
        self.low.coords.setdefault(marker, 0)
        out = node.outs[0]
        self.sv[out] = souts[0]
        self.mb[out] = node.mb if node.mb >= 0 else max(self.mb.get(v, -1) for v in node.ins)
        self.claim[out] = Claim([[marker, *a] if e == d else list(a) for e, a in enumerate(first.dims)],
                                first.partial, first.mbs, first.scale, first.at, first.steps)
        return True
