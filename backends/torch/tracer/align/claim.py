"""Which piece of its single-device value a rank's value is (``Claim``), and
where that piece lies on the rank's mesh (``Pieces``: the axes' sizes and
the rank's coordinates, the slices and partial-sum parts a claim stands for)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from backends.torch.errors import WrongStep
from backends.torch.lowering import LNode, Lowered, LoweringError, padded_rows

#: HSDP: "dp" as its two sub-axes, replicas outer, shards inner (data-parallel
#: rank d is replica d // s, shard d % s), so a cut or a partial sum over
#: both, in this order, is one over "dp" (docs/soundness.md, "HSDP")
DP_SUBAXES = ("dpr", "dps")
SIZE_KWARGS = ("shape", "sizes", "index", "parts", "value")
#: the first character of the name standing first in a dim's axes when the
#: dim is k equal parts and the axes after it cut each part (``/k``: a
#: strided shard, ``placements.strided_marker``; docs/soundness.md, "Plans
#: traced from PyTorch", 87). Its size is 1: it cuts nothing by itself.
STRIDED = "/"


def is_marker(axis: str) -> bool:
    """The axis names a strided dim's parts, no mesh dim."""
    return axis.startswith(STRIDED)


def strided(dims: list[list[str]]) -> tuple[int, int, list[str]] | None:
    """The strided dim of a claim's dims: (dim, parts, the axes cutting each
    part); None when no dim is strided, (dim, 0, []) when a marker stands
    anywhere but first in a dim's axes or in more than one dim (a value
    no piece names: loose, never re-claimed)."""
    found = [(d, axes) for d, axes in enumerate(dims) if any(is_marker(a) for a in axes)]
    if not found:
        return None
    d, axes = found[0]
    if len(found) > 1 or not is_marker(axes[0]) or any(is_marker(a) for a in axes[1:]) \
            or not axes[1:]:
        return d, 0, []
    return d, int(axes[0][len(STRIDED):]), list(axes[1:])


@dataclass
class Claim:
    """Which piece of its single-device value a value is: the mesh axes
    cutting each dim (``mb``: a pipeline's microbatches), the axes it is a
    partial sum over, and, when partial over ``mb``, the microbatches
    [lo, hi) it sums (None: its own microbatch), and the exact factor it
    is of that piece (docs/soundness.md, "Scaled claims"). A dim whose
    size the axes do not divide is cut as ``torch.chunk`` cuts it (FSDP2's
    and DTensor's padded shards: ``lower.padded_rows``). ``at``: the
    coordinates the axes are read at when they are not the holder's (a
    piece received from another rank)."""
    dims: list[list[str]]
    partial: frozenset[str] = frozenset()
    mbs: tuple[int, int] | None = None
    scale: Fraction = Fraction(1)
    at: dict[str, int] | None = None
    #: partial over the ring's steps ("step"): the parts [lo, hi) of n it sums,
    #: n the key (or query) blocks that contribute to it (docs/soundness.md,
    #: "Plans traced from PyTorch", 53 (f))
    steps: tuple[int, int, int] | None = None
    #: a value of no single-device tensor (a ring block's softmax over part of
    #: its keys, a running merge): its number k > 0, whole along its own
    #: shape, part 0 of a partial maximum of size -(k + 1) that no other
    #: tensor uses, so never grouped (53 (e)); 0 for any other value
    loose: int = 0


def rank_coords(coords: dict[str, int], sizes: dict[str, int]) -> dict[str, int]:
    """A rank's coordinates as its claims read them: "cp" at 0 when the
    mesh has none, and under HSDP the data-parallel sub-coordinates (rank
    d is replica d // s, shard d % s). A new dict: the lowered trace's own
    is left as it is."""
    out = dict(coords)
    out.setdefault("cp", 0)
    out.update({a: 0 for a in sizes if is_marker(a)})  # a strided dim's parts: no coordinate
    if "dps" in sizes:
        d = out["dp"]
        out.update(dpr=d // sizes["dps"], dps=d % sizes["dps"])
    return out


def key_kwargs(kw: dict) -> tuple:
    """A node's kwargs as a key of the single-device nodes, sizes left out
    (a rank's node runs on pieces of the single-device node's values)."""
    return tuple(sorted((k, repr(v)) for k, v in kw.items() if k not in SIZE_KWARGS))


def scope(name: str) -> str:
    """A recorded module path as a plan node's name."""
    return name.removeprefix("bw:").removeprefix("Llama.") or "step"


class Pieces:
    """A rank's mesh (``sizes``, the coordinates in ``low``) and the state of
    its alignment: each value's single-device value (``sv``), its claim and
    its microbatch; what a claim's axes give on this mesh."""

    b: Any
    low: Lowered
    sizes: dict[str, int]
    dp: list[str]
    axes: tuple[str, ...]
    part_axes: tuple[str, ...]
    sv: dict[int, int]
    claim: dict[int, Claim]
    mb: dict[int, int]
    producer: dict[int, LNode]
    #: a strided value (its claim has a ``STRIDED`` marker) -> its loose number
    strided_loose: dict[int, int]
    made_at: dict[int, int] | None
    #: single-device value -> the outputs of the forward nodes reading it (``downstream``)
    fw_readers: dict[int, list[int]] | None

    def atomic(self, axes) -> list[str]:
        """Axes with "dp" written as the atomic axes it stands for."""
        return [x for a in axes for x in (self.dp if a == "dp" else [a])]

    def orders(self, order: tuple) -> tuple:
        return tuple(tuple(self.atomic(axes)) for axes in order)

    def cuts(self, local: int, full: int, order: tuple) -> list[tuple[str, ...]]:
        """Every axes of ``order`` (in its order) cutting ``full`` into
        pieces of ``local`` on this mesh; ``[()]`` when local is full."""
        ratio = full // local if local else 1
        if ratio == 1:
            return [()]
        return [a for a in self.orders(order)
                if math.prod(self.sizes[x] for x in a) == ratio and all(self.sizes[x] > 1 for x in a)]

    def single_order(self) -> dict[int, int]:
        """Each single-device value -> the index of the node that makes it
        (inputs absent), computed once."""
        if self.made_at is None:
            self.made_at = {o: i for i, n in enumerate(self.b.s.low.nodes)
                            for o in n.outs if o >= 0}
        return self.made_at

    def gshape(self, v: int) -> tuple[int, ...]:
        return self.b.s.low.shapes[self.sv[v]]

    def guess(self, local: int, full: int, used: tuple[str, ...] = (),
              order: tuple = (("tp",), ("dp",), ("dp", "tp"))) -> list[str]:
        """Axes cutting a dim by full/local with no tie to say which: the first
        of ``order`` of the right size not already cutting another dim."""
        ratio = full // local if local else 1
        if ratio == 1:
            return []
        order = self.orders(order)
        for axes in [list(a) for a in order if not set(a) & set(used)] + [list(a) for a in order]:
            if math.prod(self.sizes[a] for a in axes) == ratio and all(self.sizes[a] > 1 for a in axes):
                return axes
        raise LoweringError(f"rank {self.low.rank}: a dim of size {local} is not a piece of "
                            f"{full} on this mesh")

    def fits(self, axes: list[str], full: int, local: int, source: int | None) -> bool:
        """Axes carried to an output dim give its local size: in equal pieces,
        or in torch.chunk's only when carried from an input dim of the same
        size (a padded shard through an elementwise op), never when they
        cut a dim of another size (a reshape) that they do not divide."""
        if full % math.prod(self.sizes[a] for a in axes) == 0 or source == full:
            return self.extent(axes, full) == local
        return False

    def extent(self, axes: list[str], full: int) -> int:
        """The size of this rank's piece of a dim of ``full`` cut by ``axes``."""
        lo, hi = self.piece(axes, full, self.low.coords)
        return hi - lo

    def piece(self, axes: list[str], full: int, coords: dict[str, int]) -> tuple[int, int]:
        """The [lo, hi) of a dim of ``full`` cut by ``axes`` at ``coords``:
        equal pieces, or (a size the axes do not divide) torch.chunk's."""
        n = math.prod(self.sizes[a] for a in axes)
        index = 0
        for a in axes:
            index = index * self.sizes[a] + coords.get(a, 0)
        if full % n:
            return padded_rows(full, n, index)
        return index * (full // n), (index + 1) * (full // n)

    def check(self, v: int, uneven: bool = False) -> None:
        """Axes that do not give a dim's local size are replaced by a guess.
        A dim the axes do not divide keeps them (torch.chunk's pieces) only
        when ``uneven``: the axes were carried from a dim of the same size
        (``fits``, a collective's input)."""
        full, local = self.gshape(v), self.low.shapes[v]
        c = self.claim[v]
        for d, n in enumerate(local):
            if d < len(full) and n > full[d]:
                node = self.producer.get(v)
                where = f"{node.op} at {scope(node.name)}" if node is not None else "a value"
                raise WrongStep(f"rank {self.low.rank}: {where} makes {n} entries along dim {d} "
                                f"where the single-device step's value has {full[d]}: no piece "
                                f"of it (a layout that takes whole values for pieces counts "
                                f"them more than once)")
        for d, axes in enumerate(c.dims):
            even = full[d] % math.prod(self.sizes[a] for a in axes) == 0
            if self.extent(axes, full[d]) != local[d] or not (even or uneven):
                c.dims[d] = self.guess(local[d], full[d])
        self.whole_where_held(v)

    def whole_where_held(self, v: int) -> None:
        """A dim whose piece is all of it (the only member holding rows of a
        padded dim) is claimed whole: its axes cut nothing, and no axis may
        reach another dim through it."""
        c = self.claim[v]
        if c.at is None:
            c.dims = [[] if axes and self.extent(axes, n) == n else axes
                      for axes, n in zip(c.dims, self.gshape(v))]

    def view(self, v: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, int, int]]:
        c, local = self.claim[v], self.low.shapes[v]
        if c.loose:
            return tuple((0, n) for n in local), (0, 1, -(c.loose + 1))
        if strided(c.dims) is not None:  # ranges of its value, no block: written loose (87)
            if v not in self.strided_loose:
                self.strided_loose[v] = self.b.loose_number()
            return tuple((0, n) for n in local), (0, 1, -(self.strided_loose[v] + 1))
        coords = {**self.low.coords, **(c.at or {}), "mb": self.mb.get(v, -1)}
        full = self.gshape(v)
        slices = []
        for d, axes in enumerate(c.dims):
            index = 0
            for a in axes:
                index = index * self.sizes[a] + coords[a]
            if full[d] % math.prod(self.sizes[a] for a in axes):
                slices.append(self.piece(axes, full[d], coords))
            else:
                slices.append((index * local[d], (index + 1) * local[d]))
        n, lo, hi = 1, 0, 1
        for a in self.part_axes:
            size = c.steps[2] if a == "step" and c.steps else self.sizes[a]
            if a in c.partial and size > 1:
                first, last = (c.mbs if a == "mb" and c.mbs else c.steps[:2] if a == "step"
                               else (coords[a], coords[a] + 1))
                n *= size
                lo, hi = lo * size + first, (hi - 1) * size + last
        cut = any("mb" in d for d in c.dims) or ("mb" in c.partial and c.mbs is None)
        if cut and coords["mb"] < 0:
            raise LoweringError(f"rank {self.low.rank}: a value outside the schedule's "
                                f"microbatches is cut by microbatches")
        return tuple(slices), (lo, hi, n)
