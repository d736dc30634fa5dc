"""check_layout's overlap search (verdict/final.py first_overlap) finds what
the pairwise comparison of every two data-parallel indices found."""

from __future__ import annotations

import itertools
import random

import pytest

from gen_model.config import Parallelism
from harness import mutations
from tests.helpers import MLP, plan_pair
from verdict.final import check_layout, first_overlap
from verdict.lineage import StructureError


def pairwise(boxes: dict[int, set]) -> tuple[int, int] | None:
    """The comparison check_layout made before: every two indices, every two boxes."""
    for (d, a), (e, b) in itertools.combinations(sorted(boxes.items()), 2):
        if any(all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(p, q))
               for p in a for q in b):
            return d, e
    return None


def random_boxes(rng: random.Random, width: int, kind: str) -> dict[int, set]:
    dp = rng.randrange(1, 12)
    rows = rng.randrange(1, 4)
    out: dict[int, set] = {}
    for d in range(dp):
        boxes = set()
        for m in range(rng.randrange(1, 4)):
            lo = (d * 4 + m) * rows
            if kind == "overlapping":
                lo += rng.randrange(-2 * rows, 2 * rows + 1)
            elif kind == "equal" and rng.random() < 0.3:
                lo = m * rows  # replica 0's rows
            hi = lo + rng.choice([0, rows, rows, 2 * rows])
            box = [(lo, hi)]
            if width == 2:
                c = rng.randrange(3)
                box.append((c * 4, c * 4 + rng.choice([2, 4, 6])))
            boxes.add(tuple(box[:rng.choice([width, 1])] if width == 2 else box))
        out[d] = boxes
    return out


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("kind", ["disjoint", "overlapping", "equal"])
def test_sweep_agrees_with_the_pairwise_comparison(width, kind):
    rng = random.Random(f"{width}/{kind}")
    found = 0
    for _ in range(300):
        boxes = random_boxes(rng, width, kind)
        want = pairwise(boxes)
        assert first_overlap(boxes, width) == want, boxes
        found += want is not None
    if kind != "disjoint":
        assert found  # the cases exercise the finding


def test_check_layout_names_the_same_ranks():
    single, plan = plan_pair(MLP, Parallelism(dp=4, tp=2, nm=2), 16)
    check_layout(plan)
    bad = mutations.other_rows(plan, random.Random(1))[0]
    with pytest.raises(StructureError, match="data-parallel indices . and . .*overlapping"):
        check_layout(bad)
