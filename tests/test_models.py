"""Single-device plans of the model zoo against torch autograd, and the
structure the tracer and autodiff give them.

The numeric execution of a model's single-device plan (verdict.numeric) must
give the loss and every parameter gradient that torch autograd gives for the
same module on the same inputs (gen_model.reference.torch_step), in float64.
A perturbed plan must not.
"""

from __future__ import annotations

import resource
import time
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from gen_model.autodiff import derive_training_step
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import logical_graph, make_plan
from gen_model.graph import LogicalGraph
from gen_model.models import ZOO, build
from gen_model.reference import torch_step
from gen_model.trace import TraceError, trace_forward
from verdict.numeric import execute, final_values
from verdict.ops import get_op
from verdict.plan import INPUT_KINDS, Plan

TOL = 1e-9

CONFIGS: dict[str, tuple[ModelConfig, int]] = {
    "mlp": (ModelConfig("mlp", layers=3, hidden=8), 2),
    "llama3_gqa": (
        ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=11,
                    seqlen=5),
        3,
    ),
    "llama3_mha": (
        ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=4, ffn=24, vocab=11,
                    seqlen=5),
        2,
    ),
    "moe": (
        ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=11, seqlen=6,
                    experts=4, topk=2, moe_ffn=8, first_dense=1),
        2,
    ),
    "moe_drop": (
        ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=11, seqlen=6,
                    experts=4, topk=2, moe_ffn=8, first_dense=0, capacity_factor=0.5),
        4,
    ),
}
SEEDS = (0, 7)

_PLANS: dict[str, Plan] = {}


def plan_of(name: str) -> Plan:
    """The single-device plan of CONFIGS[name] (built once; tests copy before editing)."""
    if name not in _PLANS:
        cfg, gbs = CONFIGS[name]
        _PLANS[name] = make_plan(cfg, Parallelism(), gbs)
    return _PLANS[name]


def rel_errors(cfg: ModelConfig, plan: Plan, seed: int) -> dict[str, float]:
    """max |plan - torch| / max |torch| of the loss and of each parameter gradient."""
    got = final_values(plan, execute(plan, seed))
    want = torch_step(cfg, plan, seed)
    errs = {}
    pairs = [("loss", plan.loss)] + [(plan.logical[p].name, g) for p, g in plan.grads.items()]
    for name, tid in pairs:
        a, b = np.asarray(got[tid]), np.asarray(want[name])
        assert a.shape == b.shape, f"{name}: plan {a.shape} vs torch {b.shape}"
        scale = np.max(np.abs(b))
        errs[name] = float(np.max(np.abs(a - b)) / scale) if scale else float(np.max(np.abs(a)))
    return errs


# ---------------------------------------------------------------- plan vs torch


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_matches_torch(name: str, seed: int) -> None:
    cfg, gbs = CONFIGS[name]
    plan = plan_of(name)
    want = torch_step(cfg, plan, seed)
    model = build(cfg, device="meta")
    params = {n for n, _ in model.named_parameters()}
    assert params, "model without parameters"
    # every parameter of the torch model has a gradient buffer in the plan, and nothing else
    assert {plan.logical[p].name for p in plan.grads} == params
    assert all(plan.logical[p].kind == "param" for p in plan.grads)
    assert all(plan.logical[g].kind == "gradbuf" for g in plan.grads.values())
    # the comparison can fail: torch's gradients are not zero
    for n in params:
        assert np.any(want[n] != 0), f"torch gradient of {n} is all zero"
    assert want["loss"] != 0

    errs = rel_errors(cfg, plan, seed)
    assert set(errs) == params | {"loss"}
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"{name} seed {seed}: relative errors above {TOL}: {bad}"


def test_seeds_give_different_values() -> None:
    plan = plan_of("llama3_gqa")
    a = final_values(plan, execute(plan, SEEDS[0]))
    b = final_values(plan, execute(plan, SEEDS[1]))
    assert not np.allclose(a[plan.loss], b[plan.loss])


def test_moe_drop_config_drops_tokens() -> None:
    """capacity_factor 0.5 must actually drop tokens, or the config tests nothing extra."""
    cfg, gbs = CONFIGS["moe_drop"]
    assert cfg.capacity * cfg.experts < cfg.seqlen * cfg.topk
    plan = plan_of("moe_drop")
    values = execute(plan, SEEDS[0])
    routes = [n for n in plan.nodes if n.op == "route"]
    assert len(routes) == cfg.layers - cfg.first_dense
    for node in routes:
        d = values[node.outputs[0]]
        assert d.shape == (gbs, cfg.seqlen, cfg.experts, cfg.capacity)
        assert d.sum() < gbs * cfg.seqlen * cfg.topk
        assert np.all(d.sum(axis=1) <= 1)


# ---------------------------------------------------------------- negative: the check can fail


def _differs(cfg: ModelConfig, plan: Plan, seed: int = 0) -> dict[str, float]:
    errs = rel_errors(cfg, plan, seed)
    return {k: v for k, v in errs.items() if not v <= 1e-6}


def test_perturbed_add_scalar_differs() -> None:
    cfg, _ = CONFIGS["llama3_gqa"]
    plan = plan_of("llama3_gqa")
    i = next(i for i, n in enumerate(plan.nodes) if n.op == "add_scalar" and n.dir == "fw")
    bad = Plan.from_data(plan.to_data())
    node = bad.nodes[i]
    bad.nodes[i] = node._replace(kwargs={**node.kwargs, "value": node.kwargs["value"] + 0.5})
    assert _differs(cfg, bad)
    assert not _differs(cfg, plan)


def test_swapped_rotary_grads_differ() -> None:
    """The bw rotary node writes dq and dk; exchanging them (same shapes with
    kv_heads == heads) must change the wq and wk gradients."""
    cfg, _ = CONFIGS["llama3_mha"]
    plan = plan_of("llama3_mha")
    i = next(i for i, n in enumerate(plan.nodes) if n.op == "apply_rotary_emb" and n.dir == "bw")
    bad = Plan.from_data(plan.to_data())
    node = bad.nodes[i]
    dq, dk, *rest = node.outputs
    assert bad.tensors[dq].shape == bad.tensors[dk].shape
    bad.nodes[i] = node._replace(outputs=(dk, dq, *rest))
    diff = _differs(cfg, bad)
    assert any(k.endswith(".wq.weight") for k in diff), diff
    assert any(k.endswith(".wk.weight") for k in diff), diff
    assert "loss" not in diff


def test_dropped_accumulation_differs() -> None:
    cfg, _ = CONFIGS["moe"]
    plan = plan_of("moe")
    i = next(i for i, n in enumerate(plan.nodes) if n.op == "local_grad_accumulation")
    bad = Plan.from_data(plan.to_data())
    node = bad.nodes[i]
    # accumulate the zero buffer twice instead of the gradient
    bad.nodes[i] = node._replace(inputs=(node.inputs[0], node.inputs[0]))
    diff = _differs(cfg, bad)
    assert list(diff) == [plan.logical[bad.tensors[node.outputs[0]].tid].name.removesuffix(
        ".grad_buffer")]


# ---------------------------------------------------------------- structure


def _needs_grad_positions(g: LogicalGraph, lop) -> list[int]:
    rule = get_op(lop.op)
    if rule.backward is None:
        return []
    diff = range(len(lop.inputs)) if rule.diff is None else rule.diff
    return [p for p in diff if g.requires_grad[lop.inputs[p][0]]]


def _forward_graph(name: str) -> LogicalGraph:
    cfg, gbs = CONFIGS[name]
    return trace_forward(build(cfg, device="meta"), ZOO[cfg.model].inputs(cfg, gbs))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_multiref_fan_out(name: str) -> None:
    g = _forward_graph(name)
    before = Counter(lop.inputs[p] for lop in g.ops for p in _needs_grad_positions(g, lop))
    shared = {v: n for v, n in before.items() if n > 1}
    if name != "mlp":
        assert shared, "a transformer has values read by several differentiable consumers"
    derive_training_step(g)
    fw = [lop for lop in g.ops if lop.dir == "fw"]
    after = Counter(lop.inputs[p] for lop in fw for p in _needs_grad_positions(g, lop))
    # every value needing a gradient has at most one differentiable reader ...
    assert all(n == 1 for n in after.values()), {v: n for v, n in after.items() if n > 1}
    # ... and the shared ones are read only by a multiref with one copy per reader
    multirefs = {lop.inputs[0]: lop for lop in fw if lop.op == "multiref"}
    assert set(multirefs) == set(shared)
    for v, n in shared.items():
        lop = multirefs[v]
        assert lop.kwargs["times"] == n == len(lop.outputs)
        assert all(after[o] == 1 for o in lop.outputs)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_bw_op_per_differentiable_fw_op(name: str) -> None:
    cfg, gbs = CONFIGS[name]
    g = logical_graph(cfg, gbs)
    fw_needing = [i for i, lop in enumerate(g.ops)
                  if lop.dir == "fw" and _needs_grad_positions(g, lop)]
    bw_rules = [lop for lop in g.ops if lop.dir == "bw" and get_op(lop.op).backward is not None]
    assert len(bw_rules) == len(fw_needing)
    assert sorted(lop.fw for lop in bw_rules) == fw_needing
    for lop in bw_rules:
        primal = g.ops[lop.fw]
        assert primal.op == lop.op and primal.kwargs == lop.kwargs
        assert len(lop.outputs) == len(primal.inputs)
        assert len(lop.inputs) == len(primal.inputs) + len(primal.outputs)
    # the single-device plan has one node per logical op, in the same order
    plan = plan_of(name)
    assert [(n.op, n.dir) for n in plan.nodes] == [(lop.op, lop.dir) for lop in g.ops]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_accumulation_per_param(name: str) -> None:
    plan = plan_of(name)
    params = [tid for tid, t in enumerate(plan.logical) if t.kind == "param"]
    assert sorted(plan.grads) == params
    acc = Counter(plan.tensors[n.outputs[0]].tid for n in plan.nodes
                  if n.op == "local_grad_accumulation")
    for p in params:
        buf = plan.grads[p]
        assert acc[buf] == 1, f"{plan.logical[p].name}: {acc[buf]} accumulations"
    assert sum(acc.values()) == len(params)
    for n in plan.nodes:
        if n.op != "local_grad_accumulation":
            continue
        buf_in, grad_in = (plan.tensors[i] for i in n.inputs)
        out = plan.tensors[n.outputs[0]]
        assert buf_in.tid == out.tid and (buf_in.version, out.version) == (0, 1)
        assert plan.logical[grad_in.tid].kind == "grad"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_order_is_topological(name: str) -> None:
    plan = plan_of(name)
    written: set[int] = set()
    for k, node in enumerate(plan.nodes):
        for i in node.inputs:
            if i < 0:
                continue
            kind = plan.logical[plan.tensors[i].tid].kind
            assert i in written or kind in INPUT_KINDS, (
                f"node {k} {node.op} ({node.dir}) reads tensor {i} before it is written"
            )
        for o in node.outputs:
            if o < 0:
                continue
            assert o not in written, f"tensor {o} written twice"
            assert plan.logical[plan.tensors[o].tid].kind not in INPUT_KINDS
            written.add(o)
    keys = [t.key() for t in plan.tensors]
    assert len(keys) == len(set(keys))
    assert plan.logical[plan.loss].kind == "loss"


# ---------------------------------------------------------------- tracer


class _SinNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.lin(x)).sum()


class _BiasNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum()


class _MethodSinNet(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin().sum()


class _VectorLossNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(-1)


class _ShapeClashNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


X = {"x": ((2, 4), "data")}


@pytest.mark.parametrize(
    "module,pattern",
    [
        (_SinNet, r"sin"),
        (_MethodSinNet, r"sin"),
        (_BiasNet, r"proj.*bias|bias.*proj"),
        (_VectorLossNet, r"scalar loss"),
        (_ShapeClashNet, r"lin"),
    ],
)
def test_trace_errors_name_the_construct(module: type[nn.Module], pattern: str) -> None:
    with torch.device("meta"):
        model = module()
    with pytest.raises(TraceError, match=pattern):
        trace_forward(model, X)


# ---------------------------------------------------------------- meta device


BIG = ModelConfig("llama3", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                  vocab=128256, seqlen=8192)


def test_build_large_llama3_on_meta_allocates_nothing() -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, peak
    model = build(BIG, device="meta")
    params = list(model.parameters())
    assert all(p.device.type == "meta" for p in params)
    assert all(b.device.type == "meta" for b in model.buffers())
    n = sum(p.numel() for p in params)
    assert n > 7_000_000_000  # Llama 3 8B: 32 GB in float32 if it were allocated
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 1024, f"building on meta raised peak RSS by {grown_mib:.0f} MiB"


def test_trace_large_llama3_logical_graph_quickly() -> None:
    cfg = ModelConfig("llama3", layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                      vocab=128256, seqlen=8192)
    start = time.perf_counter()
    g = logical_graph(cfg, 4)
    took = time.perf_counter() - start
    assert took < 20, f"tracing took {took:.1f} s"
    shapes = {t.name: t.shape for t in g.tensors}
    assert shapes["tok_embeddings.weight"] == (128256, 4096)
    assert shapes["layers.0.attention.wk.weight"] == (1024, 4096)
    assert shapes["tokens"] == (4, 8192, 128256)
    assert g.tensors[g.loss].kind == "loss" and g.tensors[g.loss].shape == ()
    assert len(g.grads) == sum(1 for t in g.tensors if t.kind == "param")
