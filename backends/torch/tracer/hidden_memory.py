"""Memory the recorder never saw allocated, written piece by piece.

``DistributedDataParallel``'s C++ reducer allocates each gradient bucket
(one flat tensor) and its per-parameter views when the wrapper is built,
before any op is recorded. In the backward it writes each gradient into
its view (``mul.out(grad, 1 / world, out=view)``, or ``view.copy_(grad)``
under a comm hook), all-reduces the whole flat bucket in place, and copies
the views back into the gradients (or, with ``gradient_as_bucket_view``,
makes the views the gradients). No op names the bucket as the
concatenation of the views: only their memory says so.

``HiddenMemory`` keeps, for each such memory (a storage first written
through a view of a larger, never-seen tensor), the regions written last
and the value each holds. A tensor read from that memory is then the value
of the region it is, a slice of the region holding it, or the
concatenation of the regions tiling it; a tensor bound to a value before
the memory's last write is stale and is read again from the regions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Region:
    """Elements [start, start + numel) of a storage hold value ``value``."""
    start: int
    numel: int
    value: int


@dataclass(frozen=True)
class Read:
    """How a tensor of tracked memory is made of recorded values: the one
    region it is (``kind`` "same"), a slice of one region at ``offset``
    ("slice"), or several regions side by side ("cat")."""
    kind: str
    values: tuple[int, ...]
    offset: int = 0
    #: kind "cuts": (value, offset in its region, numel) of each part
    cuts: tuple[tuple[int, int, int], ...] = ()


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def is_partial_view(t: torch.Tensor) -> bool:
    """``t`` is a contiguous view of part of a larger memory."""
    return (t.is_contiguous() and t.numel() > 0
            and t.untyped_storage().nbytes() > t.numel() * t.element_size())


class HiddenMemory:
    """The regions of the tracked storages, and a write count per storage
    (a binding made before the last write is stale)."""

    def __init__(self) -> None:
        self.regions: dict[int, list[Region]] = {}
        self.writes: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.regions)

    def tracks(self, storage: int) -> bool:
        return storage in self.regions

    def generation(self, t: torch.Tensor) -> int:
        """The write count of ``t``'s memory, -1 when it is not tracked."""
        return self.writes.get(storage_of(t), -1) if self.regions else -1

    def write(self, t: torch.Tensor, value: int) -> None:
        """``t`` (contiguous) now holds ``value``: regions it overlaps are
        dropped (a region only partly overwritten holds no known value)."""
        storage, start, numel = storage_of(t), t.storage_offset(), t.numel()
        end = start + numel
        kept = [r for r in self.regions.get(storage, []) if r.start + r.numel <= start or r.start >= end]
        self.regions[storage] = sorted([*kept, Region(start, numel, value)], key=lambda r: r.start)
        self.writes[storage] = self.writes.get(storage, 0) + 1

    def remainders(self, t: torch.Tensor) -> list[tuple[Region, int, int]]:
        """The parts of regions a write of ``t`` leaves as they were: for
        each region it overlaps only partly, (region, start, numel) of each
        part outside ``t`` (Megatron's all-reduce of one gradient's view of
        an already reduced bucket)."""
        start, end = t.storage_offset(), t.storage_offset() + t.numel()
        out = []
        for r in self.regions.get(storage_of(t), []):
            r_end = r.start + r.numel
            if r_end <= start or r.start >= end or (start <= r.start and r_end <= end):
                continue
            if r.start < start:
                out.append((r, r.start, start - r.start))
            if r_end > end:
                out.append((r, end, r_end - end))
        return out

    def keep(self, t: torch.Tensor, start: int, numel: int, value: int) -> None:
        """Elements [start, start + numel) of ``t``'s memory hold ``value``."""
        regions = self.regions.setdefault(storage_of(t), [])
        regions.append(Region(start, numel, value))
        regions.sort(key=lambda r: r.start)

    def read(self, t: torch.Tensor) -> Read | None:
        """What the tracked memory says ``t`` holds, or None."""
        if not t.is_contiguous() or t.numel() == 0:
            return None
        regions = self.regions.get(storage_of(t))
        if not regions:
            return None
        start, end = t.storage_offset(), t.storage_offset() + t.numel()
        for r in regions:
            if r.start <= start and end <= r.start + r.numel:
                if (r.start, r.numel) == (start, t.numel()):
                    return Read("same", (r.value,))
                return Read("slice", (r.value,), start - r.start)
        inside = [r for r in regions if start <= r.start and r.start + r.numel <= end]
        at = start
        for r in inside:
            if r.start != at:
                return self._cut(regions, start, end)
            at += r.numel
        if inside and at == end:
            return Read("cat", tuple(r.value for r in inside))
        return self._cut(regions, start, end)

    @staticmethod
    def _cut(regions: list[Region], start: int, end: int) -> Read | None:
        """Elements [start, end) as the parts of the regions that tile them,
        the first and last possibly cut (a parameter's ``main_grad`` after
        a reduce-scatter wrote a range ending inside it): ``Read("cuts")``,
        its ``cuts`` each (value, offset in the region, numel); None when the
        regions leave a gap."""
        cuts, at = [], start
        for r in regions:
            r_end = r.start + r.numel
            if r_end <= at or r.start >= end:
                continue
            if r.start > at:
                return None
            n = min(end, r_end) - at
            cuts.append((r.value, at - r.start, n))
            at += n
        return Read("cuts", tuple(v for v, _, _ in cuts), 0, tuple(cuts)) if at == end else None
