"""Context parallelism: the sequence split across ranks, keys and values
all-gathered, each rank's causal mask placed at its chunk. The plans verify;
wrong ones (a mask one chunk off, chunks gathered out of order, a chunk
from the wrong peer, the key and value exchange left out), judged wrong by
the oracle, fail; and the mask's stage keeps every chunk boundary, at least
2 positions per chunk."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import caught, plan_pair

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge
from main import verify
from verdict.differential import compare
from verdict.lineage import infer_lineages
from verdict.plan import Plan, pair_problem
from verdict.reduce import reduce_stage
from verdict.stages import cut_stages

LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=8)
GBS = 4
PLAIN = Policy()


def plans(par: Parallelism, policy: Policy = PLAIN) -> tuple[Plan, Plan]:
    return plan_pair(LLAMA, par, GBS, policy)


@pytest.mark.parametrize(("par", "policy"), [
    (Parallelism(cp=4), Policy()),
    (Parallelism(cp=2, dp=2, nm=2), Policy()),
    (Parallelism(cp=2, tp=2, pp=2), Policy(sequence_parallel=True)),
], ids=["cp4", "cp2_dp2_nm2", "cp2_tp2_pp2_sp"])
def test_context_parallel_plans_verify(par, policy):
    single, plan = plans(par, policy)
    assert pair_problem(single, plan) is None
    assert compare(single, plan).equal
    assert judge(single, plan).right
    assert verify(single, plan).success


def test_keys_and_values_gathered_and_masks_placed():
    _, plan = plans(Parallelism(cp=4))
    rank1 = [n for n in plan.nodes if n.rank == 1]
    count = Counter((n.dir, n.op) for n in rank1)
    assert count[("fw", "all_gather")] == 2 * LLAMA.layers  # keys and values
    assert count[("bw", "reduce_scatter")] == 2 * LLAMA.layers  # their gradients
    masks = [n for n in plan.nodes if n.op == "causal_mask" and n.dir == "fw"]
    assert {n.rank: n.kwargs.get("row_chunk", 0) for n in masks} == {0: 0, 1: 1, 2: 2, 3: 3}
    assert all("col_chunk" not in n.kwargs for n in masks)


def test_mask_stage_keeps_two_positions_per_chunk():
    """Both sequence dims of the mask's stage are reduced alike (one class)
    and keep at least 2 positions of every chunk (docs/soundness.md)."""
    single, plan = plans(Parallelism(cp=4))
    lineages, of_gs, of_gp = infer_lineages(single, plan)
    seen = 0
    for st in cut_stages(single, plan, lineages, of_gs, of_gp):
        if st.gs_node < 0 or single.nodes[st.gs_node].op != "causal_mask":
            continue
        tensors = sorted({t for i in st.gp_nodes for t in (*plan.nodes[i].inputs,
                                                            *plan.nodes[i].outputs) if t >= 0})
        red = reduce_stage(single, plan, st, lineages, of_gp, tensors)
        scores = single.nodes[st.gs_node].outputs[0]
        rows, cols = red.gs_shape[scores][-2:]
        assert rows == cols >= 2 * 4
        assert all(red.gp_shape(t)[-2] >= 2 for t in tensors)
        seen += 1
    assert seen


@pytest.mark.parametrize("operator", ["mask_offset", "permute_group", "drop_exchange",
                                      "wrong_member"])
def test_wrong_context_parallel_plans_fail(operator):
    single, plan = plans(Parallelism(cp=4))
    assert caught(single, plan, operator, "context")


def test_mask_one_chunk_off_on_one_rank_fails():
    single, plan = plans(Parallelism(cp=4))
    p = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(p.nodes) if n.op == "causal_mask" and n.rank == 2)
    p.nodes[i] = p.nodes[i]._replace(kwargs={"row_chunk": 1})
    assert not judge(single, p).right
    v = verify(single, p)
    assert not v.success
    assert single.nodes[v.failed[0].stage.gs_node].op == "causal_mask"


@pytest.mark.parametrize(("cfg", "par", "message"), [
    (ModelConfig("mlp", layers=2, hidden=8), Parallelism(cp=2), "needs the llama3 model"),
    (LLAMA, Parallelism(cp=16), "not divisible"),
])
def test_context_parallel_limits(cfg, par, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(cfg, par, GBS)
