"""Context parallelism with causal load balancing: the sequence cut into
2 cp chunks, rank i holding chunks i and 2 cp - 1 - i. The plans verify and
give every rank the same number of unmasked scores; wrong ones (the data
loaded for the wrong chunk, the mask placed as if the chunks were
contiguous, a chunk masked as the diagonal block, keys gathered in rank
order, one chunk's gradient or loss left out), judged wrong by the oracle,
fail."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from helpers import caught, plan_pair

from backends.planfile import load_world
from gen_model.__main__ import main
from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge
from main import verify
from verdict.differential import compare
from verdict.final import rank_states
from verdict.lineage import infer_lineages
from verdict.ops.nn import causal_positions
from verdict.plan import Plan, pair_problem
from verdict.reduce import reduce_stage
from verdict.stages import cut_stages
from verdict.symmetry.fold import fold_pair

LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=8)
GBS = 4
BALANCED = Policy(cp_balance=True)


def plans(par: Parallelism, policy: Policy = BALANCED) -> tuple[Plan, Plan]:
    return plan_pair(LLAMA, par, GBS, policy)


@pytest.mark.parametrize(("par", "policy"), [
    (Parallelism(cp=2), BALANCED),
    (Parallelism(cp=4), BALANCED),
    (Parallelism(cp=2, dp=2, nm=2), BALANCED),
    (Parallelism(cp=2, tp=2, pp=2), Policy(cp_balance=True, sequence_parallel=True)),
], ids=["cp2", "cp4", "cp2_dp2_nm2", "cp2_tp2_pp2_sp"])
def test_balanced_plans_verify(par, policy):
    single, plan = plans(par, policy)
    assert pair_problem(single, plan) is None
    assert plan.world["cp_balance"] is True
    assert compare(single, plan).equal
    assert judge(single, plan).right
    assert verify(single, plan).success


def token_chunks(plan: Plan) -> dict[int, set[int]]:
    """The sequence chunks (of 2 cp) of the tokens each rank loads."""
    chunk = LLAMA.seqlen // (2 * plan.world["cp"])
    tokens = next(i for i, t in enumerate(plan.logical) if t.name == "tokens")
    held = defaultdict(set)
    for t in plan.tensors:
        if t.tid == tokens:
            held[t.rank].add(t.slices[1][0] // chunk)
    return dict(held)


def visible(plan: Plan) -> dict[int, int]:
    """Unmasked scores per rank in its forward causal masks."""
    count: dict[int, int] = defaultdict(int)
    for n in plan.nodes:
        if n.op == "causal_mask" and n.dir == "fw":
            rows, cols = plan.tensors[n.outputs[0]].shape[-2:]
            hidden = causal_positions(rows, cols, n.kwargs.get("row_chunk", 0),
                                      n.kwargs.get("col_chunk", 0))
            count[n.rank] += int(np.sum(~hidden))
    return dict(count)


def test_folded_balanced_plan_verifies():
    """Two of four replicas and two of four microbatches shown
    (verdict/symmetry/fold.py); a cp rank's two chunks are part of its class."""
    single = make_plan(LLAMA, Parallelism(), 16)
    plan = make_plan(LLAMA, Parallelism(cp=2, dp=4, nm=4), 16, policy=BALANCED, fold=True)
    shown, _ = fold_pair(single, plan)
    assert verify(shown, plan).success


def test_rank_i_holds_chunks_i_and_mirror_and_equal_work():
    _, plan = plans(Parallelism(cp=4))
    assert token_chunks(plan) == {0: {0, 7}, 1: {1, 6}, 2: {2, 5}, 3: {3, 4}}
    masks = defaultdict(set)
    for n in plan.nodes:
        if n.op == "causal_mask" and n.dir == "fw":
            masks[n.rank].add(n.kwargs.get("row_chunk", 0))
    assert dict(masks) == token_chunks(plan)
    assert len(set(visible(plan).values())) == 1  # the same masked work on every rank
    _, contiguous = plans(Parallelism(cp=4), Policy())
    assert len(set(visible(contiguous).values())) == 4


def test_one_loss_and_one_gradient_buffer_chain_per_rank():
    """A rank sums its two chunks' losses (one loss per microbatch) and
    accumulates both chunks' weight gradients into one buffer."""
    single, plan = plans(Parallelism(cp=2, dp=2, nm=2))
    for st in rank_states(single, plan).values():
        assert len(st.loss) == 2  # microbatches
        for t in st.loss:
            lo, hi, n = plan.tensors[t].parts
            assert hi - lo == 2 and lo % 2 == 0 and n == 2 * 2 * 2 * 2
    adds = [n for n in plan.nodes if n.op == "add" and plan.tensors[n.outputs[0]].tid == plan.loss]
    assert len(adds) == 4 * 2


def test_mask_stage_keeps_every_chunk_boundary():
    """With 2 cp = 4 chunks of 4 positions, the mask's stage reduces both
    sequence dims alike to 2 positions per chunk: the boundary inside a
    rank's pair of chunks is kept like those between ranks."""
    cfg = ModelConfig("llama3", layers=1, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                      seqlen=16)
    single = make_plan(cfg, Parallelism(), 2)
    plan = make_plan(cfg, Parallelism(cp=2), 2, policy=BALANCED)
    lineages, of_gs, of_gp = infer_lineages(single, plan)
    seen = 0
    for st in cut_stages(single, plan, lineages, of_gs, of_gp):
        if st.gs_node < 0 or single.nodes[st.gs_node].op != "causal_mask":
            continue
        tensors = sorted({t for i in st.gp_nodes for t in (*plan.nodes[i].inputs,
                                                            *plan.nodes[i].outputs) if t >= 0})
        red = reduce_stage(single, plan, st, lineages, of_gp, tensors)
        rows, cols = red.gs_shape[single.nodes[st.gs_node].outputs[0]][-2:]
        assert rows == cols == 8
        assert {red.gp_shape(t)[-2] for t in tensors} == {2}
        seen += 1
    assert seen == 2  # forward and backward


def test_command_line_names_the_plan(tmp_path):
    argv = ["--model", "llama3", "--layers", "1", "--hidden", "16", "--heads", "4",
            "--kv_heads", "2", "--ffn", "24", "--vocab", "12", "--seqlen", "8", "--gbs", "2",
            "--cp", "2", "--cp_balance", "-o", str(tmp_path)]
    assert main(argv) == 0
    (pkl,) = tmp_path.glob("*.pkl")
    assert pkl.name.endswith("_cp2_cpbal.pkl")
    assert load_world(pkl)["cp_balance"] is True


def test_balance_limits():
    with pytest.raises(ConfigError, match="needs --cp > 1"):
        make_plan(LLAMA, Parallelism(dp=2), GBS, policy=BALANCED)
    with pytest.raises(ConfigError, match="not divisible by 16"):
        make_plan(LLAMA, Parallelism(cp=8), GBS, policy=BALANCED)


def _fails(single: Plan, wrong: Plan) -> None:
    assert not judge(single, wrong).right
    assert not verify(single, wrong).success


def test_data_loaded_for_the_wrong_chunk_fails():
    """Ranks 0 and 1 load each other's second chunk (a data loader that
    hands out chunks contiguously: rank 0 chunks 0 and 2)."""
    single, plan = plans(Parallelism(cp=2))
    p = mutations.copy_plan(plan)
    chunk = LLAMA.seqlen // 4
    inputs = {i for i, t in enumerate(p.tensors) if p.logical[t.tid].kind == "tokens"}
    for i in inputs:
        t = p.tensors[i]
        start = t.slices[1][0] // chunk
        if start in (2, 3):
            swapped = (5 - start) * chunk
            p.tensors[i] = t._replace(slices=(t.slices[0], (swapped, swapped + chunk),
                                              *t.slices[2:]))
    _fails(single, p)


def test_mask_placed_as_if_contiguous_fails():
    """Each rank masks its second chunk as the chunk after its first (rank i
    as if it held chunks 2i and 2i+1)."""
    single, plan = plans(Parallelism(cp=2))
    p = mutations.copy_plan(plan)
    for i, n in enumerate(p.nodes):
        if n.op == "causal_mask":
            chunk = n.kwargs.get("row_chunk", 0)
            rank_of = chunk if chunk < 2 else 3 - chunk
            p.nodes[i] = n._replace(kwargs={"row_chunk": 2 * rank_of + (chunk >= 2)})
    _fails(single, p)


def test_second_chunk_masked_as_the_diagonal_block_fails():
    """Rank 1 masks its second chunk (positions 4-5 of 8) as if its rows
    were the first positions: the block is masked as diagonal when the keys
    before it are all visible."""
    single, plan = plans(Parallelism(cp=2))
    p = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(p.nodes) if n.op == "causal_mask" and n.dir == "fw"
             and n.rank == 1 and n.kwargs.get("row_chunk") == 2)
    p.nodes[i] = p.nodes[i]._replace(kwargs={})
    _fails(single, p)


def test_keys_gathered_in_rank_order_fail():
    """The all-gather of keys and values concatenates the pieces in rank
    order (chunks 0, 3, 1, 2) and the plan never puts them back in
    sequence order."""
    single, plan = plans(Parallelism(cp=2))
    p = mutations.copy_plan(plan)
    for i, n in enumerate(p.nodes):
        if n.op == "all_gather" and n.dir == "fw":
            a, b, c, d = n.inputs
            p.nodes[i] = n._replace(inputs=(a, d, b, c))
    _fails(single, p)


def test_one_chunks_gradient_left_out_fails():
    """A rank accumulates only its first chunk's weight gradient."""
    single, plan = plans(Parallelism(cp=2))
    p = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(p.nodes) if n.op == "local_grad_accumulation"
             and n.rank == 1 and p.tensors[n.outputs[0]].parts[1] % 2 == 0)
    n = p.nodes.pop(i)
    mutations._reroute(p, n.outputs[0], n.inputs[0], i)
    _fails(single, mutations.drop_orphans(p))


def test_one_chunks_loss_left_out_fails():
    """A rank reports the loss of its first chunk only."""
    single, plan = plans(Parallelism(cp=2))
    p = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(p.nodes) if n.op == "add" and n.rank == 0
             and p.tensors[n.outputs[0]].tid == p.loss)
    p.nodes.pop(i)
    _fails(single, mutations.drop_orphans(p))


@pytest.mark.parametrize("operator", ["mask_offset", "drop_exchange", "wrong_index"])
def test_wrong_balanced_plans_fail(operator):
    single, plan = plans(Parallelism(cp=2))
    assert caught(single, plan, operator, "balanced")
