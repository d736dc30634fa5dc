"""A constant equal to the single-device constant's slice at several cuts
(rows alike along a dim: a rotary table computed per batch row) is claimed
at the first; where a value computed from it meets another value cut
otherwise along a dim they share, the constant's cut is chosen again among
its true ones (docs/soundness.md, "Plans traced from PyTorch", 68)."""

from __future__ import annotations

import itertools

from backends.torch.errors import WrongStep
from backends.torch.lowering import LNode, LoweringError
from backends.torch.tracer.align.claim import Claim, Pieces
from verdict.ops import get_op

#: Operators whose alignment reads the claim of the dim they slice or join
#: (``Rows``): between a constant and a clash only when that dim is cut by
#: no axis under either cut
SLICING = ("narrow", "cat", "split")

#: At most this many combinations of the constants' cuts are tried
MOST_TRIES = 64


def _find(parent: dict[tuple, tuple], x: tuple) -> tuple:
    """The representative of ``x``'s class of tied dims."""
    while parent.get(x, x) != x:
        x = parent[x]
    return x


class Recuts(Pieces):
    """The choice of a constant's cut among its true ones."""

    recuts: dict[int, dict[int, list[Claim]]]
    consumers: dict[int, list[LNode]]
    producer: dict[int, LNode]
    reclaimed: list[int]

    def clashes(self, node: LNode) -> list[int]:
        """The inputs of a forward node whose dims its relations tie to
        another input's dim cut by other axes (each would be read at other
        rows): their positions, none when the claims agree."""
        if node.dir != "fw" or node.group is not None or len(node.ins) < 2 \
                or any(v >= 0 and v not in self.claim for v in node.ins):
            return []
        shapes_in = [None if v < 0 else self.low.shapes[v] for v in node.ins]
        shapes_out = [self.low.shapes[o] if o >= 0 else None for o in node.outs]
        try:
            rel = get_op(node.op).relations(shapes_in, shapes_out, node.kwargs)
        except Exception:  # an operator whose relations need other kwargs: no clash seen
            return []
        parent: dict[tuple, tuple] = {}
        for r in rel:
            if r[0] == "eq":
                parent[_find(parent, tuple(r[1]))] = _find(parent, tuple(r[2]))
        seen: dict[tuple, tuple[int, tuple[str, ...]]] = {}
        clash: set[int] = set()
        for i, v in enumerate(node.ins):
            if v < 0:
                continue
            for d, axes in enumerate(self.claim[v].dims):
                if not axes:
                    continue
                root = _find(parent, ("i", i, d))
                if root in seen and seen[root][1] != tuple(axes):
                    clash |= {i, seen[root][0]}
                seen.setdefault(root, (i, tuple(axes)))
        return sorted(clash)

    def settle(self, node: LNode) -> None:
        """Before ``node``'s claims are inferred: an input in a clash
        computed from constants only, whose constants have other true cuts,
        re-cut at the first choice under which the clash is gone (the
        claims of the values between re-inferred, their written tensors
        marked for new slices: ``reclaimed``). Nothing changes when no
        choice settles it; the stage then judges the clash."""
        clash = self.clashes(node)
        for i in clash:
            found = self.constant_cone(node.ins[i], node)
            if found is None:
                continue
            roots, cone = found
            choices = [self.recuts.get(c, {}).get(self.sv[c], [self.claim[c]]) for c in roots]
            saved = {v: self.claim[v] for v in [*roots, *(o for n in cone for o in n.outs)]
                     if v >= 0}
            if any(self.sliced_cut(n, saved) for n in cone):
                continue
            for k, pick in enumerate(itertools.product(*choices)):
                if k >= MOST_TRIES:
                    break
                if self.recut(roots, pick, cone) and not self.clashes(node):
                    self.reclaimed += [v for v in saved if saved[v].dims != self.claim[v].dims]
                    return
                self.claim.update(saved)

    def recut(self, roots: list[int], pick: tuple[Claim, ...], cone: list[LNode]) -> bool:
        """The constants claimed at ``pick``, the claims of the nodes in
        ``cone`` (in order) inferred again; False when a node between
        slices or joins a dim cut under either claim, or a claim does not
        fit."""
        for c, claim in zip(roots, pick):
            self.claim[c] = Claim([list(d) for d in claim.dims])
        for n in cone:
            try:
                self.infer(n)  # type: ignore[attr-defined]
            except (LoweringError, WrongStep):
                return False
            if self.sliced_cut(n, self.claim):
                return False
        return True

    @staticmethod
    def sliced_cut(n: LNode, claims: dict[int, Claim]) -> bool:
        """``n`` slices or joins a dim that some axes cut in one of its
        values under ``claims``."""
        if n.op not in SLICING:
            return False
        dim = n.kwargs.get("dim", 0)
        return any(claims[v].dims[dim % len(claims[v].dims)]
                   for v in [*n.ins, *n.outs] if v >= 0 and v in claims and claims[v].dims)

    def constant_cone(self, v: int, reader: LNode) -> tuple[list[int], list[LNode]] | None:
        """The constants ``v`` is computed from and the nodes between, in
        the rank's order, when ``v`` is computed from constants only, at
        factor 1, by forward nodes of no group, at least one constant has
        other true cuts, and nothing computed from those constants is read
        yet but by the nodes between (and ``reader``): else None."""
        roots: set[int] = set()
        between: dict[int, LNode] = {}
        stack = [v]
        while stack:
            x = stack.pop()
            c = self.claim.get(x)
            if c is None or c.partial or c.scale != 1 or c.at is not None or c.loose:
                return None
            if x in self.low.constants:
                roots.add(x)
                continue
            n = self.producer.get(x)
            if n is None or n.dir != "fw" or n.group is not None:
                return None
            if id(n) not in between:
                between[id(n)] = n
                stack += [u for u in n.ins if u >= 0]
        if not any(len(self.recuts.get(c, {}).get(self.sv[c], [])) > 1 for c in roots):
            return None
        inside = set(between) | {id(reader)}
        for n in between.values():
            for o in n.outs:
                for r in self.consumers.get(o, []) if o >= 0 else []:
                    if id(r) not in inside and any(u in self.claim for u in r.outs if u >= 0):
                        return None  # read already elsewhere, under the present cut
        for c in roots:
            for r in self.consumers.get(c, []):
                if id(r) not in inside and any(u in self.claim for u in r.outs if u >= 0):
                    return None
        order = {id(n): k for k, n in enumerate(self.low.nodes)}
        return sorted(roots), sorted(between.values(), key=lambda n: order[id(n)])
