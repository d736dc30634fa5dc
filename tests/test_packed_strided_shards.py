"""Strided ("packed") parameter shards (docs/soundness.md, "Plans traced
from PyTorch", 87): a rank holding its block of each of k equal parts of a
dim is loaded as those k blocks joined by a ``cat`` (the loaded-value check
compares the join with the rank's real tensor), every strided value is cut
into its blocks and joined again, and its final gradient is the rank's own
local gradient cut into the parameter's blocks. transformers' mixtral with
its ``packed_colwise`` expert columns verifies; the same with plain
``colwise`` (rank 0 all of gate, rank 1 all of up) FAILs at the experts'
chunk."""

from __future__ import annotations

import numpy as np
import pytest

from backends.torch.__main__ import parser, trace_and_build
from backends.torch.tracer.check import LoadedValueMismatch, check_loaded
from verdict.plan import Logical, Node, Plan, Tensor


def _joined_plan(starts: list[int], width: int) -> Plan:
    """Rank 0 loads blocks of W (4 x 8) at columns [s, s + width), joined."""
    plan = Plan(world={}, logical=[Logical("W", (4, 8), "param")])
    for s in starts:
        plan.tensors.append(Tensor(0, -1, 0, len(plan.tensors), (4, width), 0,
                                   ((0, 4), (s, s + width)), (0, 1, 1)))
    plan.tensors.append(Tensor(0, -1, 0, len(plan.tensors), (4, width * len(starts)), 0,
                               ((0, 4), (0, width * len(starts))), (0, 1, -2)))
    plan.nodes.append(Node(0, -1, "cat", "none", tuple(range(len(starts))),
                           (len(starts),), {"dim": 1}))
    return plan


def _loaded(w: np.ndarray) -> dict:
    return {"loaded": {"params": {"W": w}, "buffers": {}}, "batch_ids": {}}


def test_the_loaded_join_is_checked_against_the_real_tensor() -> None:
    full = np.arange(32.0).reshape(4, 8)
    single = _loaded(full)
    packed = np.concatenate([full[:, 0:2], full[:, 4:6]], axis=1)  # rank 0's part of each half
    check_loaded(single, [_loaded(packed)], _joined_plan([0, 4], 2))
    with pytest.raises(LoadedValueMismatch, match="joined along dim 1"):
        check_loaded(single, [_loaded(full[:, 0:4])], _joined_plan([0, 4], 2))  # a plain block
    with pytest.raises(LoadedValueMismatch, match="joined along dim 1"):
        swapped = np.concatenate([full[:, 4:6], full[:, 0:2]], axis=1)
        check_loaded(single, [_loaded(swapped)], _joined_plan([0, 4], 2))


def _pair(recipe: str | None = None):
    pytest.importorskip("transformers")
    argv = ["--hf", "mixtral", "--dp", "1", "--tp", "2"]
    return trace_and_build(parser().parse_args(argv + (["--recipe", recipe] if recipe else [])))[0]


def test_mixtral_packed_columns_are_loaded_as_blocks_and_verify() -> None:
    from main import verify

    plan_s, plan_p = _pair()
    gate_up = next(k for k, lg in enumerate(plan_p.logical)
                   if lg.name.endswith("experts.gate_up_proj") and lg.kind == "param")
    _, width, _ = plan_p.logical[gate_up].shape
    produced = {t for n in plan_p.nodes for t in n.outputs}
    quarter = width // 4
    for rank in (0, 1):
        loads = [t.slices[1] for k, t in enumerate(plan_p.tensors)
                 if t.tid == gate_up and t.rank == rank and k not in produced]
        want = [(rank * quarter, (rank + 1) * quarter),
                (width // 2 + rank * quarter, width // 2 + (rank + 1) * quarter)]
        assert loads == want
    assert plan_p.world.get("grad_blocks") == 1
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message


def test_mixtral_packed_columns_sharded_colwise_fail_at_the_chunk() -> None:
    from main import verify

    plan_s, plan_p = _pair("harness.moe_bugs:packed_as_colwise")
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage"
    failed = [r for r in verdict.results if not r.outcome.ok]
    assert any(plan_s.nodes[r.stage.gs_node].op == "split" for r in failed if r.stage.gs_node >= 0)
