"""The mesh axes a process group runs along, read from its members: a
library's own groups (Megatron's expert-data-parallel group, the ranks of
several axes of the dp x cp x tp mesh) are its own, so a collective's group
is read from the ranks it holds, never from its name (docs/soundness.md,
"Plans traced from PyTorch", 113)."""

from __future__ import annotations

from math import prod


def product_axes(group: tuple[int, ...], coords: dict[int, dict[str, int]],
                 axes: tuple[str, ...], sizes: dict[str, int]) -> list[str] | None:
    """The axes, in mesh order (outer first), whose product ``group`` is:
    its members hold every combination of those axes' coordinates once,
    and agree on every other axis, listed in the mesh's rank order (the
    order a gather concatenates and a scatter cuts in). None for any other
    group (part of an axis, a diagonal, members out of order)."""
    varying = [a for a in axes if len({coords[r][a] for r in group}) > 1]
    if len(group) != prod(sizes.get(a, 1) for a in varying):
        return None
    seen = {tuple(coords[r][a] for a in varying) for r in group}
    if len(seen) != len(group):
        return None
    order = sorted(group, key=lambda r: tuple(coords[r][a] for a in axes))
    if list(group) != order:
        return None
    return varying
