"""The optimizer step: SGD with weight decay, Adam and AdamW against
torch.optim (one step, float64), and plans whose contract is the updated
parameter shard on every rank: correct plans verify, wrong updates fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gen_model.autodiff import OPTIMIZER_KWARGS
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from harness.mutations import copy_plan, drop_orphans
from harness.oracle import judge
from main import verify
from verdict.differential import compare
from verdict.numeric import NumericXP
from verdict.ops import get_op
from verdict.plan import Node, Plan

GBS = 16


def _torch_step(name: str, p: np.ndarray, g: np.ndarray) -> np.ndarray:
    op, kw = OPTIMIZER_KWARGS[name]
    w = torch.tensor(p, requires_grad=True)
    w.grad = torch.tensor(g)
    if name == "sgd":
        opt = torch.optim.SGD([w], lr=kw["lr"], weight_decay=kw["weight_decay"])
    else:
        cls = torch.optim.AdamW if kw["decoupled"] else torch.optim.Adam
        opt = cls([w], lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]), eps=kw["eps"],
                  weight_decay=kw["weight_decay"])
    opt.step()
    return w.detach().numpy()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_step_is_torch_optim(name):
    rng = np.random.default_rng(5)
    p, g = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    op, kw = OPTIMIZER_KWARGS[name]
    inputs = (p, g) if op == "sgd_step" else (p, g, np.zeros_like(p), np.zeros_like(p))
    out = get_op(op).forward(NumericXP(), inputs, **kw)
    np.testing.assert_allclose(out[0], _torch_step(name, p, g), rtol=1e-12, atol=1e-15)
    assert get_op(op).shape([x.shape for x in inputs], **kw) == [o.shape for o in out]


def cfg(optimizer: str) -> ModelConfig:
    return ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12,
                       seqlen=4, optimizer=optimizer)


def pair(optimizer: str, par: Parallelism, zero: int = 0) -> tuple[Plan, Plan]:
    return (make_plan(cfg(optimizer), Parallelism(), GBS),
            make_plan(cfg(optimizer), par, GBS, policy=Policy(zero=zero)))


@pytest.mark.parametrize(("optimizer", "par", "zero"), [
    ("sgd", Parallelism(dp=2, tp=2, pp=2, nm=2), 0),
    ("adamw", Parallelism(dp=2, tp=2, nm=2), 1),
    ("adam", Parallelism(dp=4, nm=2), 3),
], ids=str)
def test_updated_shards_verify(optimizer, par, zero):
    single, plan = pair(optimizer, par, zero)
    assert any(n.op in ("sgd_step", "adam_step") for n in plan.nodes)
    report = compare(single, plan)
    assert report.equal, [d.describe() for d in report.differences] + report.uncovered
    verdict = verify(single, plan)
    assert verdict.success, verdict.message


def _update_node(plan: Plan, rank: int) -> int:
    return next(i for i, n in enumerate(plan.nodes) if n.op == "adam_step" and n.rank == rank)


def test_update_with_the_unreduced_gradient_fails():
    single, plan = pair("adamw", Parallelism(dp=2))
    i = _update_node(plan, 1)
    n = plan.nodes[i]
    unreduced = next(k for k, t in enumerate(plan.tensors) if t.rank == 1 and t.tid ==
                     plan.tensors[n.inputs[1]].tid and not t.is_whole() and t.parts[1] == 2)
    plan.nodes[i] = n._replace(inputs=(n.inputs[0], unreduced, *n.inputs[2:]))
    verdict = verify(single, plan)
    assert not verdict.success and verdict.kind == "stage"


def test_update_with_another_learning_rate_fails():
    single, plan = pair("adamw", Parallelism(dp=2, tp=2))
    i = _update_node(plan, 3)
    plan.nodes[i] = plan.nodes[i]._replace(kwargs={**plan.nodes[i].kwargs, "lr": 0.002})
    verdict = verify(single, plan)
    assert not verdict.success and verdict.kind == "stage"


def test_a_rank_that_never_updates_fails():
    single, plan = pair("sgd", Parallelism(dp=2))
    drop = {i for i, n in enumerate(plan.nodes) if n.op == "sgd_step" and n.rank == 0}
    gone = {o for i in drop for o in plan.nodes[i].outputs}
    plan.nodes = [n for i, n in enumerate(plan.nodes) if i not in drop]
    # its updated tensors left in the plan, written by nobody: claims no node makes true
    verdict = verify(single, drop_orphans(plan))
    assert verdict.kind == "unreachable" and "which no node writes" in verdict.message
    # and without them: the rank ends with no update of the shards it holds
    keep = [i for i in range(len(plan.tensors)) if i not in gone]
    index = {old: new for new, old in enumerate(keep)}
    plan.tensors = [plan.tensors[i] for i in keep]
    plan.nodes = [n._replace(inputs=tuple(index.get(t, -1) for t in n.inputs),
                             outputs=tuple(index.get(t, -1) for t in n.outputs))
                  for n in plan.nodes]
    verdict = verify(single, plan)
    assert not verdict.success and "rank 0 holds shard" in verdict.message
    assert "never updates it" in verdict.message


def _state_of(plan: Plan, rank: int, name: str) -> int:
    return next(o for n in plan.nodes if n.op == "adam_step" and n.rank == rank
                for o in n.outputs[1:] if plan.logical[plan.tensors[o].tid].name.endswith(name))


def test_a_rank_ending_with_a_peers_optimizer_state_fails():
    """Rank 0 updates its parameter shard right but ends with rank 1's
    exp_avg shard (sent to it after the step, claimed truthfully): the next
    step would read the wrong moment."""
    single, plan = pair("adam", Parallelism(dp=2), zero=1)
    mine, theirs = _state_of(plan, 0, "wq.weight.exp_avg"), _state_of(plan, 1, "wq.weight.exp_avg")
    x = plan.tensors[mine]
    assert plan.tensors[theirs].slices != x.slices
    plan.tensors.append(plan.tensors[theirs]._replace(rank=0, version=x.version + 1))
    plan.nodes.append(Node(0, -1, "send_recv", "none", (theirs,), (len(plan.tensors) - 1,),
                           {"src": 1, "dst": 0}, "exp_avg"))
    assert not judge(single, plan).right
    verdict = verify(single, plan)
    assert not verdict.success and verdict.kind == "coverage"
    assert "rank 0 holds shard" in verdict.message and "exp_avg at slice" in verdict.message


def test_swapped_or_unwritten_moments_fail():
    single, plan = pair("adam", Parallelism(dp=2), zero=2)
    i = _update_node(plan, 1)
    n = plan.nodes[i]
    swapped = copy_plan(plan)
    swapped.nodes[i] = n._replace(outputs=(n.outputs[0], n.outputs[2], n.outputs[1]))
    assert not judge(single, swapped).right
    assert not verify(single, swapped).success
    unwritten = copy_plan(plan)
    unwritten.nodes[i] = n._replace(outputs=(n.outputs[0], -1, -1))
    gone = set(n.outputs[1:])
    keep = [k for k in range(len(plan.tensors)) if k not in gone]
    index = {old: new for new, old in enumerate(keep)}
    unwritten.tensors = [plan.tensors[k] for k in keep]
    unwritten.nodes = [m._replace(inputs=tuple(index.get(t, -1) for t in m.inputs),
                                  outputs=tuple(index.get(t, -1) for t in m.outputs))
                       for m in unwritten.nodes]
    assert not judge(single, unwritten).right
    verdict = verify(single, unwritten)
    assert not verdict.success and verdict.kind == "coverage"
    assert "rank 1 holds shard" in verdict.message and "never updates its" in verdict.message


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_gathers_the_updated_shards(zero):
    """ZeRO-1/2 keep the whole parameter for the step: after the update every
    rank all-gathers the owners' updated shards and ends with the whole
    updated parameter; a gather that reads its own shard twice fails."""
    single, plan = pair("sgd", Parallelism(dp=2), zero)
    gathers = [i for i, n in enumerate(plan.nodes) if n.op == "all_gather"
               and plan.tensors[n.outputs[0]].lver == 1]
    assert gathers and all(plan.nodes[i].mb == -1 for i in gathers)
    for (tid, _), t in plan.last_writes().items():
        if tid in plan.grads:
            assert plan.tensors[t].slices == tuple((0, n) for n in plan.logical[tid].shape)
    assert verify(single, plan).success
    bad = copy_plan(plan)
    n = bad.nodes[gathers[0]]
    own = next(t for t in n.inputs if bad.tensors[t].rank == n.rank)
    bad.nodes[gathers[0]] = n._replace(inputs=(own,) * len(n.inputs))
    assert not judge(single, bad).right
    assert not verify(single, bad).success
