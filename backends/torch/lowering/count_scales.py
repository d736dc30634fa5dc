"""Counts of kept labels as scales: added up, inverted, multiplied by.

A count of a flag's true entries (``mask_values.Count``: the recorded
number, after a SUM all-reduce the group's total) is a constant of the
traced step. ``masks`` reads it as a divisor. A schedule that sums the
counts of its microbatches (``total += count``, starting from a zero
constant) makes another such constant, the sum; ``1 / count`` (torch's
``reciprocal``, times a number) is kept pending (``CountReciprocal``) until
a product reads it, which is then the other factor divided by the count:
the gradients a step scales by the reciprocal of its all-reduced token
count (Megatron's ``finalize_model_grads`` with ``calculate_per_token_loss``;
docs/soundness.md, "Plans traced from PyTorch", 85).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.ir import Bucket, Const, Pending, pending_of
from backends.torch.lowering.mask_values import Count, Quotient, summed
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class CountReciprocal(Pending):
    """``factor / count``: read only as a factor of a product."""
    count: Count
    factor: float = 1.0

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: the reciprocal of a count of kept labels is read other "
                            f"than as a factor of a product")


def _zero_constant(lw: Lowerer, a: Any) -> bool:
    """``a`` is a recorded constant that is 0 (a running total's start)."""
    return isinstance(pending_of(lw, a), Const) and lw.const(a) == 0.0


def _count_plus(lw: Lowerer, a: Any, b: Any) -> Count | None:
    """``a + b`` for counts (or a count and a zero constant); None otherwise."""
    ca, cb = pending_of(lw, a), pending_of(lw, b)
    if isinstance(ca, Count) and isinstance(cb, Count):
        return Count(ca.value + cb.value, ca.unsummed or cb.unsummed, ca.held + cb.held)
    if isinstance(ca, Count) and _zero_constant(lw, b):
        return ca
    if isinstance(cb, Count) and _zero_constant(lw, a):
        return cb
    return None


@refines("aten.add.Tensor", "aten.add_.Tensor")
def count_add(base: Handler) -> Handler:
    """A sum of counts (a schedule's total over its microbatches) is a count."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if kwargs.get("alpha", 1) == 1 and len(args) > 1:
            total = _count_plus(lw, args[0], args[1])
            if total is not None:
                return total
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.reciprocal.default")
def count_reciprocal(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        c = pending_of(lw, args[0])
        if isinstance(c, Count):
            return CountReciprocal(c)
        return base(lw, args, kwargs, shapes, group)
    return lower


def divided(lw: Lowerer, x: int, r: CountReciprocal, shapes: list) -> int:
    """``x * factor / count``, the count's value exact."""
    c = r.count
    if c.value == 0 and not c.unsummed:
        raise LoweringError(f"{lw.name}: a scale by the reciprocal of a count of kept labels "
                            f"that is 0 in the recorded batch")
    if r.factor != 1.0:
        x = lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": r.factor})[0]
    # the pass that only collects the ranks' counts (lower_ranks) divides by a
    # placeholder where this rank's own count is 0; it is lowered again with the sum
    value = float(c.value) if c.value else 1.0
    return lw.emit("div", [x], shapes, {"value": value})[0]


def _scaled(lw: Lowerer, x: Any, r: CountReciprocal, shapes: list) -> Any:
    """``x`` times ``r``: a product of a number and ``r`` stays pending; a
    bucket of gradients is scaled piece by piece."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return CountReciprocal(r.count, r.factor * float(x))
    px = pending_of(lw, x)
    if isinstance(px, Const) and lw.const(x) is not None:  # a number held in a tensor
        return CountReciprocal(r.count, r.factor * lw.const(x))
    if isinstance(px, Bucket):
        return Bucket(tuple(divided(lw, p, r, [lw.shapes[p]]) for p in px.pieces))
    return divided(lw, lw.val(x), r, shapes)


@refines("aten.mul.Tensor", "aten.mul_.Tensor")
def count_scale(base: Handler) -> Handler:
    """A product with the reciprocal of a count: the other factor divided by
    it; with a quotient by a count, the product divided by the count."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        for mine, other in ((args[1], args[0]), (args[0], args[1])):
            r = pending_of(lw, mine)
            if isinstance(r, CountReciprocal):
                return _scaled(lw, other, r, shapes)
        for i, q in enumerate(pending_of(lw, a) for a in args[:2]):
            if isinstance(q, Quotient) and isinstance(q.x, int) \
                    and pending_of(lw, args[1 - i]) is not None:  # times a tensor
                other = lw.val(args[1 - i])
                pair = [other, q.x] if i else [q.x, other]
                return q.divided(lw, lw.emit("mul", pair, shapes)[0])
        return base(lw, args, kwargs, shapes, group)
    return lower


#: a count compared with a number: op -> the comparison
_COMPARISONS = {
    "aten.gt.Scalar": lambda a, b: a > b, "aten.ge.Scalar": lambda a, b: a >= b,
    "aten.lt.Scalar": lambda a, b: a < b, "aten.le.Scalar": lambda a, b: a <= b,
    "aten.eq.Scalar": lambda a, b: a == b, "aten.ne.Scalar": lambda a, b: a != b,
}


@dataclass(frozen=True)
class CountTest(Pending):
    """A count compared with a number: ``holds`` in the real step (the
    count's value), ``taken`` in the traced run (the number the rank held,
    its own count where the fake group's all-reduce left it). Read only
    by Python (``if count > 0:``): ``decided`` checks the two agree."""
    holds: bool
    taken: bool
    unsummed: bool

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a comparison of a count of kept labels is read other "
                            f"than by a branch of the program")


def _compare(op: str) -> Any:
    def refine(base: Handler) -> Handler:
        def lower(lw: Lowerer, args, kwargs, shapes, group):
            c = pending_of(lw, args[0])
            if isinstance(c, Count) and isinstance(args[1], (int, float)) \
                    and not isinstance(args[1], bool):
                test = _COMPARISONS[op]
                return CountTest(bool(test(c.value, args[1])), bool(test(c.held, args[1])),
                                 c.unsummed)
            return base(lw, args, kwargs, shapes, group)
        return lower
    return refine


for _op in _COMPARISONS:
    refines(_op)(_compare(_op))


def decided(lw: Lowerer, v: int, scope: str) -> None:
    """Python read value ``v`` of a count all-reduced (``if count > 0:``):
    the branch the traced run took must be the one the real step takes, the
    comparison of the group's total; in the pass that only collects the
    ranks' counts the total is not known yet (checked in the next)."""
    x = lw.env.get(v)
    if isinstance(x, CountTest) and x.unsummed:
        return
    if isinstance(x, CountTest) and x.holds == x.taken:
        return
    if isinstance(x, CountTest):
        raise LoweringError(f"{scope or 'top level'}: a branch on an all-reduced count of kept "
                            f"labels: the traced run took it on this rank's own count "
                            f"({x.taken}), the real step on the group's total ({x.holds})")
    raise LoweringError(f"{scope or 'top level'}: Python reads the value of an all-reduced "
                        f"tensor other than a comparison of a count of kept labels with a number")


def _broadcast_count(lw: Lowerer, args) -> Count | None:
    """A broadcast of one count from its root to a group of several
    (Megatron's token count, from the last pipeline stage to the others,
    which hold a zero constant): the root's count on every member. It is
    reduced as the sum of the members' shares, the root's count and 0 from
    every other member (``lower_ranks`` adds them up), so each member's
    value is the root's; the number this rank traced with is what the
    broadcast wrote (``Exchanges.broadcast``: the root's), or its own
    where none was written (docs/soundness.md, "Plans traced from
    PyTorch", 102 (d))."""
    ranks = tuple(args[1][1])
    if len(args[0]) != 1 or len(ranks) < 2:
        return None
    c, root = pending_of(lw, args[0][0]), ranks[int(args[2])]
    mine = lw.trace["rank"] == root
    if not (isinstance(c, Count) if mine else isinstance(c, Count) or _zero_constant(lw, args[0][0])):
        return None
    if lw.counts is None:
        raise LoweringError(f"{lw.name}: a broadcast count of kept labels needs every rank's "
                            f"counts (lower the ranks with lower_ranks)")
    out = lw.trace["events"][lw.event][2][0]
    held = c.held if mine else int(lw.trace.get("answers", {}).get(out, 0))
    k = len(lw.count_reduces)
    lw.count_reduces.append((ranks, c.value if mine else 0))
    if lw.counts == "collect":
        return Count(c.value if mine else 0, unsummed=True, traced=held)
    return summed(lw, k, held)


@refines("c10d.broadcast_.default")
def count_broadcast(base: Handler) -> Handler:
    """A broadcast of counts over a group of one member (Megatron's
    broadcast of the token count from the last pipeline stage, at pipeline
    size 1) leaves them as they are; over several, the root's
    (``_broadcast_count``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        counts = [pending_of(lw, t) for t in args[0]]
        if counts and all(isinstance(c, Count) for c in counts) and len(tuple(args[1][1])) == 1:
            return counts
        count = _broadcast_count(lw, args)
        if count is not None:
            return [count]
        return base(lw, args, kwargs, shapes, group)
    return lower
