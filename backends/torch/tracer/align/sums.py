"""Sums deferred and regrouped: additions whose terms are written in the
single-device step's order (addition is associative in exact arithmetic),
gradients accumulated over microbatches, and sums of only some of a
single-device sum's terms."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from backends.torch.errors import AlignError
from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import Claim, Pieces


class Sums(Pieces):
    """A rank's deferred sums and their materialization."""

    pending: dict[int, list[int]]
    fresh: int
    zero_memo: dict[int, bool]

    def root_of(self, v: int) -> int | None:
        """The single-device value of v, also for a deferred sum whose terms
        make a single-device sum (None if they do not)."""
        if v not in self.pending:
            return self.sv[v]
        s_leaves = []
        for p in self.pending[v]:
            sv = self.sv[p]
            single = sv in self.b.s_leaves and self.b.s_uses.get(sv) == 1
            s_leaves += self.b.s_leaves[sv] if single else [sv]
        return self.b.s_trees.get(tuple(sorted(s_leaves)))

    def accumulates(self, node: LNode) -> bool:
        """An addition of two pieces of one single-device value that sum
        adjacent microbatches (autograd accumulating a parameter's gradient
        over a pipeline's microbatches)."""
        a, c = node.ins
        if a in self.pending or c in self.pending or self.sv[a] != self.sv[c]:
            return False
        ra, rc = self.mb_range(a), self.mb_range(c)
        ca, cc = self.claim[a], self.claim[c]
        return (ra is not None and rc is not None and (ra[1] == rc[0] or rc[1] == ra[0])
                and ca.dims == cc.dims and ca.partial == cc.partial)

    def mb_range(self, v: int) -> tuple[int, int] | None:
        c = self.claim[v]
        if "mb" not in c.partial:
            return None
        return c.mbs or (self.mb[v], self.mb[v] + 1)

    def accumulate(self, node: LNode) -> None:
        a, c = node.ins
        out = node.outs[0]
        (la, ha), (lc, hc) = self.mb_range(a), self.mb_range(c)
        lo, hi = min(la, lc), max(ha, hc)
        claim = self.claim[a]
        partial = set(claim.partial)
        mbs: tuple[int, int] | None = (lo, hi)
        if (lo, hi) == (0, self.sizes["mb"]):
            partial.discard("mb")
            mbs = None
        self.sv[out] = self.sv[a]
        self.mb[out] = self.mb[c]
        self.claim[out] = Claim([list(d) for d in claim.dims], frozenset(partial), mbs,
                                claim.scale)

    def materialize(self, v: int) -> list[LNode]:
        leaves = self.pending.pop(v)
        by_s: dict[int, list[int]] = {}
        for p in leaves:
            by_s.setdefault(self.sv[p], []).append(p)
        s_leaves = []
        for p in leaves:
            sv = self.sv[p]
            single = sv in self.b.s_leaves and self.b.s_uses.get(sv) == 1
            s_leaves += self.b.s_leaves[sv] if single else [sv]
        root = self.b.s_trees.get(tuple(sorted(s_leaves)))
        if root is None:
            return self.partial_tree(v, leaves, s_leaves)
        grads = {g for g in self.b.s.low.grads.values() if g is not None}
        if root not in grads and self.same_piece(leaves):
            # pieces of some terms of a parameter's gradient sum (a rank's
            # experts' gradients): the other terms are zero on the piece
            whole = self.b.superset(s_leaves, lambda r: r in grads)
            if whole is not None:
                return self.zero_terms(v, leaves, s_leaves, whole)
        out: list[LNode] = []

        def emit(sv: int, target: int | None) -> int:
            if by_s.get(sv):
                return by_s[sv].pop()
            node = self.b.s_add[sv]
            a = emit(node.ins[0], None)
            c = emit(node.ins[1], None)
            if target is None:
                target = self.fresh
                self.fresh += 1
                self.low.shapes[target] = self.low.shapes[a]
            new = LNode("add", node.dir, [a, c], [target], {}, node.name)
            self.one(new, {})
            out.append(new)
            return target

        emit(root, v)
        return out

    def partial_tree(self, v: int, leaves: list[int], s_leaves: list[int]) -> list[LNode]:
        """A sum of some of the terms of a single-device sum (a pipeline
        stage's share of a gradient norm, used as if it were the whole; a
        rank's experts' gradients, each a piece of its expert's padded
        gradient, summed over its experts only): each of its additions is
        claimed to be the whole sum, or, when every term is the same piece
        of its own single-device term, that piece of the whole sum; the
        verifier proves it or refutes it at the first addition (the
        single-device terms left out must be zero on the piece). AlignError
        if no single-device sum has all these terms."""
        root = self.b.superset(s_leaves)
        if root is None and self.alike:
            return self.sum_as_run(v, leaves)
        if root is None:
            raise AlignError(f"rank {self.low.rank} sums gradient terms the single-device step "
                             f"never sums together")
        first = self.claim[leaves[0]]
        same = self.same_piece(leaves)
        dims = [list(d) for d in first.dims] if same else None
        if same:
            return self.zero_terms(v, leaves, s_leaves, root)
        out: list[LNode] = []
        for acc, p, target in self.add_chain(v, leaves):
            new = LNode("add", "fw", [acc, p], [target], {}, self.b.s_add[root].name)
            partial = self.claim[acc].partial | self.claim[p].partial
            self.sv[target] = root
            self.mb[target] = max(self.mb.get(acc, -1), self.mb.get(p, -1))
            if dims is not None:
                self.claim[target] = Claim([list(d) for d in dims], partial, None, first.scale,
                                           first.at)
            else:
                self.claim[target] = Claim([[] for _ in self.gshape(target)], partial)
            self.check(target)
            out.append(new)
        return out

    def sum_as_run(self, v: int, leaves: list[int]) -> list[LNode]:
        """The terms added in the order the rank adds them, each addition
        aligned as any node is: on a rank that holds a claim of
        ``claimed_alike`` (its backward sums gradient terms of its own
        forward, which no single-device sum has), an addition that matches
        no single-device node is loose, or, when it writes a gradient the
        rank ends with, claimed to be the node that writes it, a claim its
        stage proves or refutes (docs/soundness.md, "Plans traced from
        PyTorch", 94 (b))."""
        out: list[LNode] = []
        for acc, p, target in self.add_chain(v, leaves):
            new = LNode("add", "fw", [acc, p], [target], {}, "bw:")
            self.one(new, {})
            out.append(new)
        return out

    def add_chain(self, v: int, leaves: list[int]) -> Iterator[tuple[int, int, int]]:
        """The additions of a left-to-right sum of ``leaves`` into ``v``:
        (running sum, term, result) each, every result but the last a fresh
        value of the running sum's shape."""
        acc = leaves[0]
        for k, p in enumerate(leaves[1:]):
            target = v if k == len(leaves) - 2 else self.fresh
            if target != v:
                self.fresh += 1
                self.low.shapes[target] = self.low.shapes[acc]
            yield acc, p, target
            acc = target

    def units(self, x: int) -> list[int]:
        """The values a sum is made of on this rank: its deferred terms, or x."""
        return list(self.pending[x]) if x in self.pending else [x]

    def terms(self, x: int) -> list[int]:
        """The terms of a scalar sum on this rank: its deferred terms, and the
        terms of each scalar addition it was computed by (x = a + b has the
        terms of a and of b), in order; x itself when it is no sum."""
        out: list[int] = []
        todo = [x]
        while todo:
            v = todo.pop()
            node = self.producer.get(v)
            if v in self.pending:
                todo.extend(reversed(self.pending[v]))
            elif node is not None and node.op == "add" and not self.low.shapes[v] \
                    and all(not self.low.shapes[a] for a in node.ins):
                todo.extend(reversed(node.ins))
            else:
                out.append(v)
        return out

    def part_of_grad(self, node: LNode) -> bool:
        """An addition of the same piece of two terms of a parameter's
        gradient sum that is not the whole sum (deferred: ``materialize``
        writes it with the sum's other terms as zeros)."""
        if any(v < 0 or v not in self.claim for v in node.ins) or not self.same_piece(node.ins):
            return False
        grads = {g for g in self.b.s.low.grads.values() if g is not None}
        leaves = [self.sv[v] for v in node.ins]
        if self.b.s_trees.get(tuple(sorted(leaves))) in grads:
            return False
        return self.b.superset(leaves, lambda r: r in grads) is not None

    def same_piece(self, leaves: list[int]) -> bool:
        """Every value is the same piece (cut along some dim, at the same
        coordinates and factor) of a single-device value of one shape."""
        first = self.claim[leaves[0]]
        return any(first.dims) and all(
            self.claim[p].dims == first.dims and self.claim[p].at == first.at
            and self.claim[p].scale == first.scale and not self.claim[p].partial
            and self.gshape(p) == self.gshape(leaves[0]) for p in leaves)

    def zero_gradient(self, v: int, claim: Claim, shape: tuple[int, ...], whole: int
                      ) -> list[LNode]:
        """A gradient that is zeros by its making (an expert-parallel
        placeholder's backward, ``lowering/zero_flow.py``) as the piece
        ``claim`` of the single-device gradient ``whole``: each term of
        ``whole``'s sum (``whole`` itself when it is no sum) written as
        zeros claimed to be its term's piece, a claim its own stage proves
        (the term must be zero there: another expert's gradient, zero off
        its own rows), then added in the single-device order
        (docs/soundness.md, "Plans traced from PyTorch", 125 c)."""
        key = next((k for k, r in self.b.s_trees.items() if r == whole), (whole,))
        self.low.shapes[v] = shape
        made: list[LNode] = []
        terms = []
        for sv in sorted(key):
            if self.b.s.low.shapes[sv] != self.b.s.low.shapes[whole]:
                raise AlignError(f"rank {self.low.rank} ends with zeros as a gradient whose "
                                 f"single-device sum has terms of another shape")
            target = v if len(key) == 1 else self.fresh
            if len(key) > 1:
                self.fresh += 1
            self.low.shapes[target] = shape
            self.sv[target], self.mb[target] = sv, -1
            self.claim[target] = Claim([list(d) for d in claim.dims], frozenset(), claim.mbs,
                                       claim.scale, claim.at)
            zeros = LNode("zeros", "none", [], [target], {"shape": list(shape)},
                          self.b.s_made[whole].name if whole in self.b.s_made else "")
            self.producer[target], self.zero_memo[target] = zeros, True
            made.append(zeros)
            terms.append(target)
        if len(key) == 1:
            return made
        self.pending[v] = terms
        return made + self.materialize(v)

    def zero_terms(self, v: int, leaves: list[int], s_leaves: list[int], root: int
                   ) -> list[LNode]:
        """``partial_tree``'s sum of pieces (one slice of each term, cut
        along some dim): the single-device sum's other terms written as
        zeros, each claimed to be its term's piece at that slice (a claim
        its own stage proves: the term must be zero there, e.g. another
        expert's gradient padded to the experts' weights), and the whole
        sum then added in the single-device order, as ``materialize``
        does."""
        key = next(k for k, r in self.b.s_trees.items() if r == root)
        missing = Counter(key) - Counter(s_leaves)
        first = leaves[0]
        c = self.claim[first]
        made: list[LNode] = []
        terms = list(leaves)
        for sv in sorted(missing.elements()):
            if self.b.s.low.shapes[sv] != self.gshape(first):
                raise AlignError(f"rank {self.low.rank} sums pieces of terms of another shape "
                                 f"than the single-device sum's")
            target = self.fresh
            self.fresh += 1
            self.low.shapes[target] = self.low.shapes[first]
            self.sv[target], self.mb[target] = sv, self.mb.get(first, -1)
            self.claim[target] = Claim([list(d) for d in c.dims], frozenset(), c.mbs, c.scale,
                                       c.at)
            zeros = LNode("zeros", "none", [], [target], {"shape": list(self.low.shapes[first])},
                          self.b.s_add[root].name)
            self.producer[target], self.zero_memo[target] = zeros, True
            made.append(zeros)
            terms.append(target)
        self.pending[v] = terms
        return made + self.materialize(v)
