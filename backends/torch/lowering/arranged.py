"""An all-to-all of a rearranged tensor, read through the views after it
(docs/soundness.md, "Plans traced from PyTorch", 52).

Ulysses-style context parallelism (DeepSpeed, VeOmni) reshapes and permutes
a tensor so that dim 0 numbers the destination, runs an all-to-all, and
moves the received blocks back into place with more views. No single-device
value is any of the tensors in between. This module follows the elements
instead of the tensors:

- ``blocks_of``: on the sending member, the all-to-all's input is a chain of
  views (``transpose``, ``flatten``, ``unflatten``, ``narrow`` nodes) of an
  earlier value, its *base*; replaying the chain on the base's element
  numbers (numpy) gives, for every element of the block sent to each
  destination, the base element it is.
- ``Arranged``: on the receiving member, the output as, for every element,
  the member it came from and the element of that member's base it is; the
  views after the all-to-all act on these numbers only.
- ``Arranged.settle``: once the numbers are exactly a box of the members'
  bases all-gathered along some dim d, in the base's own dim order, the
  value is that all-gather (``all_gather`` along d over the group) narrowed
  to the box. Every element is where the all-to-all and the views put it,
  so the two are the same tensor; the all-gather's and the narrow's claims
  are then inferred and proved like any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import narrow, permuted
from backends.torch.lowering.ir import Pending

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: lowered nodes that only rearrange their one input's elements
VIEWS = ("transpose", "flatten", "unflatten", "narrow", "split")


def _producer(lw: Lowerer, v: int):
    for node in reversed(lw.nodes):
        if v in node.outs:
            return node
    return None


def _replay_view(node, numbers: np.ndarray) -> np.ndarray:
    """What a view node does to its input's element numbers."""
    kw = node.kwargs
    if node.op == "transpose":
        return np.swapaxes(numbers, kw["dim0"], kw["dim1"])
    if node.op == "flatten":
        s = numbers.shape
        return numbers.reshape(*s[:kw["start"]], -1, *s[kw["end"] + 1:])
    if node.op == "unflatten":
        s = numbers.shape
        return numbers.reshape(*s[:kw["dim"]], *kw["sizes"], *s[kw["dim"] + 1:])
    if node.op == "split":
        size = numbers.shape[kw["dim"]] // kw["parts"]
        return np.take(numbers, range(kw["index"] * size, (kw["index"] + 1) * size),
                       axis=kw["dim"])
    return np.take(numbers, range(kw["start"], kw["start"] + kw["length"]), axis=kw["dim"])


def chain(lw: Lowerer, x: int) -> list[tuple[int, np.ndarray]]:
    """The values x is a view of through view nodes, nearest first (x
    itself first), each with x's elements as element numbers of it."""
    path, v = [], x
    while True:
        path.append(v)
        node = _producer(lw, v)
        if node is None or node.op not in VIEWS or node.dir != "fw" or len(node.ins) != 1:
            break
        v = node.ins[0]
    out = []
    for k, base in enumerate(path):
        numbers = np.arange(math.prod(lw.shapes[base]), dtype=np.int64).reshape(lw.shapes[base])
        for v in reversed(path[:k]):
            numbers = _replay_view(_producer(lw, v), numbers)
        if numbers.shape != tuple(lw.shapes[x]):
            raise LoweringError(f"{lw.name}: the views before an all-to-all do not give its "
                                f"input's shape")
        out.append((base, numbers))
    return out


def is_box(numbers: np.ndarray, shape: tuple[int, ...]) -> bool:
    """The element numbers of a value of ``shape`` are exactly one box of it
    (as a set)."""
    if not numbers.size:
        return False
    coords = np.unravel_index(numbers.ravel(), shape)
    lens = [int(c.max() - c.min() + 1) for c in coords]
    return math.prod(lens) == numbers.size and len(np.unique(numbers)) == numbers.size


def blocks_of(lw: Lowerer, x: int, splits: tuple[int, ...]
              ) -> list[tuple[int, list[np.ndarray]]]:
    """The strict bases of x through views (nearest first) of which every
    block x sends (its rows cut by ``splits``) is a box, each with the
    blocks' element numbers of it; empty when x is no view of such a base."""
    starts = np.concatenate([[0], np.cumsum(splits)[:-1]]).astype(int)
    out = []
    for base, numbers in chain(lw, x)[1:]:
        blocks = [numbers[a:a + n] for a, n in zip(starts, splits)]
        if all(is_box(b, lw.shapes[base]) for b in blocks if b.size):
            out.append((base, blocks))
    return out


@dataclass(frozen=True)
class Base:
    """One way to read an all-to-all's output: this member's base value, the
    members' bases' shapes (group order), and for every element the element
    number of its member's base."""
    value: int
    shapes: tuple[tuple[int, ...], ...]
    flat: np.ndarray


@dataclass(eq=False)
class Arranged(Pending):
    """The output of an all-to-all of views (or views of it): for every
    element, the group position of the member it came from (``pos``) and,
    for each candidate base (``bases``), the element of that member's base
    it is. ``gathered`` is shared by every view of one output: the
    all-gathers emitted for it (one per output, whatever views read it)."""
    group: tuple[int, ...]
    pos: np.ndarray
    bases: tuple[Base, ...]
    gathered: dict = field(default_factory=dict)
    #: the form this one is a view of, and the view
    prev: Arranged | None = None
    step: tuple = ()

    def mapped(self, f, step: tuple) -> Arranged:
        """The same elements moved by ``f`` (a numpy rearrangement)."""
        return Arranged(self.group, f(self.pos),
                        tuple(Base(b.value, b.shapes, f(b.flat)) for b in self.bases),
                        self.gathered, self, step)

    def viewed(self, shape: tuple[int, ...]) -> Arranged:
        return self.mapped(lambda a: a.reshape(shape), ("view", tuple(shape)))

    def permuted(self, order: list[int]) -> Arranged:
        return self.mapped(lambda a: a.transpose(order), ("permute", tuple(order)))

    def flipped(self, dims: list[int]) -> Arranged:
        return self.mapped(lambda a: np.flip(a, dims), ("flip", tuple(dims)))

    def joins(self, others: list[Arranged]) -> bool:
        """``others`` are outputs of the same all-to-all read the same ways."""
        return all(o.gathered is self.gathered and len(o.bases) == len(self.bases)
                   and all(a.value == b.value and a.shapes == b.shapes
                           for a, b in zip(o.bases, self.bases)) for o in others)


    def _gathered(self) -> list[tuple[int, int, tuple[int, ...], list[np.ndarray]]]:
        """For each candidate base k, dim d and order of the members: the
        elements' coordinates in the bases all-gathered along d in that
        order (bases of one shape, as many dims as this form has). The
        orders tried: the group's, and the one the members' elements first
        appear in along d."""
        out = []
        n = len(self.group)
        for k, b in enumerate(self.bases):
            shape = b.shapes[0]
            if any(s != shape for s in b.shapes) or b.flat.ndim != len(shape):
                continue
            for d in range(len(shape)):
                along = np.indices(self.pos.shape)[d]
                first = [int(along[self.pos == p].min()) if (self.pos == p).any() else -1
                         for p in range(n)]
                orders = [tuple(range(n))]
                if min(first) >= 0:
                    seen = tuple(sorted(range(n), key=lambda p: first[p]))
                    if seen != orders[0]:
                        orders.append(seen)
                for order in orders:
                    slot = np.empty(n, dtype=np.int64)
                    slot[list(order)] = np.arange(n)
                    coords = list(np.unravel_index(b.flat, shape))
                    coords[d] = coords[d] + slot[self.pos] * shape[d]
                    out.append((k, d, order, coords))
        return out

    def box(self) -> tuple[int, int, tuple[int, ...], list[tuple[int, int]]] | None:
        """A candidate base k, a dim d, an order of the members and a box of
        the bases all-gathered along d in that order that the elements are,
        in its dim order; None when there is none."""
        for k, d, order, coords in self._gathered():
            bounds = []
            for j, c in enumerate(coords):
                lo = int(c.min())
                line = lo + np.arange(c.shape[j]).reshape([-1 if i == j else 1
                                                           for i in range(c.ndim)])
                if not np.array_equal(c, np.broadcast_to(line, c.shape)):
                    break
                bounds.append((lo, c.shape[j]))
            else:
                return k, d, order, bounds
        return None

    def _piece(self, lw: Lowerer, k: int, d: int, order: tuple[int, ...],
               bounds: list[tuple[int, int]]) -> int:
        """The bases all-gathered along d in ``order`` (once per output)
        narrowed to a box."""
        b = self.bases[k]
        if (k, d, order) not in self.gathered:
            if self.gathered:
                raise LoweringError(f"{lw.name}: an all-to-all's output read as pieces of two "
                                    f"gathers")
            shape = list(b.shapes[0])
            shape[d] *= len(self.group)
            group = tuple(self.group[p] for p in order)
            self.gathered[(k, d, order)] = lw.emit("all_gather", [b.value], [tuple(shape)],
                                                   {"dim": d}, group=group)[0]
        x = self.gathered[(k, d, order)]
        for j, (lo, length) in enumerate(bounds):
            x = narrow(lw, x, j, lo, length)
        return x

    def settle(self, lw: Lowerer) -> int | None:
        """The value as an all-gather narrowed to a box, emitted; None when
        the elements are no such box yet."""
        found = self.box()
        return None if found is None else self._piece(lw, *found)

    def materialize(self, lw: Lowerer) -> int:
        """The value, read by an op that is no view: the latest form that is
        a box of the gathered bases (this one, or one it is a view of),
        then the views after it as nodes."""
        steps, form = [], self
        while form is not None:
            x = form.settle(lw)
            if x is not None:
                for kind, arg in reversed(steps):
                    x = _replay(lw, x, kind, arg)
                return x
            steps.append(form.step)
            form = form.prev
        raise LoweringError(f"{lw.name}: an all-to-all's output is read as shape "
                            f"{list(self.pos.shape)}, which is no piece of its members' "
                            f"inputs gathered along one dim in any order")


def joined(items: list[Arranged], dim: int) -> Arranged:
    """The concatenation along ``dim`` of outputs of one all-to-all (``joins``)."""
    first = items[0]
    bases = tuple(Base(b.value, b.shapes, np.concatenate([i.bases[k].flat for i in items], dim))
                  for k, b in enumerate(first.bases))
    return Arranged(first.group, np.concatenate([i.pos for i in items], dim), bases,
                    first.gathered)

def _replay(lw: Lowerer, x: int, kind: str, arg: tuple) -> int:
    """A view of an emitted value, as nodes."""
    if kind == "view":
        return lw.reshape(x, arg)
    if kind == "flip":
        raise LoweringError(f"{lw.name}: a flip of an all-to-all's output after the form it "
                            f"is read in is not lowered")
    return permuted(lw, x, list(arg))
