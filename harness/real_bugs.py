"""Bugs that shipped in widely used training frameworks, each injected into a
plan that otherwise verifies (docs/real-bugs.md).

A ``RealBug`` names where the bug shipped, the base plan it goes into (a
model, its parallelism and the parallelizer's policy) and ``inject``, the
edit that makes the plan do what the framework did. ``scripts/real_bugs.py``
(run by ``scripts/run_real_bugs.sh``) verifies every clean base and every
injected plan; ``tests/test_real_bugs.py`` checks each verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import EXPERT, Policy, number_versions
from verdict.plan import Node, Plan

LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=4)
MOE = ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16, seqlen=4,
                  experts=4, topk=2, moe_ffn=8, first_dense=1)
GBS = 16


@dataclass(frozen=True)
class RealBug:
    key: str
    source: str
    mechanism: str
    cfg: ModelConfig
    par: Parallelism
    policy: Policy
    inject: Callable[[Plan], None]
    gbs: int = GBS

    def base(self) -> Plan:
        return make_plan(self.cfg, self.par, self.gbs, policy=self.policy)

    def single(self) -> Plan:
        return make_plan(self.cfg, Parallelism(), self.gbs)

    def plan(self, base: Plan | None = None) -> Plan:
        """The base plan with the bug injected (a copy)."""
        base = base or self.base()
        out = Plan(world=dict(base.world), logical=list(base.logical),
                   tensors=list(base.tensors), nodes=list(base.nodes), loss=base.loss,
                   grads=dict(base.grads))
        self.inject(out)
        return out


# ---------------------------------------------------------------- helpers


def sites(plan: Plan, what: str, pred: Callable[[Node], bool]) -> list[int]:
    found = [i for i, n in enumerate(plan.nodes) if pred(n)]
    if not found:
        raise ConfigError(f"the bug does not apply to this plan: it has no {what}")
    return found


def loss_div(plan: Plan) -> str:
    """The name of the node that divides the summed token losses by the token
    count (the cross-entropy's per-token normalisation)."""
    names = {n.name for n in plan.nodes if n.op == "div" and n.dir == "fw"
             and not n.name.startswith("layers.")}
    if len(names) != 1:
        raise ConfigError(f"no single loss normalisation in this plan: {sorted(names)}")
    return names.pop()


def _scale_buffers(plan: Plan, factor: float, params: Callable[[str], bool],
                   before_mb: Callable[[int], bool]) -> None:
    """Multiply a rank's gradient buffer by ``factor`` right before its
    accumulation of microbatch m, for every m with ``before_mb(m)``: a new
    buffer version that keeps the claim of the one it scales."""
    edits: dict[int, Node] = {}
    for i in sites(plan, "gradient accumulation", lambda n: n.op == "local_grad_accumulation"
                    and before_mb(n.mb) and params(n.name)):
        acc = plan.nodes[i]
        old = plan.tensors[acc.inputs[0]]
        plan.tensors.append(old._replace(version=-1))
        scaled = len(plan.tensors) - 1
        edits[i] = Node(acc.rank, acc.mb, "mul_scalar", "none", (acc.inputs[0],), (scaled,),
                        {"value": factor}, acc.name)
        plan.nodes[i] = acc._replace(inputs=(scaled, acc.inputs[1]))
    nodes: list[Node] = []
    for i, n in enumerate(plan.nodes):
        if i in edits:
            nodes.append(edits[i])
        nodes.append(n)
    plan.nodes = nodes
    number_versions(plan, frozenset(plan.tensors[n.outputs[0]].tid for n in edits.values()))


def scale_outputs(plan: Plan, factor: float, pred: Callable[[Node], bool], what: str) -> None:
    """Multiply the output of every node matching ``pred`` by ``factor`` before
    its readers: a new version of the tensor, claiming what the output claims."""
    targets = sites(plan, what, pred)
    tids = frozenset(plan.tensors[plan.nodes[i].outputs[0]].tid for i in targets)
    for i in reversed(targets):
        n = plan.nodes[i]
        out = plan.nodes[i].outputs[0]
        t = plan.tensors[out]
        plan.tensors.append(t._replace(version=-1))
        scaled = len(plan.tensors) - 1
        for k in range(i + 1, len(plan.nodes)):
            m = plan.nodes[k]
            if out in m.inputs:
                plan.nodes[k] = m._replace(inputs=tuple(scaled if x == out else x
                                                        for x in m.inputs))
        plan.nodes.insert(i + 1, Node(n.rank, n.mb, "mul_scalar", "none", (out,), (scaled,),
                                      {"value": factor}, n.name))
    number_versions(plan, tids)  # taken before the inserts moved the targets' indices


# ---------------------------------------------------------------- the bugs


def _raw_summed_loss(plan: Plan) -> None:
    """torchtitan 2972: the pipeline path backpropagates the summed token
    losses, not their mean: the backward of the normalisation divides by 1."""
    name = loss_div(plan)
    for i in sites(plan, "backward of the loss normalisation",
                    lambda n: n.op == "div" and n.dir == "bw" and n.name == name):
        plan.nodes[i] = plan.nodes[i]._replace(kwargs={**plan.nodes[i].kwargs, "value": 1.0})


def _moving_average(plan: Plan) -> None:
    """torchtitan 1733: with gradient accumulation over two pipeline steps of
    nm/2 microbatches each, scale_grads divides the accumulated gradients by
    the step's microbatch count at the end of every step, so the first
    step's gradients are divided once more: a moving average, not a sum."""
    steps = int(plan.world["nm"]) // 2
    _scale_buffers(plan, 1.0 / steps, lambda name: True, lambda mb: mb == steps)


def _doubling_per_microbatch(plan: Plan) -> None:
    """Megatron-LM issue 6660: FSDP with optim_grads_params and a
    data-parallel group of size 1: the gradient "reduce-scatter" over the
    group of one adds the main-gradient buffer into itself, so the buffer
    doubles at every microbatch before the new gradient is added."""
    _scale_buffers(plan, 2.0, lambda name: True, lambda mb: mb >= 1)


def _expert_grads_times_ep(plan: Plan) -> None:
    """Megatron-LM PR 5956: FSDP with expert parallelism averages the expert
    gradients over the expert-data-parallel group instead of the whole
    data-parallel group: expert gradients ep times too large."""
    ep = float(plan.world["ep"])
    scale_outputs(plan, ep, lambda n: n.op == "reduce_scatter" and n.dir == "bw"
                   and EXPERT.search(n.name.removesuffix(".grad")) is not None,
                   "reduce-scatter of an expert weight's gradient (FSDP with expert parallelism)")


def _aux_loss_local_tokens(plan: Plan) -> None:
    """Megatron-LM PR 5047: the backward scale of the MoE auxiliary loss
    (MoEAuxLossAutoScaler) uses the token count of the local tensor-parallel
    rank's slice of the sequence, so the load-balancing gradient is tp times
    too large: it depends on the tensor-parallel size."""
    tp = float(plan.world["tp"])
    for i in sites(plan, "MoE load-balancing loss normalisation",
                    lambda n: n.op == "div" and n.dir == "bw" and ".feed_forward." in n.name):
        n = plan.nodes[i]
        plan.nodes[i] = n._replace(kwargs={**n.kwargs, "value": n.kwargs["value"] / tp})


def _sp_in_fsdp_mesh(plan: Plan) -> None:
    """VeOmni PR 1079: with the sequence-parallel ranks folded into the FSDP
    mesh, the reduced gradients are divided by sp_size once more (the
    learning rate is in effect sp_size times smaller). Here the sequence is
    split over the tensor-parallel ranks (Megatron sequence parallelism);
    every parameter's reduce-scattered gradient is divided by that size."""
    sp = float(plan.world["tp"])
    scale_outputs(plan, 1.0 / sp, lambda n: n.op == "reduce_scatter" and n.dir == "bw"
                   and n.name.endswith(".weight.grad"),
                   "reduce-scatter of a parameter's gradient (FSDP)")


BUGS: dict[str, RealBug] = {b.key: b for b in (
    RealBug("torchtitan-2972", "torchtitan issue 2972",
            "pipeline path backpropagates the raw summed loss",
            LLAMA, Parallelism(dp=2, tp=2, pp=2, nm=2), Policy(), _raw_summed_loss),
    RealBug("torchtitan-1733", "torchtitan issue 1733",
            "pipeline scale_grads with gradient accumulation: a moving average",
            LLAMA, Parallelism(dp=2, pp=2, nm=4), Policy(), _moving_average),
    RealBug("megatron-6660", "Megatron-LM issue 6660",
            "FSDP optim_grads_params with data-parallel size 1: gradients double per microbatch",
            LLAMA, Parallelism(tp=2, nm=4), Policy(zero=3), _doubling_per_microbatch),
    RealBug("megatron-5956", "Megatron-LM PR 5956",
            "FSDP with expert parallelism: expert gradients ep times too large",
            MOE, Parallelism(dp=4, ep=2, nm=2), Policy(zero=3), _expert_grads_times_ep),
    RealBug("megatron-5047", "Megatron-LM PR 5047",
            "MoE auxiliary loss scaled by the local token count: gradient depends on TP size",
            MOE, Parallelism(dp=2, tp=2, nm=2), Policy(), _aux_loss_local_tokens),
    RealBug("veomni-1079", "VeOmni PR 1079",
            "sequence parallelism folded into the FSDP mesh: an extra division by sp_size",
            LLAMA, Parallelism(dp=2, tp=2, nm=2), Policy(sequence_parallel=True, zero=3),
            _sp_in_fsdp_mesh),
)}
