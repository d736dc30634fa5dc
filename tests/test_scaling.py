"""Scaled claims (docs/soundness.md, "Scaled claims"): a tensor may claim an
exact rational multiple of its piece. A per-rank mean loss with an averaging
reduction verifies; the same with a summing reduction, a factor applied
twice, or a claim whose factor the plan does not apply fails, at the node
that applies it or at the rank that ends with the scaled gradient."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from backends.planfile import PlanError, validate
from gen_model.config import Parallelism
from harness import mutations
from harness.oracle import judge
from main import verify
from tests.helpers import MLP, plan_pair
from verdict.plan import Plan


def _per_rank_mean(dp: int, reducer: str, claim_factor: bool = True) -> tuple[Plan, Plan]:
    """The mlp at ``dp`` replicas with each rank's loss the mean over its own
    rows (the normalizer divided by dp: dp times its share), gradients
    reduced by ``reducer``; claims carry the factors the plan applies
    (``claim_factor=False``: the reducer's output claims factor 1 whatever
    it computes)."""
    single, base = plan_pair(MLP, Parallelism(dp=dp), 8)
    p = mutations.copy_plan(base)
    scale: dict[int, Fraction] = {}
    for i, n in enumerate(p.nodes):
        own = [t for t in n.inputs if t >= 0 and p.tensors[t].rank == n.rank]
        # the mlp's backward is linear in the one scaled gradient it reads
        f = next((scale[t] for t in own if t in scale), Fraction(1))
        if n.op == "div" and n.kwargs["value"] == 8.0:
            p.nodes[i] = n._replace(kwargs={"value": 8.0 / dp})
            f *= dp
        if n.op == "reducer":
            p.nodes[i] = n._replace(op=reducer)
            if reducer == "all_reduce_avg":
                f /= len(n.inputs)
            if not claim_factor:
                f = Fraction(1)
        for o in n.outputs:
            if o >= 0 and f != 1:
                scale[o] = f
                p.tensors[o] = p.tensors[o]._replace(scale=(f.numerator, f.denominator))
    return single, p


def test_per_rank_mean_with_avg_verifies() -> None:
    single, plan = _per_rank_mean(2, "all_reduce_avg")
    assert plan.lowest_version() == 3
    validate(plan.to_data())
    assert judge(single, plan).right
    assert verify(single, plan).success


def test_per_rank_mean_summed_fails_with_the_factor_named() -> None:
    """The mean summed over dp: every claim true, the gradient a rank ends
    with is 2x: the final check names the rank, the factor and the node."""
    single, plan = _per_rank_mean(2, "reducer")
    assert not judge(single, plan).right
    v = verify(single, plan)
    assert not v.success and v.kind == "coverage"
    assert "2 x the gradient" in v.message and "rank 0" in v.message
    assert "div (bw)" in v.message


def test_per_rank_mean_summed_with_unscaled_claim_fails_at_the_reducer() -> None:
    single, plan = _per_rank_mean(2, "reducer", claim_factor=False)
    v = verify(single, plan)
    assert not v.success and v.kind == "stage"
    assert any(plan.nodes[i].op == "reducer" for r in v.failed for i in r.stage.gp_nodes)


def test_a_claimed_factor_the_plan_does_not_apply_fails() -> None:
    single, plan = plan_pair(MLP, Parallelism(dp=2), 8)
    p = mutations.copy_plan(plan)
    t = next(o for n in p.nodes if n.op == "div" for o in n.outputs)
    p.tensors[t] = p.tensors[t]._replace(scale=(1, 2))
    assert judge(single, p).right  # values unchanged: only the claim is false
    v = verify(single, p)
    assert not v.success and v.kind == "stage"


def test_mean_loss_convention_and_others() -> None:
    """A loss of n/(hi-lo) times its parts (a mean over the rank's own data)
    is accepted; a loss of another factor is a finding."""
    single, plan = _per_rank_mean(2, "all_reduce_avg")
    loss = [i for i, t in enumerate(plan.tensors) if t.tid == plan.loss and t.scale != (1, 1)]
    assert loss and all(plan.tensors[i].scale == (2, 1) for i in loss)
    p = mutations.copy_plan(plan)
    for i in loss:
        p.tensors[i] = p.tensors[i]._replace(scale=(4, 1))
    v = verify(single, p)
    assert not v.success


@pytest.mark.parametrize("operator", ["factor_one_rank", "factor_every_rank", "factor_twice"])
def test_scale_mutants_fail(operator: str) -> None:
    single, plan = plan_pair(MLP, Parallelism(dp=2, tp=2), 8)
    memo: dict = {}
    caught = 0
    for k in range(3):
        made = mutations.MUTATIONS[operator](plan, random.Random(f"scale/{operator}/{k}"))
        assert made is not None
        mutant, where = made
        if judge(single, mutant).right:
            continue
        assert not verify(single, mutant, memo=memo).success, where
        caught += 1
    assert caught


def test_rescale_rewrite_verifies() -> None:
    """A factor applied and undone (claimed in between) changes nothing."""
    single, plan = plan_pair(MLP, Parallelism(dp=2, tp=2), 8)
    for k in range(3):
        mutant, where = mutations.REWRITES["rescale"](plan, random.Random(f"rescale/{k}"))
        assert judge(single, mutant).right, where
        assert verify(single, mutant).success, where


def test_plan_format_scale() -> None:
    _, plan = _per_rank_mean(2, "all_reduce_avg")
    data = plan.to_data()
    assert data["version"] == 3
    back = Plan.from_data(data)
    assert back.tensors == plan.tensors
    i = next(k for k, row in enumerate(data["tensors"]) if len(row) == 9)
    for bad, why in (([0, 1], "num != 0"), ([1, 0], "den > 0"), ([1.5, 1], "int"),
                     ([1, 2, 3], "2 entries")):
        broken = dict(data, tensors=list(data["tensors"]))
        broken["tensors"][i] = [*data["tensors"][i][:8], bad]
        with pytest.raises(PlanError, match=why):
            validate(broken)
    old = dict(data, version=2, tensors=list(data["tensors"]))
    with pytest.raises(PlanError, match="needs plan version 3"):
        validate(old)
    unnormal = dict(data, tensors=list(data["tensors"]))
    unnormal["tensors"][i] = [*data["tensors"][i][:8], [4, 2]]
    validate(unnormal)
    assert Plan.from_data(unnormal).tensors[i].scale == (2, 1)
    _, unscaled = plan_pair(MLP, Parallelism(dp=2), 8)
    assert unscaled.to_data()["version"] == 1
    assert all(len(row) == 8 for row in unscaled.to_data()["tensors"])


# -- traced from PyTorch: a per-rank mean loss and the reductions that fit it


def _traced(model: str, recipe: str, singles: dict) -> tuple[Plan, Plan]:
    from backends.torch.__main__ import parser, trace_and_build

    args = parser().parse_args(["--model", f"backends.torch.models:{model}", "--recipe",
                                f"backends.torch.recipes:{recipe}", "--dp", "2", "--tp", "1"])
    (plan_s, plan_p), singles[model] = trace_and_build(args, singles.get(model))
    return plan_s, plan_p


@pytest.fixture(scope="module")
def singles() -> dict:
    return {}


def test_traced_mean_loss_with_avg_verifies(singles: dict) -> None:
    """DDP by hand with ReduceOp.AVG for a loss averaged over each rank's own
    tokens: the loss is dp x its share, AVG divides the gradients by dp."""
    plan_s, plan_p = _traced("llama_mean", "ddp_avg", singles)
    assert any(n.op == "all_reduce_avg" for n in plan_p.nodes)
    assert judge(plan_s, plan_p).right
    v = verify(plan_s, plan_p)
    assert v.success, v.message


def test_traced_mean_summed_over_dp_fails_naming_rank_and_factor(singles: dict) -> None:
    """The same loss with the gradients summed over dp: every rank ends with
    2 x its gradient; the finding names the rank, the factor and the loss's
    division that applied it. (AVG where SUM is needed, the twin with the
    step-mean loss, is a case of scripts/run_torch_suite.sh.)"""
    plan_s, plan_p = _traced("llama_mean", "tp_sp", singles)
    assert not judge(plan_s, plan_p).right
    v = verify(plan_s, plan_p)
    assert not v.success and v.kind == "coverage"
    assert "2 x the gradient" in v.message and "applied by div" in v.message
    assert "rank 0" in v.message


def test_columnar_plans_keep_scales(tmp_path) -> None:
    from backends.planfile import load_plan, save_plan

    single, plan = _per_rank_mean(2, "all_reduce_avg")
    path, _ = save_plan(plan, tmp_path / "p.npz")
    back = load_plan(path)
    assert [t.scale for t in back.tensors] == [t.scale for t in plan.tensors]
    assert verify(single, back).success
    _, unscaled = plan_pair(MLP, Parallelism(dp=2), 8)
    path, _ = save_plan(unscaled, tmp_path / "u.npz")
    assert all(t.scale == (1, 1) for t in load_plan(path).tensors)


def test_traced_block_left_out_of_fully_shard_verifies(singles: dict) -> None:
    """A mistake that changes no value: the block left out of its own
    ``fully_shard`` is owned by the root's, which shards its parameters over
    dp, gathers them for the forward and reduce-scatters their gradients as
    it does the others'; only when they are gathered and freed differs (a
    real gloo run agrees: scripts/gloo_truth.py)."""
    plan_s, plan_p = _traced("llama", "fsdp_tp_block_left_out", singles)
    v = verify(plan_s, plan_p)
    assert v.success, v.message


def test_traced_fsdp_tp_with_biases_verifies() -> None:
    """FSDP2 over dp and Megatron's MLP split on tp (``_StridedShard``) with
    biased projections: the row-parallel bias is added as bias/tp to each
    partial sum, and a bias gradient is summed over rows with keepdim, then
    flattened for FSDP's reduce-scatter (the flatten of a dim of size 1 kept
    its size 1 at reduced shapes)."""
    from backends.torch.__main__ import parser, trace_and_build

    args = parser().parse_args(["--model", "backends.torch.stock_models:gpt2", "--recipe",
                                "backends.torch.stock_recipes:fsdp_tp_mlp"])
    (plan_s, plan_p), _ = trace_and_build(args, None)
    assert any(t.scale == (1, 2) for t in plan_p.tensors)  # bias / tp
    v = verify(plan_s, plan_p)
    assert v.success, v.message
