"""The masks family's pending values and the arithmetic of flags.

``NegInfMask``, ``Masked``, ``DeadRows`` and ``Count`` stand for values no
plan holds (-inf, NaN rows, a recorded count) until the one reader that may
take them (an addition to scores, a softmax, a masked_fill, a divisor)
rewrites them; anything else reading one is refused. A flag's negation and
``ids == c`` are written on the one-hot ids (backends/torch/lowering/masks.py
explains both kinds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.ir import Flag, Pending
from backends.torch.lowering.onehot import label_values, one_hot

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


#: the score a hidden position stands in with when the masked softmax picks
#: its shift (the largest kept score); any shift gives the same probabilities
HIDDEN_SCORE = 1e30


@dataclass(frozen=True)
class NegInfMask(Pending):
    """An additive float mask, 0 where ``keep`` holds and -inf elsewhere
    (SDPA's conversion of a boolean ``attn_mask``, or ``where(keep, 0,
    -inf)``): only an addition to scores or SDPA may read it."""
    keep: Flag

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: an additive -inf mask is read other than by SDPA or an "
                            f"addition to attention scores (-inf is no value a plan holds)")


@dataclass(frozen=True)
class Masked(Pending):
    """Scores ``x`` with -inf where ``keep`` is false: only a softmax may read them."""
    x: int
    keep: Flag

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: scores masked with -inf are read other than by a "
                            f"softmax (-inf is no value a plan holds)")


@dataclass(frozen=True, eq=False)
class DeadRows(Pending):
    """A masked softmax ``x`` with rows of no kept position (``dead``,
    recorded, broadcast over the row): NaN in torch, 0 in ``x``. Only a
    ``masked_fill`` with 0 whose mask hides every entry of those rows (the
    recorded one: CPM-Ant's attention zeroes what it masked) and the
    softmax's backward read it."""
    x: int
    dead: np.ndarray

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a row of attention has every position masked with -inf "
                            f"(torch computes NaN there) and is read other than by a masked_fill "
                            f"with 0 of every entry of the row")


@dataclass(frozen=True)
class Count(Pending):
    """The number of true entries of a flag in the recorded batch (after a
    SUM all-reduce, the group's total): read only as a divisor, a constant
    of the traced step like the cross-entropy's own mean count.
    ``unsummed``: an all-reduced count in the pass that only collects the
    ranks' counts (its value this rank's alone; ``lower_ranks`` lowers
    again with the sum). ``traced``: what the rank's tensor held in the
    trace, where the fake group's all-reduce left its own count (None: the
    value)."""
    value: int
    unsummed: bool = False
    traced: int | None = None

    @property
    def held(self) -> int:
        """The number the traced run computed with."""
        return self.value if self.traced is None else self.traced

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a count of a mask's true entries is read other than as "
                            f"a divisor")


@dataclass(frozen=True)
class Quotient(Pending):
    """``x / count`` not yet emitted: read by a product, the product of
    ``x`` divided by the count afterwards (the order the single-device
    cross-entropy's backward divides in, ``NllGrad``); read otherwise, the
    division (docs/soundness.md, "Plans traced from PyTorch", 120 (a))."""
    x: Any  # a value id, or a pending broadcast of one (``where``'s)
    divisor: float

    def materialize(self, lw: Lowerer) -> int:
        return self.divided(lw, lw.materialize(self.x))

    def divided(self, lw: Lowerer, y: int) -> int:
        return lw.emit("div", [y], [lw.shapes[y]], {"value": self.divisor})[0]


class Tentative(list):
    """The sums of the ranks' counts of a pass that chains them (a count
    broadcast, then all-reduced: ``lower_ranks``): counts read from it are
    still ``unsummed``, as in the pass that only collects them."""


def summed(lw: Lowerer, k: int, held: int) -> Count:
    """The k-th all-reduced (or broadcast) count of this rank, its sum over
    the members as ``lower_ranks`` gave it; ``held``: the number traced."""
    return Count(lw.counts[k], unsummed=isinstance(lw.counts, Tentative), traced=held)


def expanded(lw: Lowerer, x: int, shape: tuple[int, ...]) -> int:
    if lw.shapes[x] == tuple(shape):
        return x
    return lw.emit("expand", [x], [shape], {"shape": list(shape)})[0]


def one_minus(lw: Lowerer, x: int) -> int:
    shape = [lw.shapes[x]]
    negated = lw.emit("mul_scalar", [x], shape, {"value": -1.0})[0]
    return lw.emit("add_scalar", [negated], shape, {"value": 1.0})[0]


def flag_not(lw: Lowerer, f: Flag) -> Flag:
    return Flag(one_minus(lw, f.x), ~f.value)


# -- flags from the batch's ids ---------------------------------------------------

def ids_equal(lw: Lowerer, a: Any, c: int) -> Flag:
    """``ids == c``: the one-hot column c; for c outside the vocabulary,
    ``1 - (row sum)``, 0 on every one-hot row and 1 on the zero rows of
    pads, which must then all be c."""
    ids = np.asarray(label_values(lw, a))
    outside = (ids < 0) | (ids >= lw.vocab)
    if np.any(outside & (ids != c)):
        raise LoweringError(f"{lw.name}: ids outside the vocabulary other than {c} compared "
                            f"with {c}")
    onehot = one_hot(lw, a)
    shape = lw.shapes[onehot]
    rows = (*shape[:-1], 1)
    if 0 <= c < lw.vocab:
        column = lw.emit("narrow", [onehot], [rows], {"dim": len(shape) - 1, "start": c,
                                                       "length": 1})[0]
    else:
        column = one_minus(lw, lw.emit("sum", [onehot], [rows], {"dim": len(shape) - 1,
                                                                  "keepdim": True})[0])
    return Flag(lw.reshape(column, tuple(shape[:-1])), ids == c)
