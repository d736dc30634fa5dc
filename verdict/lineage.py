"""Lineages: for each single-device tensor Ts, the parallel tensors Tp that
claim to be pieces of it, grouped so that each group sums to a slice of Ts.

A Tp's view names (tid, lver) of the Ts it belongs to, its slice of Ts and
its parts [lo, hi) of an n-way partial sum. Part i of n is one definite
value (e.g. the contribution of batch chunk i, or of tensor-parallel shard
i), so Tp's that claim the same parts of the same slice are replicas of one
another: they form a 'same' set, whose first member stands for all.

For each slice, every whole Tp is a group of one (a replica), and the
representatives of partial parts are grouped into disjoint exact covers of
[0, n). A representative left out of them that some exact cover can still
pass through gets one (:func:`linking_covers`; it shares representatives
with other covers), so two groupings of the same parts are tied: a part
range summed as (a + b) + c on one rank and as a + (b + c) on its replica
is proved equal. A representative in no complete cover is 'loose': nothing
ties its value to Ts, and a stage that reads one knows nothing of it (but
that its replicas equal it).

Parts with a negative n are parts of an |n|-way partial maximum (a max
over a split dim before its max all-reduce). They are never grouped: they
are always loose, so a stage recomputes them from their producers and
never assumes their value.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from verdict.plan import Plan, Slices
from verdict.progress import progress


class StructureError(Exception):
    """A structural finding that makes two plans not equivalent."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Lineage:
    id: int
    ts: int  # tensor index in the single-device plan
    groups: list[tuple[Slices, tuple[int, ...]]] = field(default_factory=list)
    loose: list[int] = field(default_factory=list)
    same: list[tuple[int, ...]] = field(default_factory=list)  # replicas of one part

    @property
    def members(self) -> list[int]:
        return sorted({t for _, g in self.groups for t in g} | set(self.loose)
                      | {t for s in self.same for t in s})


def exact_covers(parts: list[tuple[int, int, int]], n: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """Disjoint exact covers of [0, n) by ranges (lo, hi, tensor); the rest."""
    remaining = sorted(parts)
    covers = []
    while True:
        cover = _one_cover(remaining, n)
        if cover is None:
            return covers, [t for _, _, t in remaining]
        covers.append(tuple(cover))
        used = set(cover)
        remaining = [p for p in remaining if p[2] not in used]


def _one_cover(parts: list[tuple[int, int, int]], n: int) -> list[int] | None:
    """One exact cover of [0, n), trying at each point the longest range first.

    A depth-first search with an explicit stack: a cover of a thousand parts
    is a thousand levels deep, beyond Python's recursion limit. Points known
    to lead to no cover are skipped, so the search visits each (point, range)
    once: linear in the number of parts."""
    by_lo: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for lo, hi, t in parts:
        by_lo[lo].append((hi, t))
    choices = {lo: sorted(c, reverse=True) for lo, c in by_lo.items()}
    dead: set[int] = set()
    path: list[tuple[int, int]] = []  # (point, index of the range chosen there)
    at, k = 0, 0
    while True:
        if at == n:
            return [choices[lo][i][1] for lo, i in path]
        options = choices.get(at, [])
        while k < len(options) and options[k][0] in dead:
            k += 1
        if k < len(options):
            path.append((at, k))
            at, k = options[k][0], 0
            continue
        dead.add(at)
        if not path:
            return None
        at, k = path.pop()
        k += 1


def linking_covers(parts: list[tuple[int, int, int]], n: int,
                   loose: list[int]) -> tuple[list[tuple[int, ...]], list[int]]:
    """For each range of ``loose`` (tensors among ``parts``, ranges (lo, hi,
    tensor)) that lies on some exact cover of [0, n), one such cover, made of
    any of ``parts`` (with the fewest ranges); the loose tensors on none.

    Covers found here may share ranges with each other and with the disjoint
    covers: each is a claim the producing stage proves like any group
    (docs/soundness.md, "Linked covers")."""
    by_lo: dict[int, list[tuple[int, int]]] = defaultdict(list)
    by_hi: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for lo, hi, t in sorted(parts):
        by_lo[lo].append((hi, t))
        by_hi[hi].append((lo, t))
    to_start = _shortest_paths(0, by_lo)  # point -> (previous point, tensor) from 0
    to_end = _shortest_paths(n, by_hi)  # point -> (next point, tensor) toward n
    where = {t: (lo, hi) for lo, hi, t in parts}
    covers: list[tuple[int, ...]] = []
    covered: set[int] = set()
    rest = []
    for t in loose:
        lo, hi = where[t]
        if t in covered:
            continue
        if lo not in to_start or hi not in to_end:
            rest.append(t)
            continue
        cover = [*reversed(_walk(lo, 0, to_start)), t, *_walk(hi, n, to_end)]
        covers.append(tuple(cover))
        covered.update(cover)
    return covers, [t for t in rest if t not in covered]


def _shortest_paths(source: int, edges: dict[int, list[tuple[int, int]]]
                    ) -> dict[int, tuple[int, int]]:
    """Breadth-first from ``source`` over ``edges`` (point -> [(point,
    tensor)]): each reached point -> (the point before it, the tensor of the
    edge), the source -> itself."""
    seen: dict[int, tuple[int, int]] = {source: (source, -1)}
    frontier = [source]
    while frontier:
        nxt = []
        for at in frontier:
            for to, t in edges.get(at, ()):
                if to not in seen:
                    seen[to] = (at, t)
                    nxt.append(to)
        frontier = nxt
    return seen


def _walk(at: int, source: int, paths: dict[int, tuple[int, int]]) -> list[int]:
    """The tensors from ``at`` back to ``source`` along ``paths``."""
    out = []
    while at != source:
        at, t = paths[at]
        out.append(t)
    return out


def infer_lineages(single: Plan, parallel: Plan) -> tuple[list[Lineage], list[int], list[int]]:
    """All lineages; the lineage of each Gs tensor and of each Gp tensor (-1: none)."""
    ts_of = {(t.tid, t.version): i for i, t in enumerate(single.tensors)}
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(parallel.tensors):
        ts = ts_of.get((t.tid, t.lver))
        if ts is None:
            name = parallel.logical[t.tid].name
            raise StructureError(
                "lineage",
                f"Tensor(rank={t.rank}, mb={t.mb}, tid={t.tid}, v={t.version}) claims version "
                f"{t.lver} of {name}, which the single-device plan never produces",
            )
        buckets[ts].append(i)
    lineages: list[Lineage] = []
    of_gs = [-1] * len(single.tensors)
    of_gp = [-1] * len(parallel.tensors)
    for ts in progress(sorted(buckets), "lineages"):
        lin = Lineage(len(lineages), ts)
        by_slice: dict[Slices, list[int]] = defaultdict(list)
        for i in buckets[ts]:
            by_slice[parallel.tensors[i].slices].append(i)
        for slices, members in by_slice.items():
            partial: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
            for i in members:
                t = parallel.tensors[i]
                if t.is_whole():
                    lin.groups.append((slices, (i,)))
                else:
                    partial[t.parts[2]].append((t.parts[0], t.parts[1], i))
            for n, parts in partial.items():
                by_range: dict[tuple[int, int], list[int]] = defaultdict(list)
                for lo, hi, i in parts:
                    by_range[(lo, hi)].append(i)
                lin.same.extend(tuple(s) for s in by_range.values() if len(s) > 1)
                reps = [(lo, hi, s[0]) for (lo, hi), s in by_range.items()]
                covers, rest = exact_covers(reps, n) if n > 0 else ([], [r[2] for r in reps])
                if n > 0 and rest:
                    linked, rest = linking_covers(reps, n, rest)
                    covers += linked
                lin.groups.extend((slices, c) for c in covers)
                lin.loose.extend(rest)
        lineages.append(lin)
        of_gs[ts] = lin.id
        for i in buckets[ts]:
            of_gp[i] = lin.id
    return lineages, of_gs, of_gp
