"""The (pp, dp, cp, tp) rank layout, tp fastest: a rank's class (its
stage, cp index and tp index, which replicas share) and its replica.
Used by the folded plans' uniformity check (verdict/symmetry/uniform.py) and the
materialized plans' block check (verdict/symmetry/blocks.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    dp: int
    cp: int
    tp: int

    def split(self, rank: int) -> tuple[tuple[int, int, int], int]:
        """((stage, c, t), d) of one rank."""
        t = rank % self.tp
        c = (rank // self.tp) % self.cp
        d = (rank // (self.tp * self.cp)) % self.dp
        stage = rank // (self.tp * self.cp * self.dp)
        return (stage, c, t), d

    def split_array(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(class id, replica) of an array of ranks, the class (stage, c, t)
        as the one number (stage * cp + c) * tp + t, in the ranks' type."""
        t = ranks % self.tp
        c = (ranks // self.tp) % self.cp
        d = (ranks // (self.tp * self.cp)) % self.dp
        stage = ranks // (self.tp * self.cp * self.dp)
        return (stage * self.cp + c) * self.tp + t, d
