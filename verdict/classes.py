"""Replica classes: the replicas of a materialized plan grouped by program.

A correct plan may run another, equal program on some replicas. Instead of
verifying such a plan node by node, :func:`replica_classes` partitions the
replicas into classes of equal programs (every replica compared with its
class's representative by the block check of verdict/blocks.py), so that
one cut per class is proved (verdict/symmetry.py). docs/soundness.md,
"Materialized plans", "When the blocks differ: replica classes", holds the
argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verdict.blocks import BlockCheck
from verdict.lineage import StructureError

#: Most classes looked for; a plan with more is verified in full.
MAX_CLASSES = 8


@dataclass(frozen=True)
class ReplicaClasses:
    """``rep_of[d]``: the representative replica of replica d's class (its
    lowest replica); ``why[r]``: for a representative r other than 0, the
    first node where it differs from the class it was compared with."""

    rep_of: np.ndarray
    why: dict[int, str]

    def representatives(self) -> list[int]:
        return sorted({int(r) for r in self.rep_of.tolist()})

    def members(self, r: int) -> list[int]:
        return np.flatnonzero(self.rep_of == r).tolist()

    def base(self) -> int:
        """The representative of the largest class (ties: lowest replica)."""
        return max(self.representatives(), key=lambda r: (len(self.members(r)), -r))


def replica_classes(check: BlockCheck, limit: int = MAX_CLASSES) -> ReplicaClasses:
    """Run ``check`` until every replica matches its class's representative.

    Raises StructureError('symmetry') naming the first finding when a rule
    (not a comparison) is broken, when a representative's own microbatches
    differ (no replica class holds that), or past ``limit`` classes; the
    caller then verifies the plan in full."""
    rep_of = np.zeros(check.fold.dp, dtype=np.int64)
    why: dict[int, str] = {}
    for _ in range(limit):
        check.rep_of_d = rep_of
        check.examine()
        rules = [f for f in check.found if f[1] is None]
        if rules:
            check.found = rules
            check.raise_first()
        differing = np.unique(check.n_d[check.differs])
        if not differing.size:
            return ReplicaClasses(rep_of, why)
        if (rep_of[differing] == differing).any():
            own = differing[rep_of[differing] == differing]
            check.found = [f for f in check.found if int(check.n_d[f[0]]) in own.tolist()]
            raise StructureError("symmetry", f"{check.first_finding()} (the microbatches of "
                                             f"one replica differ: no replica class)")
        r = int(differing[0])
        check.found = [f for f in check.found if int(check.n_d[f[0]]) == r] or check.found
        why[r] = check.first_finding()
        rep_of = rep_of.copy()
        rep_of[differing] = r
    raise StructureError("symmetry", f"more than {limit} classes of replicas")
