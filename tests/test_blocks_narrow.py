"""The block check keeps its arrays narrow (int32) and compares entries a
chunk of nodes at a time: a re-implementation of the same comparisons, so
it must reach the same result as the wide, one-pass check, on uniform plans
and on plans that differ in one block (verdict/blocks.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gen_model.config import Parallelism
from harness import mutations
from tests.helpers import MLP, plan_pair
from verdict import blocks
from verdict.columns import Columns
from verdict.lineage import StructureError
from verdict.symmetry import Refusal, Symmetry, find_symmetry

MESH = Parallelism(dp=4, tp=2, pp=2, nm=4)


def outcome(single, plan) -> str:
    """What find_symmetry concludes, as text (a layout finding included)."""
    try:
        found = find_symmetry(single, Columns.from_plan(plan))
    except StructureError as e:
        return f"finding {e.kind}: {e}"
    if isinstance(found, Refusal):
        return f"refused (difference={found.difference}): {found.why}"
    assert isinstance(found, Symmetry)
    return (f"proved by {found.describe()}, ranks {found.ranks()}, "
            f"{len(found.folded.nodes)} nodes in the cut")


def plans():
    single, plan = plan_pair(MLP, MESH, 32)
    yield "uniform", single, plan
    for name, mutate in mutations.MATERIALIZED_MUTATIONS.items():
        made = mutate(plan, random.Random(f"narrow/{name}"))
        if made is not None:  # None: the operator needs another plan (ZeRO's owned shard)
            yield name, single, made[0]
    bad = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(plan.nodes) if n.op == "div" and n.mb == 3
             and (n.rank // 2) % 4 == 2)
    n = bad.nodes[i]
    bad.nodes[i] = n._replace(kwargs={**n.kwargs, "value": n.kwargs["value"] * 2})
    yield "one replica's constant", single, bad


def test_narrow_chunked_check_agrees_with_the_wide_one(monkeypatch):
    cases = list(plans())
    narrow = [outcome(s, p) for _, s, p in cases]
    with monkeypatch.context() as m:
        m.setattr(blocks, "_NODE_CHUNK", 7)  # many chunks, split inside blocks
        tiny = [outcome(s, p) for _, s, p in cases]
    with monkeypatch.context() as m:
        m.setattr(blocks, "index_array", lambda a: np.asarray(a).astype(np.int64))
        m.setattr(blocks, "_NODE_CHUNK", 1 << 40)
        wide = [outcome(s, p) for _, s, p in cases]
    assert narrow == wide == tiny
    assert len(cases) >= 5 and narrow[0].startswith("proved")
    for (name, _, _), got in zip(cases[1:], narrow[1:]):
        # caught: a finding, a refusal, or the differing blocks in a cut of their own
        assert got != narrow[0], name


def test_index_arrays_are_int32_when_they_fit():
    assert blocks.index_array(np.array([0, 2**31 - 1], dtype=np.int64)).dtype == np.int32
    assert blocks.index_array(np.array([-1, 5], dtype=np.int8)).dtype == np.int32
    assert blocks.index_array(np.array([2**31], dtype=np.int64)).dtype == np.int64


@pytest.mark.parametrize("dtype", [np.int8, np.int64])
def test_arrays_of_narrow_and_wide_columns_are_equal(dtype):
    _, plan = plan_pair(MLP, MESH, 32)
    cols = Columns.from_plan(plan)
    a = blocks.arrays(cols)
    for name in ("t_rank", "n_rank", "flat", "ptr", "t_producer"):
        assert getattr(a, name).dtype == np.int32
    assert np.array_equal(a.n_rank, np.asarray(cols.nodes.rank, dtype=dtype).astype(np.int64))
