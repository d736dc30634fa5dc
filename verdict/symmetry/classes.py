"""Classes of blocks: the replicas and microbatches of a materialized plan
grouped by program.

A correct plan may run another, equal program on some replicas or in some
microbatches. Instead of verifying such a plan node by node,
:func:`block_classes` partitions the replicas into classes and the
microbatches into classes, so that every block (replica d, microbatch m)
runs the block program of (representative of d's class, representative of
m's class) and every replica the step program of its class's
representative (checked by the block check of verdict/symmetry/blocks.py); one cut
per pair of classes is then proved (verdict/symmetry/find.py). docs/soundness.md,
"Materialized plans", "When the blocks differ: classes", holds the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verdict.lineage import StructureError
from verdict.symmetry.blocks import BlockCheck

#: Most check passes (each finds one new class); past them the plan is
#: verified in full.
MAX_PASSES = 8


@dataclass(frozen=True)
class Axis:
    """The classes of one axis (replicas or microbatches): ``rep_of[i]`` the
    representative (lowest member) of i's class; ``why[r]`` for a
    representative other than 0, the first node where it differed from the
    class it was compared with."""

    name: str
    rep_of: np.ndarray
    why: dict[int, str]

    def representatives(self) -> list[int]:
        return sorted({int(r) for r in self.rep_of.tolist()})

    def members(self, r: int) -> list[int]:
        return np.flatnonzero(self.rep_of == r).tolist()

    def base(self) -> int:
        """The representative of the largest class (ties: lowest index)."""
        return max(self.representatives(), key=lambda r: (len(self.members(r)), -r))


def block_classes(check: BlockCheck, limit: int = MAX_PASSES) -> tuple[Axis, Axis]:
    """The replica and microbatch classes of the plan ``check`` reads, after
    the check found every block equal to its class representative's.

    Each pass compares every block (d, m) with (rep(d), rep(m)) and every
    step program of d with rep(d)'s. A difference on a representative
    replica is one of microbatches (its block m differs from its block
    rep(m)): those microbatches get a new class. Otherwise the differing
    replicas get a new class. Raises StructureError('symmetry') naming the
    first finding when a rule (not a comparison) is broken or past
    ``limit`` passes; the caller then verifies the plan in full."""
    rep_d = np.zeros(check.fold.dp, dtype=np.int64)
    rep_m = np.zeros(check.fold.nm, dtype=np.int64)
    why_d: dict[int, str] = {}
    why_m: dict[int, str] = {}
    for _ in range(limit):
        check.rep_of_d, check.rep_of_m = rep_d, rep_m
        check.examine()
        rules = [f for f in check.found if f[1] is None]
        if rules:
            check.found = rules
            check.raise_first()
        if not check.differs.any():
            return Axis("replica", rep_d, why_d), Axis("microbatch", rep_m, why_m)
        n_d, n_mb = check.n_d, check.cols.n_mb
        in_mb = check.differs & (rep_d[n_d] == n_d) & (n_mb >= 0)
        if in_mb.any():
            new = np.unique(n_mb[in_mb])
            rep_m = rep_m.copy()
            rep_m[new] = new[0]
            why_m[int(new[0])] = _first(check, in_mb)
        else:
            new = np.unique(n_d[check.differs])
            rep_d = rep_d.copy()
            rep_d[new] = new[0]
            why_d[int(new[0])] = _first(check, check.differs)
    raise StructureError("symmetry", f"more than {limit} passes looking for classes of "
                                     f"replicas and microbatches")


def _first(check: BlockCheck, nodes: np.ndarray) -> str:
    """The first finding on ``nodes`` (a mask), or the first of all."""
    mine = [f for f in check.found if nodes[f[0]]]
    check.found = mine or check.found
    return check.first_finding()
