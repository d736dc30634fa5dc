"""Interleaved (virtual) pipeline schedules: each stage holds several model
chunks; the plans verify, and the schedule is Megatron's."""

from __future__ import annotations

import pytest

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.emit import Emitter
from gen_model.generate import logical_graph, make_plan
from gen_model.program import Policy
from gen_model.spmd import shard
from harness.oracle import judge
from main import verify
from verdict.differential import compare

LLAMA = ModelConfig("llama3", layers=4, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=4)
GBS = 8


@pytest.mark.parametrize(("par", "policy"), [
    (Parallelism(pp=2, nm=2), Policy(virtual_stages=2)),
    (Parallelism(dp=2, tp=2, pp=2, nm=4), Policy(virtual_stages=2)),
    (Parallelism(pp=2, nm=2), Policy(virtual_stages=2, schedule="gpipe")),
    (Parallelism(cp=2, pp=2, nm=2), Policy(virtual_stages=2)),
], ids=["pp2_vpp2", "dp2_tp2_pp2_vpp2_nm4", "gpipe", "cp2_pp2_vpp2"])
def test_interleaved_plans_verify(par, policy):
    single = make_plan(LLAMA, Parallelism(), GBS)
    plan = make_plan(LLAMA, par, GBS, policy=policy)
    assert compare(single, plan).equal
    assert judge(single, plan).right
    assert verify(single, plan).success
    # rank 0 (stage 0, chunks 0 and 2) receives at the 1-2 boundary in the forward and the
    # 0-1 and 2-3 boundaries in the backward, once per microbatch; a conversion of an input
    # (the rotary tables split on cp) is made once per rank, for both of its chunks
    assert sum(n.op == "send_recv" and n.rank == 0 for n in plan.nodes) == 3 * par.nm


def test_megatron_interleaved_order():
    par, policy = Parallelism(pp=2, nm=4), Policy(virtual_stages=2)
    g = logical_graph(LLAMA, GBS)
    emitter = Emitter(g, shard(g, LLAMA, par, policy), par, policy, {})
    f = [("fw", m, c) for m, c in [(0, 0), (1, 0), (0, 2), (1, 2), (2, 0), (3, 0), (2, 2), (3, 2)]]
    b = [("bw", m, c) for m, c in [(0, 2), (1, 2), (0, 0), (1, 0), (2, 2), (3, 2), (2, 0), (3, 0)]]
    assert emitter.order(0) == f[:4] + [x for pair in zip(f[4:], b[:4]) for x in pair] + b[4:]
    last = emitter.order(1)  # the last stage: warm-up of (vpp - 1) * pp units
    assert [u[0] for u in last[:3]] == ["fw", "fw", "fw"] and last[3][0] == "bw"


@pytest.mark.parametrize(("par", "message"), [
    (Parallelism(pp=1, nm=2), "needs --pp > 1"),
    (Parallelism(pp=2, nm=3), "divisible by --pp"),
    (Parallelism(pp=4, nm=4), "--layers at least"),
])
def test_interleaved_limits(par, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(LLAMA, par, 12, policy=Policy(virtual_stages=2))
