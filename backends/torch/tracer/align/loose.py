"""Loose values (docs/soundness.md, "Plans traced from PyTorch", 53 (e)):
values a rank computes that are no piece of any single-device value (a
ring's block over some of the keys, the merge's arithmetic), each claimed
as the leading corner of a single-device tensor its shape fits in, with a
part no cover holds."""

from __future__ import annotations

import math

from backends.torch.errors import AlignError
from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import Claim, Pieces, scope


class Loose(Pieces):
    """The claims of loose values."""

    def is_loose(self, v: int) -> bool:
        return v >= 0 and v in self.claim and self.claim[v].loose

    def make_loose(self, node: LNode, bases: list[int] | None = None) -> None:
        """Every output of ``node`` a loose value (53 (e)): claimed as
        the leading corner of a single-device tensor its shape fits in (its
        base: ``bases``, else a loose input's or its producer's other
        output, else the first that fits),
        with a part that no cover holds. Which tensor it names is no
        statement: the part is never grouped."""
        mb = node.mb if node.mb >= 0 else max((self.mb.get(v, -1) for v in node.ins), default=-1)
        # the loose inputs' single-device tensors and their producers' other
        # outputs (a block's lse unsqueezed fits in the attention's out): its
        # stage is the one that reads the loose inputs' producers
        near = []
        for v in node.ins:
            if self.is_loose(v) and not self.is_zero(v):
                made = self.b.s_made.get(self.sv[v])
                near += [self.sv[v], *(o for o in (made.outs if made else ()) if o >= 0)]
        for i, o in enumerate(node.outs):
            if o < 0:
                continue
            shape = tuple(self.low.shapes[o])
            tries = ([bases[i]] if bases and bases[i] >= 0 else []) + near
            base = next((t for t in tries if self.fits_in(shape, t)), None)
            if base is None:  # the last value the single-device step computes that fits
                base = next((o for n in reversed(self.b.s.low.nodes) for o in n.outs
                             if o >= 0 and self.fits_in(shape, o)), None)
            if base is None:
                raise AlignError(f"rank {self.low.rank} runs {node.op} at {scope(node.name)} "
                                 f"on values of no single-device tensor, into a shape "
                                 f"{list(shape)} no single-device value holds")
            self.sv[o], self.mb[o] = base, mb
            self.claim[o] = Claim([[] for _ in shape], loose=self.b.loose_number())

    def first_fits(self, node: LNode) -> list[int]:
        """For each output of ``node``, a loose value's base (-1 when none):
        a value the single-device step computes that it fits in
        (``closest_fit``), made after every aligned input's value and no earlier than every
        loose input's base. Its stage then finds every value the loose one
        is computed from verified before it (a loose value is a target of
        its base's stage, which recomputes it), and a later reader's stage
        finds its base verified (docs/soundness.md, "Plans traced from
        PyTorch", 94)."""
        order = self.single_order()
        start = 0
        for v in node.ins:
            if v >= 0 and v in self.sv:
                at = order.get(self.sv[v], -1)
                start = max(start, at if self.is_loose(v) else at + 1)
        made = [o for n in self.b.s.low.nodes[start:] for o in n.outs if o >= 0]
        return [-1 if o < 0 else self.closest_fit(tuple(self.low.shapes[o]), made)
                for o in node.outs]

    def closest_fit(self, shape: tuple[int, ...], made: list[int]) -> int:
        """Of the values ``made``, the first that a value of ``shape`` fits
        in with the fewest pieces (its dims tie to dims of the same cut when
        a stage is reduced); -1 when none fits."""
        fits = [sv for sv in made if self.fits_in(shape, sv)]
        if not fits:
            return -1
        full = self.b.s.low.shapes
        return min(fits, key=lambda sv: math.prod(f // max(n, 1)
                                                  for n, f in zip(shape, full[sv])))

    def fits_in(self, shape: tuple[int, ...], sv: int) -> bool:
        """A value of ``shape`` fits in the leading corner of single-device
        value sv (which the single-device plan writes)."""
        full = self.b.s.low.shapes.get(sv)
        return (sv in self.b.s.tid and full is not None and len(full) == len(shape)
                and all(a <= b for a, b in zip(shape, full)))

    def cuts_loose_block(self, node: LNode) -> bool:
        """A forward ``narrow`` that the single-device step never takes, of
        a value claimed as a piece, no partial sum: its block (a flat
        range's block, cut for a square sum over a distributed optimizer's
        ranges: docs/soundness.md, "Plans traced from PyTorch", 80) is a
        piece of no claim's kind, so it is loose, and so is every value
        computed from it: a stage recomputes them, never assumes them. Only
        outside the model's modules (``node.name`` empty: the clipper's or
        optimizer's code after the backward, over flat shards the
        single-device step, over whole parameters, never cuts); a narrow in
        a module runs on one device too, so one the single-device step
        never takes is left to the alignment, which judges it (a wrong
        plan's narrow of another column FAILs there). Loose is no
        assumption, so where it applies decides only between a verdict
        and a refusal, never a wrong SUCCESS."""
        x = node.ins[0] if node.ins else -1
        return (node.op == "narrow" and node.dir == "fw" and x >= 0 and x in self.claim
                and not node.name
                and not self.claim[x].partial and not self.claim[x].loose
                and self.claim[x].at is None)

    def make_mixed_loose(self, node: LNode) -> None:
        """A node the lowering built from elements of several values
        (``Lowered.mixed``: a view of a range a collective wrote for
        another rank, docs/soundness.md, "Plans traced from PyTorch", 91
        (b)): loose, claimed beside the single-device gradient of the
        parameter whose final block reads it, so that the stage of that
        gradient is the one judging it (it reads other gradients than that
        one's sources: the stage FAILs, naming the rank and the
        parameter's gradient); else beside the single-device value, of
        those its inputs depend on, that the single-device step computes
        last (or the first after it that its shape fits in)."""
        order = self.b.__dict__.setdefault(
            "mixed_order", {o: i for i, n in enumerate(self.b.s.low.nodes) for o in n.outs})
        after = self.__dict__.setdefault("mixed_after", {})
        last = max((after[v] if v in after else order.get(self.sv.get(v), -1)
                    for v in node.ins if v >= 0), default=-1)
        shape = tuple(self.low.shapes[node.outs[0]])
        grad = self.b.s.low.grads.get(self.low.mixed.get(node.outs[0]) or "")
        base = grad if grad is not None and self.fits_in(shape, grad) else next(
            (o for n in self.b.s.low.nodes[max(last, 0):] for o in n.outs
             if o >= 0 and self.fits_in(shape, o)), None)
        self.make_loose(node, None if base is None else [base] * len(node.outs))
        for o in node.outs:
            after[o] = max(last, order.get(self.sv.get(o), -1))
