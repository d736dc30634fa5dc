"""FSDP2's padded shards: a dim 0 the shard group does not divide is cut
in chunks of ceil(S / N) rows, the last ranks holding fewer or none
(docs/soundness.md, "Plans traced from PyTorch", 14 and 15). The
regression head ``nn.Linear(h, 1)`` (weight ``[1, h]``, bias ``[1]``) lives
on the group's first rank; a 15-row embedding over two ranks is split 8
and 7, a 10-row one over four 3, 3, 3, 1 and a 5-row one 2, 2, 1, 0. The
plans verify and the oracle agrees (with an optimizer step and a gradient
clipper too); a gradient left un-reduced, averaged where FSDP sums, kept on
the wrong rows, a gathered parameter whose pieces are out of order, or a
divide factor applied twice fails; FSDP's default divide factor verifies
on a per-rank mean and fails on a shared-out loss, as the real gloo runs do
(scripts/gloo_truth.py); an uneven cut of another dim than 0 is refused."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.lowering import LoweringError, check_shards
from harness.mutations import copy_plan
from harness.oracle import judge
from main import verify
from verdict.plan import Node

MODELS = "backends.torch.stock_models:"
STOCK = "backends.torch.stock_recipes:"
SCALING = "backends.torch.scaling_recipes:"
HEAD = ("head.2.weight", "head.2.bias")


def _plans(model: str, recipe: str, *extra: str):
    args = resolve(parser().parse_args(["--model", MODELS + model, "--recipe", recipe,
                                        "--dp", "2", "--tp", "1", *extra]))  # later flags win
    (plan_s, plan_p), _ = trace_and_build(args)
    return plan_s, plan_p


@pytest.fixture(scope="module")
def fsdp_plans():
    return _plans("swiglu_regression", STOCK + "fsdp")


def _tid(plan_p, name: str) -> int:
    return next(k for k, lg in enumerate(plan_p.logical) if lg.name == name)


def _head_reductions(plan_p) -> list[int]:
    """The all-reduces that give rank 0 the head's gradients (FSDP reduces
    every other gradient with a reduce-scatter)."""
    found = [i for i, n in enumerate(plan_p.nodes) if n.op == "all_reduce" and n.rank == 0]
    assert sorted(plan_p.tensors[plan_p.nodes[i].outputs[0]].shape for i in found) == [(1,), (1, 16)]
    return found


def test_one_row_head_under_fsdp_verifies(fsdp_plans) -> None:
    plan_s, plan_p = fsdp_plans
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    for name in HEAD:
        tid = _tid(plan_p, name)
        held = {t.rank for t in plan_p.tensors if t.tid == tid and t.mb == -1}
        assert held == {0}  # rank 1 holds no row of it: no input, no gradient
    assert any(n.op == "send_recv" for n in plan_p.nodes)


@pytest.mark.parametrize("wrong", ["local", "avg"])
def test_head_gradient_not_summed_fails(fsdp_plans, wrong: str) -> None:
    """Rank 0 keeps its own gradient of the head (``local``), or averages it
    over the group where FSDP (divide factor 1) sums it (``avg``): the
    oracle finds the plan wrong and the verifier fails."""
    plan_s, plan_p = fsdp_plans
    bad = copy_plan(plan_p)
    for i in _head_reductions(bad):
        n = bad.nodes[i]
        if wrong == "local":
            own = n.inputs[n.kwargs["index"]]
            bad.nodes[i] = Node(n.rank, n.mb, "div", n.dir, (own,), n.outputs, {"value": 1.0},
                                n.name)
        else:
            bad.nodes[i] = n._replace(op="all_reduce_avg")
    assert not judge(plan_s, bad).right
    verdict = verify(plan_s, bad)
    assert not verdict.success, "wrong SUCCESS"


def test_default_divide_factor(fsdp_plans) -> None:
    """FSDP2's default factor (the group size) on a per-rank mean verifies;
    on the shared-out loss it divides twice and fails, as the real run."""
    plan_s, plan_p = _plans("swiglu_regression_mean", SCALING + "fsdp_default")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    plan_s, plan_p = _plans("swiglu_regression", SCALING + "fsdp_default")
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and "1/2 x the gradient" in verdict.message


def test_one_row_head_with_an_optimizer_step_verifies() -> None:
    plan_s, plan_p = _plans("swiglu_regression", STOCK + "fsdp", "--optimizer", "adamw")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message


def test_one_row_head_under_hsdp_verifies() -> None:
    """HSDP (two replicas of two shards): the first rank of each shard group
    holds the row; its gradient is summed over its shard group, then over
    the replicas (left out, rank 0 ends with a partial sum: a FAIL)."""
    plan_s, plan_p = _plans("swiglu_regression", STOCK + "hsdp", "--dp", "4")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    tid = _tid(plan_p, "head.2.weight")
    assert {t.rank for t in plan_p.tensors if t.tid == tid and t.mb == -1} == {0, 2}
    bad = copy_plan(plan_p)
    reduces = [i for i, n in enumerate(bad.nodes) if n.op == "all_reduce" and n.rank == 0
               and bad.tensors[n.outputs[0]].shape == (1, 16)]
    assert len(reduces) == 2  # over the shard group, then over the replicas
    n = bad.nodes[reduces[1]]
    bad.nodes[reduces[1]] = Node(n.rank, n.mb, "div", n.dir, (n.inputs[n.kwargs["index"]],),
                                 n.outputs, {"value": 1.0}, n.name)
    assert not judge(plan_s, bad).right
    assert not verify(plan_s, bad).success, "wrong SUCCESS"


@pytest.fixture(scope="module")
def rows15():
    """mlp's 15-row embedding under FSDP2 over two ranks: 8 and 7 rows."""
    return _plans("mlp", STOCK + "fsdp", "--vocab", "15")


def _held(plan_p, name: str) -> dict[int, tuple]:
    tid = _tid(plan_p, name)
    return {t.rank: t.slices for t in plan_p.tensors if t.tid == tid and t.mb == -1}


def test_uneven_rows_verify(rows15) -> None:
    plan_s, plan_p = rows15
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    assert _held(plan_p, "embed.weight") == {0: ((0, 8), (0, 16)), 1: ((8, 15), (0, 16))}
    assert [n.op for n in plan_p.nodes if n.op == "cat"] == ["cat", "cat"]  # the gathers


def _one(plan_p, pick) -> int:
    found = [i for i, n in enumerate(plan_p.nodes) if pick(n)]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("wrong", ["rows", "order"])
def test_padded_shard_on_wrong_rows_fails(rows15, wrong: str) -> None:
    """Rank 1 keeps rows [7, 14) of the reduced gradient instead of its
    [8, 15) (``rows``), or rank 0 gathers the embedding with rank 1's rows
    first (``order``): the oracle finds the plan wrong and the verifier
    fails."""
    plan_s, plan_p = rows15
    bad = copy_plan(plan_p)
    if wrong == "rows":
        i = _one(bad, lambda n: n.op == "narrow" and n.rank == 1 and n.kwargs["start"] == 8)
        bad.nodes[i] = bad.nodes[i]._replace(kwargs={**bad.nodes[i].kwargs, "start": 7})
    else:
        i = _one(bad, lambda n: n.op == "cat" and n.rank == 0)
        bad.nodes[i] = bad.nodes[i]._replace(inputs=bad.nodes[i].inputs[::-1])
    assert not judge(plan_s, bad).right
    assert not verify(plan_s, bad).success, "wrong SUCCESS"


def test_padded_shards_default_divide_factor() -> None:
    """FSDP2's default factor on a per-rank mean verifies on the padded
    embedding; the factor applied twice to its gradient on one rank fails."""
    plan_s, plan_p = _plans("mlp_mean", SCALING + "fsdp_default", "--vocab", "15")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    bad = copy_plan(plan_p)
    narrowed = _one(bad, lambda n: n.op == "narrow" and n.rank == 1)
    i = _one(bad, lambda n: n.op == "div" and n.inputs == bad.nodes[narrowed].outputs)
    bad.nodes[i] = bad.nodes[i]._replace(kwargs={"value": 2 * bad.nodes[i].kwargs["value"]})
    assert not judge(plan_s, bad).right
    assert not verify(plan_s, bad).success, "wrong SUCCESS"


def test_a_rank_with_no_rows_and_a_clipper() -> None:
    """5 rows over four ranks (2, 2, 1, 0): rank 3 holds no shard of the
    embedding (nor of the 2-row head weight, 1, 1, 0, 0), and the gradient
    clipper's norm counts its empty shards as 0."""
    plan_s, plan_p = _plans("mlp", STOCK + "fsdp", "--dp", "4", "--vocab", "5", "--clip", "1.0")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    assert _held(plan_p, "embed.weight") == {0: ((0, 2), (0, 16)), 1: ((2, 4), (0, 16)),
                                             2: ((4, 5), (0, 16))}
    assert sorted(_held(plan_p, "head.2.weight")) == [0, 1]


def test_padded_shards_with_an_optimizer_step_verify() -> None:
    """10 rows over four ranks (3, 3, 3, 1) with AdamW's step."""
    plan_s, plan_p = _plans("mlp", STOCK + "fsdp", "--dp", "4", "--vocab", "10",
                            "--optimizer", "adamw")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert _held(plan_p, "embed.weight")[3] == ((9, 10), (0, 16))


def test_an_empty_shard_of_another_dim_is_refused() -> None:
    """An uneven cut of dim 1 is lowered (tests/test_torch_pools_extrema_padding.py); a
    rank holding none of it is refused."""
    check_shards([{"params": {"out.weight": (0, (2, 3), [[], ["tp"]])}, "shapes": [(2, 2)]}])
    trace = {"params": {"out.weight": (0, (2, 1), [[], ["tp"]])}, "shapes": [(2, 0)]}
    with pytest.raises(LoweringError, match=r"out\.weight.*holds none"):
        check_shards([trace])
    check_shards([{"params": {"w": (0, (15, 2), [["dp"], []])}, "shapes": [(7, 2)]}])


def test_padded_shards_under_hsdp_with_a_clipper() -> None:
    """HSDP (two replicas of two shards): 5 rows split 3 and 2 in each shard
    group; each shard's square sum is a part over the shard group, not over
    the replicas (read from the group that reduces it)."""
    plan_s, plan_p = _plans("mlp", STOCK + "hsdp", "--dp", "4", "--vocab", "5", "--clip", "1.0")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert _held(plan_p, "embed.weight") == {0: ((0, 3), (0, 16)), 1: ((3, 5), (0, 16)),
                                             2: ((0, 3), (0, 16)), 3: ((3, 5), (0, 16))}


def test_every_layer_padded_verifies() -> None:
    """Hidden size 10 and feed-forward 14 over four ranks: every weight,
    bias and norm is padded (3, 3, 3, 1 and 4, 4, 4, 2 rows); a bias
    gradient flattened from a sum keeps its full size where a rank's
    narrow reads it (tests/test_reduce_products.py)."""
    plan_s, plan_p = _plans("swiglu_regression", STOCK + "fsdp", "--dp", "4", "--hidden", "10",
                            "--ffn", "14")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right


@pytest.fixture(scope="module")
def colwise15():
    """llama's colwise output projection of a 15-token vocabulary over two
    tensor-parallel ranks (DTensor: 8 and 7 rows)."""
    args = resolve(parser().parse_args(["--model", "llama", "--recipe", "tp_sp", "--dp", "1",
                                        "--tp", "2", "--vocab", "15"]))
    return trace_and_build(args)[0]


@pytest.mark.parametrize("wrong", [None, "order", "piece"])
def test_dtensor_uneven_colwise_output(colwise15, wrong: str | None) -> None:
    """The logits padded to 8 and gathered verify, as the real run is
    right; the gathered logits' pieces out of order on rank 0, or rank 1's
    backward taking rows [7, 14) of the logits' gradient, fail."""
    plan_s, plan_p = colwise15
    if wrong is None:
        verdict = verify(plan_s, plan_p)
        assert verdict.success, verdict.message
        assert judge(plan_s, plan_p).right
        assert _held(plan_p, "output.weight") == {0: ((0, 8), (0, 16)), 1: ((8, 15), (0, 16))}
        return
    bad = copy_plan(plan_p)
    if wrong == "order":
        i = _one(bad, lambda n: n.op == "cat" and n.rank == 0 and len(n.inputs) == 2
                 and bad.tensors[n.inputs[1]].shape[-1] == 7)
        bad.nodes[i] = bad.nodes[i]._replace(inputs=bad.nodes[i].inputs[::-1])
    else:
        i = _one(bad, lambda n: n.op == "narrow" and n.rank == 1 and n.kwargs["start"] == 8)
        bad.nodes[i] = bad.nodes[i]._replace(kwargs={**bad.nodes[i].kwargs, "start": 7})
    assert not judge(plan_s, bad).right
    assert not verify(plan_s, bad).success, "wrong SUCCESS"
