"""Materialized plans: the blocks found and checked, the representatives proved.

A plan with every rank and microbatch written out runs, at dp 512, one
program 512 times. :func:`find_symmetry` checks that it does (every block
(replica, microbatch) against its class's representative, with the
uniformity rules of verdict/symmetry/rules.py applied to the whole plan, glue
included) and cuts out the representatives, two replicas and two
microbatches of the base class, as a folded plan that the folded pipeline
proves; blocks that run another program form classes of their own
(verdict/symmetry/classes.py), each cut beside base blocks (:class:`ClassCut`).
docs/soundness.md, "Materialized plans: the symmetry found and checked",
holds the argument.

A plan that is not covered, or that breaks a rule of the block check, is
verified in full: :func:`find_symmetry` says why (:class:`Refusal`), it
never FAILs a plan by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verdict.columns import Columns
from verdict.final import check_layout
from verdict.lineage import StructureError
from verdict.plan import Plan
from verdict.symmetry.blocks import BlockCheck
from verdict.symmetry.classes import Axis, block_classes
from verdict.symmetry.cut import Cut, PlanLike, layout_view
from verdict.symmetry.fold import Fold, FoldError, restrict
from verdict.symmetry.rules import SHOWN
from verdict.symmetry.shards import OwnedError


@dataclass(frozen=True)
class ClassCut:
    """A class of blocks other than the base class (replicas x microbatches),
    and its mixed cut: base blocks beside the class's representative block,
    as a folded plan (docs/soundness.md, "When the blocks differ: classes")."""

    single: Plan
    folded: Plan
    rank_of: dict[int, int]
    replicas: tuple[int, ...]  # the class's replicas
    microbatches: tuple[int, ...]  # and microbatches
    why: str  # where its representatives differ from the classes they were compared with

    def describe(self) -> str:
        return (f"replica{'s' if len(self.replicas) > 1 else ''} {_short_list(self.replicas)} "
                f"x microbatch{'es' if len(self.microbatches) > 1 else ''} "
                f"{_short_list(self.microbatches)} "
                f"run{'s' if len(self.replicas) * len(self.microbatches) == 1 else ''} "
                f"another program ({self.why})")

    def ranks(self) -> str:
        return _ranks(self.rank_of)


@dataclass(frozen=True)
class Symmetry:
    """The representatives of a materialized plan, as a folded plan, and the
    single-device plan restricted to their rows; with the other classes of
    blocks, one mixed cut each (``classes``)."""

    single: Plan
    folded: Plan
    blocks: int  # blocks (replica x microbatch) checked against the representatives
    rank_of: dict[int, int]  # rank of ``folded`` -> rank of the plan
    base: tuple[int, ...] = (0, 1)  # the replicas of ``folded``
    base_mbs: tuple[int, ...] = (0, 1)  # and its microbatches
    classes: tuple[ClassCut, ...] = ()
    owned: int = 0  # ZeRO gathers checked on the whole plan (verdict/symmetry/owned.py)
    zero: int = 0  # the plan's ZeRO stage
    scatters: int = 0  # ZeRO-2/3 reduce-scatters checked on the whole plan

    def describe(self) -> str:
        w = self.folded.world
        ep = int(w.get("ep", 1))
        replica = "expert-data-parallel replica" if ep > 1 else "replica"
        text = (f"{w['fold_dp'] // ep} x {w['fold_nm']} blocks ({replica} x microbatch) checked "
                f"against the representatives, replicas {_span(self.base)} and microbatches "
                f"{_span(self.base_mbs)}, which were proved (docs/soundness.md)")
        if ep > 1:
            text += (f"; each block holds the {ep} expert-parallel ranks of its replica, whose "
                     f"all-to-alls stay inside it")
        if self.owned and self.scatters:
            text += (f"; ZeRO-{self.zero} owned shards checked on every rank ({self.owned} "
                     f"gathers tile their parameters, {self.scatters} reduce-scatters each keep "
                     f"the rank's own gradient chunk, accumulated from zeros)")
        elif self.owned:
            text += (f"; ZeRO-{self.zero} owned shards checked on every rank ({self.owned} "
                     f"gathers tile their parameters, each rank keeps its own gradient chunk)")
        if self.classes:
            text += (f"; {1 + len(self.classes)} classes of blocks, each proved by its own cut: "
                     + "; ".join(c.describe() for c in self.classes))
        return text

    def failed(self, cut: ClassCut) -> str:
        """The report of a class whose cut FAILs."""
        return (f"{self.blocks} blocks checked, in {1 + len(self.classes)} classes of blocks; "
                f"the base class (replicas {_span(self.base)}, microbatches "
                f"{_span(self.base_mbs)}) proved; FAILED in its own cut: {cut.describe()}")

    def ranks(self) -> str:
        """Where the representatives' ranks are in the plan (for a FAIL)."""
        return _ranks(self.rank_of)

    def proved(self) -> int:
        """Blocks proved: the base cut's and each class cut's shown blocks."""
        w = self.folded.world
        return w["dp"] // int(w.get("ep", 1)) * w["nm"] * (1 + len(self.classes))


def _ranks(rank_of: dict[int, int]) -> str:
    return ", ".join(f"{f}->{p}" for f, p in sorted(rank_of.items()) if f != p)


def _span(xs: tuple[int, ...]) -> str:
    return f"{xs[0]}-{xs[1]}" if len(xs) == 2 and xs[1] == xs[0] + 1 else ", ".join(map(str, xs))


def _short_list(xs: tuple[int, ...]) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= 6 else \
        f"{', '.join(map(str, xs[:6]))}, ... ({len(xs)})"


@dataclass(frozen=True)
class Refusal:
    """Why a materialized plan is verified in full; ``difference`` when its
    blocks differ (the first differing block and node)."""

    why: str
    difference: bool = False


def foldable(parallel: PlanLike) -> bool:
    """A materialized plan with more than two replicas or microbatches (with
    expert parallelism, replicas are expert-data-parallel indices)."""
    w = parallel.world
    if parallel.is_folded() or not all(
            isinstance(w.get(k, 1), int) for k in ("dp", "nm", "cp", "tp", "pp", "ep")):
        return False
    ep = max(w.get("ep", 1), 1)
    return w.get("dp", 1) % ep == 0 and (w.get("dp", 1) // ep > SHOWN or w.get("nm", 1) > SHOWN)


def eligible(parallel: PlanLike) -> str | None:
    """Why the plan is not one the symmetry covers (None: it is)."""
    w = parallel.world
    if not foldable(parallel):
        return "not a materialized plan with more than two replicas or microbatches"
    if w.get("zero", 0) not in (0, 1, 2, 3):
        return f"ZeRO stage {w.get('zero')!r}"
    if not isinstance(w.get("gbs"), int):
        return "its world has no integer gbs"
    return None


def find_symmetry(single: Plan, parallel: PlanLike) -> Symmetry | Refusal:
    """The representatives of ``parallel`` after every block was checked
    against them, or why the plan must be verified in full. First the
    world's layout is checked against the rows every rank loads
    (``check_layout``; StructureError('layout'), a finding)."""
    cols = parallel if isinstance(parallel, Columns) else Columns.from_plan(parallel)
    check_layout(layout_view(cols))
    why = eligible(parallel)
    if why:
        return Refusal(why)
    w = cols.world
    ep = int(w.get("ep", 1))
    dp, nm, gbs = w.get("dp", 1) // ep, w.get("nm", 1), w["gbs"]  # dp: edp replicas
    if single.world.get("gbs") != gbs or gbs % (dp * nm):
        return Refusal(f"gbs {gbs} does not split into dp {dp} x nm {nm} blocks")
    whole = Fold(dp, nm, gbs, dp, nm, gbs)
    try:
        check = BlockCheck(single, cols, whole)  # and its owned shards (OwnedError)
        scale = cols.tensors.scale
        scaled = np.flatnonzero(scale[:, 0] != scale[:, 1]) if scale is not None else None
        if scaled is not None and (check.cols.t_producer[scaled] < 0).any():
            return Refusal("an input tensor claims a factor (the block check compares inputs "
                           "by slices and parts)")
        free = check.free_tensors()
        if free >= 0:
            return Refusal(f"tensor {free} is read or written by no node (only the tensors of "
                           f"compared nodes are compared)")
        replicas, microbatches = block_classes(check)
    except (FoldError, OwnedError) as e:
        return Refusal(str(e))
    except StructureError as e:
        return Refusal(str(e), difference=True)
    for axis, size in ((replicas, dp), (microbatches, nm)):
        if size > 1 and len(axis.members(axis.base())) < 2:
            return Refusal(f"no two {axis.name}s run one program "
                           f"({axis.why[max(axis.why)]})", difference=True)
    check.finish()
    shown = Fold(min(dp, SHOWN), min(nm, SHOWN), min(dp, SHOWN) * min(nm, SHOWN) * check.rows,
                 dp, nm, gbs)
    base_d = tuple(replicas.members(replicas.base())[:SHOWN])
    base_m = tuple(microbatches.members(microbatches.base())[:SHOWN])
    try:
        folded, rank_of = Cut(parallel, check, shown, base_d, base_m).plan()
        restricted = restrict(single, shown)
        cuts = [ClassCut(restricted, *Cut(parallel, check, shown, d, m).plan(),
                         tuple(replicas.members(r)), tuple(microbatches.members(q)),
                         _difference(replicas, microbatches, r, q))
                for r, q, d, m in _mixed_cuts(replicas, microbatches, base_d, base_m)]
    except FoldError as e:
        return Refusal(str(e))
    scatters = check.owned.scatters
    return Symmetry(restricted, folded, dp * nm, rank_of, base_d, base_m, tuple(cuts),
                    int(check.owned.gathers.sum()), int(w.get("zero", 0) or 0),
                    0 if scatters is None else int(scatters.sum()))


def _mixed_cuts(replicas: Axis, microbatches: Axis, base_d: tuple[int, ...],
                base_m: tuple[int, ...]) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """(replica class, microbatch class, shown replicas, shown microbatches)
    of every class of blocks but the base one: a base replica beside the
    class's, a base microbatch beside the class's, or the base's two where
    the class is the base one on that axis (docs/soundness.md, step 3)."""
    out = []
    for r in replicas.representatives():
        for q in microbatches.representatives():
            if (r, q) == (replicas.base(), microbatches.base()):
                continue
            shown_d = base_d if r == replicas.base() else (base_d[0], r)
            shown_m = base_m if q == microbatches.base() else (base_m[0], q)
            out.append((r, q, shown_d, shown_m))
    return out


def _difference(replicas: Axis, microbatches: Axis, r: int, q: int) -> str:
    """Where the class (r, q) first differed from the one it was compared with."""
    found = [x for x in (replicas.why.get(r), microbatches.why.get(q)) if x]
    return "; ".join(found) or replicas.why.get(replicas.base(), "") or \
        microbatches.why.get(microbatches.base(), "")
