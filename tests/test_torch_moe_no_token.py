"""An expert with no token on a rank under data parallelism: the rank's
experts loop is given it to run on no token (``Routing.hits``), checked to
end the step with the values of the step as the code runs it
(docs/soundness.md, "Plans traced from PyTorch", 88)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch.errors import LoweringError
from backends.torch.tracer.routing import (
    Routing,
    check_every_expert_reached,
    check_skipped_add_nothing,
    describe_added,
)

#: one router call of 4 experts, top-2, 4 tokens; rank 0 holds rows 0-1
SINGLE = np.array([[0, 2], [2, 3], [1, 3], [1, 0]])
NONZERO = "aten.nonzero.default"


def _rank0(fill: bool = True) -> Routing:
    routing = Routing([SINGLE], block=(0, 2))
    routing.fill_skipped = fill
    routing.recorded.append(SINGLE[:2])  # what topk replayed on rank 0
    routing.experts.append(4)
    return routing


def _hit(entries: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(entries)
    return x, x.nonzero()


def test_an_expert_the_rank_routes_no_token_to_is_run_on_none() -> None:
    routing = _rank0()
    x, out = _hit([True, False, True, True, False])  # mixtral's sentinel entry last
    got = routing.hits(NONZERO, (x,), out)
    assert got.reshape(-1).tolist() == [0, 1, 2, 3]
    assert got.dtype == out.dtype and tuple(got.shape) == (4, 1)
    assert routing.added == [(0, 1)]
    assert sorted(routing.reached) == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_an_expert_with_tokens_on_the_rank_is_never_added() -> None:
    """A loop whose vector leaves out an expert the rank's routing sends a
    token to (a skipping bug) is not completed: that term stays missing."""
    routing = _rank0()
    x, out = _hit([True, False, False, True, False])  # expert 2 has rank 0's tokens
    got = routing.hits(NONZERO, (x,), out)
    assert got.reshape(-1).tolist() == [0, 1, 3]
    assert routing.added == [(0, 1)]


def test_other_nonzeros_are_left_alone() -> None:
    routing = _rank0()
    for x in (torch.tensor([True, False, True]),  # another length
              torch.tensor([1, 0, 1, 1]),  # not a bool
              torch.ones(2, 4, dtype=torch.bool)):  # two dims (a where of a mask)
        out = x.nonzero()
        assert routing.hits(NONZERO, (x,), out) is out
    x, out = _hit([True, False, True, True])
    assert routing.hits("aten.where.default", (x,), out) is out
    assert _rank0(fill=False).hits(NONZERO, (x,), out) is out
    assert routing.added == []


def test_nothing_added_on_one_device_or_when_every_expert_is_reached() -> None:
    single = Routing(None)
    x, out = _hit([True, False, True, True])
    assert single.hits(NONZERO, (x,), out) is out
    routing = Routing([SINGLE], block=(1, 2))
    routing.fill_skipped = True
    routing.recorded.append(SINGLE[2:])
    routing.experts.append(4)
    x, out = _hit([True, True, False, True])  # rank 1: experts 0, 1, 3; 2 only on rank 0
    assert routing.hits(NONZERO, (x,), out).reshape(-1).tolist() == [0, 1, 2, 3]
    x, out = _hit([True, True, True, True])
    routing.added.clear()
    assert routing.hits(NONZERO, (x,), out) is out and routing.added == []


def _trace(rank: int, routing: np.ndarray, reached=(), added=(), ends=None) -> dict:
    return {"rank": rank, "routing": [routing], "routing_reached": list(reached),
            "routing_added": list(added), "ends": ends}


def test_a_rank_whose_loop_reaches_no_such_vector_is_refused() -> None:
    single = {"routing": [SINGLE]}
    with pytest.raises(LoweringError, match="rank 0 routes no token to expert 1 at router call 0"):
        check_every_expert_reached(single, [_trace(0, SINGLE[:2])])
    check_every_expert_reached(single, [_trace(0, SINGLE[:2], reached=[(0, 1)])])


def test_only_the_router_calls_a_loop_reads_are_checked() -> None:
    """A group-limited router's first calls pick groups (no expert runs on
    their indices): the single-device step reads an experts-hit vector
    after the last call only, and only that call is checked."""
    groups = np.array([[0], [0], [1], [1]])
    single = Routing(None)
    single.recorded += [groups, SINGLE]
    single.experts += [2, 4]
    x, out = _hit([True, True, True, True])
    assert single.hits(NONZERO, (x,), out) is out and single.loops == {1}
    rank0 = _trace(0, SINGLE[:2], reached=[(1, 1)])
    rank0["routing"] = [groups[:2], SINGLE[:2]]  # no group 1 on rank 0
    check_every_expert_reached({"routing": [groups, SINGLE], "routing_loops": [1]}, [rank0])
    with pytest.raises(LoweringError, match="group|expert 1 at router call 0"):
        check_every_expert_reached({"routing": [groups, SINGLE]}, [rank0])


def test_the_run_on_no_token_must_end_as_the_step_the_code_runs() -> None:
    ends = [np.array(1.5), np.arange(4.0)]
    filled = [_trace(0, SINGLE[:2], added=[(0, 1)], ends=ends), _trace(1, SINGLE[2:])]
    check_skipped_add_nothing(filled, [{"ends": [np.array(1.5), np.arange(4.0)]}, {}])
    other = [np.array(1.5), np.arange(4.0) + np.array([0, 0, 1e-12, 0])]
    with pytest.raises(LoweringError, match="rank 0: .* expert 1 at router call 0"):
        check_skipped_add_nothing(filled, [{"ends": other}, {}])
    with pytest.raises(LoweringError, match="rank 0"):
        check_skipped_add_nothing(filled, [{"ends": ends[:1]}, {}])
    assert describe_added(filled) == "run on no token: rank 0 expert 1 at router call 0"


def test_mixtral_dp2_seed5_verifies_with_rank0_running_expert1_on_no_token() -> None:
    """Expert 1's two tokens are both on rank 1: rank 0's loop runs expert 1
    on no token, and the step verifies for the routing it names."""
    pytest.importorskip("transformers")
    from backends.torch.__main__ import parser, trace_and_build
    from main import verify

    args = parser().parse_args(["--hf", "mixtral", "--dp", "2", "--tp", "1", "--seed", "5"])
    (plan_s, plan_p), _ = trace_and_build(args)
    assert "run on no token: rank 0 expert 1 at router call 0" in plan_s.world["routing"]
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
