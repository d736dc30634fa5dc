"""The lowering's pending values of gradient norms and of the optimizer step
(the protocol and the other kinds: ``ir``).

- ``Norm``: made by arithmetic, collectives; read by arithmetic, compose,
  norm_sums; ``div`` by the share, ``pow`` 0.5.
- ``NormStack``: made by arithmetic, collectives; read by arithmetic,
  collectives, norm_sums; not Pending.
- ``Decayed``: made by arithmetic (AdamW, SGD: Moment1, Moment2, Scaled,
  Denom, SgdGrad); read by arithmetic, walk (the final values); not Pending:
  folded into ``adam_step`` / ``sgd`` nodes.
- ``NormIsZero``: made by arithmetic (``norm == 0``); read by arithmetic
  (``masked_fill_``); not Pending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.torch.lowering.pending import Pending

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class Norm(Pending):
    """sqrt(s / share), s a sum of squares (so s >= 0): a 2-norm, not yet
    emitted. ``share`` is n when DTensor turned a replicated norm into one
    of n partial norms (dividing it by sqrt(n))."""
    s: int
    share: int = 1

    def materialize(self, lw: Lowerer) -> int:
        s = self.s
        if self.share != 1:
            s = lw.emit("div", [s], [lw.shapes[s]], {"value": float(self.share)})[0]
        return lw.emit("pow", [s], [lw.shapes[s]], {"exponent": 0.5})[0]


@dataclass(frozen=True)
class NormStack:
    """torch.stack of norms (``squared``: then squared elementwise, one
    square sum per entry, ``Norm.share`` kept)."""
    norms: tuple[Norm, ...]
    squared: bool = False


@dataclass(frozen=True)
class Decayed:
    """p * keep: AdamW's decoupled weight decay, ``p.mul_(1 - lr * wd)``."""
    p: int
    keep: float


@dataclass(frozen=True)
class Moment1:
    """``m.lerp_(g, weight)``: Adam's first moment, m a fresh state."""
    m: int
    g: int
    weight: float


@dataclass(frozen=True)
class Scaled:
    """``v.mul_(factor)`` of a fresh optimizer state."""
    v: int
    factor: float


@dataclass(frozen=True)
class Moment2:
    """``v.mul_(beta2).addcmul_(g, g, value=1 - beta2)``: Adam's second moment."""
    v: int
    g: int
    beta2: float


@dataclass(frozen=True)
class Denom:
    """``(sqrt(v2) / scale) + eps``: Adam's denominator (``root``: sqrt only)."""
    v2: Moment2
    scale: float = 1.0
    eps: float = 0.0
    root: bool = False


@dataclass(frozen=True)
class SgdGrad:
    """``g + wd * p`` (``torch.add(g, p, alpha=wd)``): SGD's weight decay."""
    g: int
    p: int
    wd: float


@dataclass(frozen=True)
class NormIsZero:
    """``norm == 0`` for a 2-norm along dims (kept dims) of a tensor."""
    norm: int
