"""Robustness at scale: no recursion limit, every internal failure is exit 3."""

from __future__ import annotations

import random

from verdict.lineage import exact_covers


def _covers_by_recursion(parts, n):
    """The search exact_covers does, written recursively (small inputs only)."""
    remaining = sorted(parts)
    covers = []
    while True:
        by_lo = {}
        for lo, hi, t in remaining:
            by_lo.setdefault(lo, []).append((hi, t))

        def extend(at, by_lo=by_lo):
            if at == n:
                return []
            for hi, t in sorted(by_lo.get(at, []), reverse=True):
                rest = extend(hi, by_lo)
                if rest is not None:
                    return [t, *rest]
            return None

        cover = extend(0)
        if cover is None:
            return covers, [t for _, _, t in remaining]
        covers.append(tuple(cover))
        remaining = [p for p in remaining if p[2] not in cover]


def test_exact_covers_match_the_recursive_search():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 9)
        parts = []
        for t in range(rng.randint(0, 12)):
            lo = rng.randrange(n)
            parts.append((lo, rng.randint(lo + 1, n), t))
        assert exact_covers(parts, n) == _covers_by_recursion(parts, n)


def test_a_cover_of_many_parts_needs_no_recursion():
    n = 5000
    parts = [(i, i + 1, 2 * i) for i in range(n)] + [(i, i + 1, 2 * i + 1) for i in range(n - 1)]
    covers, rest = exact_covers(parts, n)
    assert covers == [(*(2 * i + 1 for i in range(n - 1)), 2 * (n - 1))]
    assert sorted(rest) == [2 * i for i in range(n - 1)]


def test_a_deep_dead_end_is_searched_once():
    """No cover, and Fibonacci-many paths to fail on: memoized dead points
    keep the search linear."""
    n = 3000
    parts = [(i, i + 1, i) for i in range(n - 1)] + [(i, i + 2, n + i) for i in range(n - 2)]
    covers, rest = exact_covers(parts, n)
    assert covers == [] and len(rest) == len(parts)


def _reducer_plan_data():
    from gen_model.config import ModelConfig, Parallelism
    from gen_model.generate import make_plan

    data = make_plan(ModelConfig("mlp", layers=1, hidden=4), Parallelism(dp=16), 16).to_data()
    reducers = [i for i, n in enumerate(data["nodes"]) if n[2] == "reducer"]
    return data, reducers


def test_replica_groups_share_one_inputs_list_and_still_validate():
    from backends.planfile import _plain_dumps, _unpickle, validate
    from verdict.plan import Plan

    data, reducers = _reducer_plan_data()
    assert len(reducers) == 16
    assert all(data["nodes"][i][4] is data["nodes"][reducers[0]][4] for i in reducers)
    validate(data)
    back = _unpickle(_plain_dumps(data))
    assert back["nodes"][reducers[0]][4] is back["nodes"][reducers[-1]][4]
    plan = Plan.from_data(back)
    assert plan.nodes[reducers[0]].inputs is plan.nodes[reducers[-1]].inputs
    assert plan.to_data() == data


def test_a_shared_inputs_list_is_checked_for_every_node_that_reads_it():
    import pytest

    from backends.planfile import PlanError, validate

    data, reducers = _reducer_plan_data()
    early = data["nodes"].pop(reducers[-1])
    data["nodes"].insert(0, early)  # reads the buffers before they are written
    with pytest.raises(PlanError, match="node 0 .*reads tensor .* before node"):
        validate(data)
    data, reducers = _reducer_plan_data()
    data["nodes"][reducers[0]][4][3] = len(data["tensors"])  # one object: every reader sees it
    with pytest.raises(PlanError, match=f"node {reducers[0]} .*is not a tensor index"):
        validate(data)
