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
from dataclasses import dataclass, replace

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
    the step's microbatch count at the end of every step: the first step's
    sum is divided before the second step adds to it, and the whole sum is
    divided again at the end, ((g1 + g2) / 2 + g3 + g4) / 2 at nm 4."""
    steps = int(plan.world["nm"]) // 2
    _scale_buffers(plan, 1.0 / steps, lambda name: True, lambda mb: mb == steps)
    last = int(plan.world["nm"]) - 1
    scale_outputs(plan, 1.0 / steps, lambda n: n.op == "local_grad_accumulation"
                  and n.mb == last, "gradient accumulation of the last microbatch")


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


def _dkv_not_accumulated(plan: Plan) -> None:
    """Megatron-LM issues 1464 and 1465, TransformerEngine issue 1557: the
    backward of context-parallel attention with P2P exchange of K and V
    (AttnFuncWithCPAndKVP2P.backward) returned wrong dQ, dK and dV. In the
    ring, each step adds its partial dK/dV of the chunk it holds and passes
    it on; where a step copies instead of adding, the chunk's owner ends
    with a partial gradient. Here the plan exchanges K and V by all-gather,
    whose backward is the reduce-scatter of dK and dV; on the first
    context-parallel rank that exchange is missing: it keeps its own
    chunk of its own partial dK and dV (a local split), in every layer and
    microbatch. The forward is untouched."""
    cp = int(plan.world["cp"])
    for i in sites(plan, "backward reduce-scatter of a K/V gradient over the context-parallel "
                   "ranks", lambda n: n.op == "reduce_scatter" and n.dir == "bw"
                   and ".attention." in n.name and n.rank % (cp * int(plan.world.get("tp", 1)))
                   == 0):
        n = plan.nodes[i]
        index = n.kwargs["index"]
        own = n.inputs[index]
        plan.nodes[i] = n._replace(op="split", inputs=(own,),
                                   kwargs={"dim": n.kwargs["dim"], "parts": len(n.inputs),
                                           "index": index})


def _only_last_microbatch(plan: Plan) -> None:
    """DeepSpeed issue 1488 (loss differs between ZeRO stages with gradient
    accumulation; the mechanism as the open-instruct PR 1498 traced it in
    ZeRO-2): every backward is taken for an accumulation boundary, which
    resets the partition's accumulator, so only the last microbatch's
    reduced gradient reaches the step. Here the accumulation of the last
    microbatch adds its gradient to the zeroed buffer, not to the running
    one, for every parameter on every rank: a stale value read."""
    first: dict[tuple[int, int], int] = {}
    last = int(plan.world["nm"]) - 1
    for i in sites(plan, "gradient accumulation over microbatches",
                   lambda n: n.op == "local_grad_accumulation" and n.mb >= 0):
        n = plan.nodes[i]
        key = (n.rank, plan.tensors[n.outputs[0]].tid)
        first.setdefault(key, n.inputs[0])
        if n.mb == last:
            plan.nodes[i] = n._replace(inputs=(first[key], n.inputs[1]))


def _vocab_offset_zero(plan: Plan) -> None:
    """torchtitan PR 4730: a graph traced once on rank 0 and loaded on every
    rank kept rank 0's vocabulary offset: on tensor-parallel rank 1 the
    vocab-parallel embedding and the vocab-parallel cross-entropy read the
    token and label columns of offset 0, not of the rank's own shard. Here
    every rank with tensor-parallel index 1 loads the one-hot tokens and
    labels of vocabulary columns [0, V/tp): a wrong shard offset."""
    tp = int(plan.world["tp"])
    written = {o for n in plan.nodes for o in n.outputs if o >= 0}
    moved = 0
    for i, t in enumerate(plan.tensors):
        if i in written or plan.logical[t.tid].kind != "tokens" or t.rank % tp != 1:
            continue
        (a, b) = t.slices[-1]
        if a > 0:
            plan.tensors[i] = t._replace(slices=(*t.slices[:-1], (0, b - a)))
            moved += 1
    if not moved:
        raise ConfigError("the bug does not apply to this plan: no vocabulary-parallel tokens")


def _crossed_receives(plan: Plan) -> None:
    """Megatron-LM issue 1450 (PR 5271): with an interleaved pipeline over 2
    stages the previous and the next stage are one peer; a bidirectional
    exchange posts two receives from it, and tagless NCCL pairs them in the
    order they were posted, which the two ranks post in opposite roles: the
    activation received is the peer's gradient and the gradient received
    is the peer's activation. Here, at every point of the schedule where a
    rank receives a forward activation and a backward gradient of one shape
    from its peer with both already sent, the two receives read each
    other's message: a wrong peer tensor."""
    producer = plan.producers()
    recv = [i for i, n in enumerate(plan.nodes) if n.op == "send_recv"]
    pairs = []
    taken: set[int] = set()
    for i in recv:
        a = plan.nodes[i]
        if a.dir != "fw" or i in taken:
            continue
        x = a.inputs[0]
        near = [j for j in recv if j not in taken and plan.nodes[j].dir == "bw"
                and plan.nodes[j].rank == a.rank
                and plan.tensors[plan.nodes[j].inputs[0]].rank == plan.tensors[x].rank
                and plan.tensors[plan.nodes[j].inputs[0]].shape == plan.tensors[x].shape
                and max(producer[x], producer[plan.nodes[j].inputs[0]]) < min(i, j)]
        if near:
            j = min(near, key=lambda j: abs(i - j))
            pairs.append((i, j))
            taken |= {i, j}
    if not pairs:
        raise ConfigError("the bug does not apply to this plan: no bidirectional exchange "
                          "between two pipeline stages")
    for i, j in pairs:
        a, b = plan.nodes[i], plan.nodes[j]
        plan.nodes[i] = a._replace(inputs=b.inputs)
        plan.nodes[j] = b._replace(inputs=a.inputs)


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
    RealBug("megatron-1465", "Megatron-LM issues 1464, 1465; TransformerEngine issue 1557",
            "context-parallel attention backward: a rank's dK/dV not accumulated over the ring",
            LLAMA, Parallelism(cp=2, nm=2), Policy(), _dkv_not_accumulated),
    RealBug("deepspeed-1488", "DeepSpeed issue 1488 (open-instruct PR 1498)",
            "ZeRO-2 with gradient accumulation: only the last microbatch's gradient survives",
            LLAMA, Parallelism(dp=2, nm=4), Policy(zero=2), _only_last_microbatch),
    RealBug("torchtitan-4730", "torchtitan PR 4730",
            "vocab-parallel embedding and loss on tensor-parallel rank 1 with offset 0",
            LLAMA, Parallelism(tp=2, nm=2), Policy(vocab_parallel=True), _vocab_offset_zero),
    RealBug("megatron-1450", "Megatron-LM issue 1450 (PR 5271)",
            "interleaved pipeline over 2 stages: activation and gradient receives crossed",
            replace(LLAMA, layers=4), Parallelism(pp=2, nm=4), Policy(virtual_stages=2),
            _crossed_receives),
)}
