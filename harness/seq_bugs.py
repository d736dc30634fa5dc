"""Sequence-dimension bugs that shipped in public frameworks, injected into
plans that otherwise verify.

    SEQ_BUGS[key] -> RealBug(key, source, mechanism, cfg, par, policy, inject, gbs)

``inject(plan)`` edits a copy of the clean plan in place so that it does
what the framework did: node names, views and kwargs are those a
parallelizer writes, nothing names the bug. Entries are records of the
real-bug registry (harness/real_bugs.py, docs/real-bugs.md);
scripts/real_bugs.py runs both.
"""

from __future__ import annotations

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.parallelize import Policy, number_versions
from harness.mutations import drop_orphans
from harness.real_bugs import RealBug, loss_div, scale_outputs, sites
from verdict.plan import Node, Plan

LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=8)
GBS = 8


def _final_norm_grad_not_reduced(plan: Plan) -> None:
    """Megatron all-reduces across TP the gradients of the parameters it
    marks sequence-parallel (the norms, which see one sequence chunk per TP
    rank); the final norm was not marked, so each TP rank keeps the
    gradient of its own chunk: the all_reduce of ``norm.weight.grad`` is not
    emitted and the accumulation reads the rank's partial gradient."""
    dropped = {i for i, n in enumerate(plan.nodes) if n.op == "all_reduce"
               and n.name == "norm.weight.grad"}
    if not dropped:
        raise ConfigError("megatron-1446 needs sequence parallelism with tp > 1")
    own = {}
    for i in dropped:
        n = plan.nodes[i]
        own[n.outputs[0]] = next(t for t in n.inputs if plan.tensors[t].rank == n.rank)
    plan.nodes = [n._replace(inputs=tuple(own.get(t, t) for t in n.inputs))
                  for i, n in enumerate(plan.nodes) if i not in dropped]
    drop_orphans(plan)


def _grads_scaled_by_sp(plan: Plan) -> None:
    """Each sequence-parallel rank's gradient comes out sp times too large
    (its loss normalized as if its chunk were the whole sequence) while the
    reduction sums the sequence-parallel ranks as it sums data-parallel
    replicas: every rank seeds its backward with sp instead of 1."""
    sp = int(plan.world.get("cp", 1))
    if sp < 2:
        raise ConfigError("deepspeed-5248 needs Ulysses sequence parallelism (cp > 1)")
    seeds = [i for i, n in enumerate(plan.nodes) if n.op == "ones"
             and plan.logical[plan.tensors[n.outputs[0]].tid].kind == "grad"]
    for i in reversed(seeds):
        n = plan.nodes[i]
        seed = n.outputs[0]
        plan.tensors.append(plan.tensors[seed])
        scaled = len(plan.tensors) - 1
        for k in range(i + 1, len(plan.nodes)):
            if seed in plan.nodes[k].inputs:
                plan.nodes[k] = plan.nodes[k]._replace(
                    inputs=tuple(scaled if t == seed else t for t in plan.nodes[k].inputs))
        plan.nodes.insert(i + 1, Node(n.rank, n.mb, "mul_scalar", "fw", (seed,), (scaled,),
                                      {"value": float(sp)}, n.name))
    number_versions(plan, frozenset(plan.tensors[plan.nodes[i].outputs[0]].tid for i in seeds))


def _cp(plan: Plan, key: str) -> int:
    cp = int(plan.world.get("cp", 1))
    if cp < 2 or plan.world.get("ulysses"):
        raise ConfigError(f"{key} needs context parallelism (cp > 1, keys and values gathered)")
    return cp


def _scale_loss_grad(plan: Plan, factor: float) -> None:
    """The backward of the per-token normalisation (the ``div`` of the summed
    token losses by the global token count N) divides by ``N / factor``: the
    gradient of every rank's token-loss sum is ``factor`` times 1/N. The
    forward loss, which is what is reported, is unchanged."""
    name = loss_div(plan)
    for i in sites(plan, "backward of the loss normalisation",
                   lambda n: n.op == "div" and n.dir == "bw" and n.name == name):
        n = plan.nodes[i]
        plan.nodes[i] = n._replace(kwargs={**n.kwargs, "value": n.kwargs["value"] / factor})


def _cp_scale_meets_per_token(plan: Plan) -> None:
    """Megatron-LM issue 673, per-token mode: each context-parallel rank
    backpropagates its chunk's token-loss sum times cp (the loss scale meant
    to undo an averaging over the cp ranks), while per-token normalisation
    divides the gradients summed over dp and cp by the global token count,
    with no averaging to undo: the loss's gradient is cp / N on every rank."""
    _scale_loss_grad(plan, float(_cp(plan, "megatron-673")))


def _buffer_scaled_by_dp_only(plan: Plan) -> None:
    """Megatron-LM issue 906: the loss is multiplied by cp, and the gradient
    buffer, which must be divided by the size of the group it is all-reduced
    over (dp x cp), is divided by dp only. The plan folds the correct factors
    (the loss's x cp and the buffer's 1/(dp x cp)) into the per-token
    normalisation, so what is left of the bug is a factor cp on every rank's
    accumulated buffer before the reduction over dp and cp."""
    cp = float(_cp(plan, "megatron-906"))
    last = int(plan.world["nm"]) - 1
    scale_outputs(plan, cp, lambda n: n.op == "local_grad_accumulation" and n.mb == last,
                  "gradient accumulation of the last microbatch")


def _main_loss_grad_over_cp(plan: Plan) -> None:
    """Megatron-LM PR 3959: the microbatch count the loss scale divides by is
    inflated by cp, and the multi-token-prediction loss's scale was not
    compensated, so its gradient is divided by an extra cp. The generator
    has no multi-token prediction; the same mechanism is put on the main
    loss: the backward of its normalisation divides by N x cp."""
    _scale_loss_grad(plan, 1.0 / _cp(plan, "megatron-3959"))


SEQ_BUGS: dict[str, RealBug] = {b.key: b for b in (
    RealBug("megatron-1446", "Megatron-LM issue 1446",
            "TP + sequence parallelism: the final layernorm's weight gradient is not "
            "all-reduced across TP ranks",
            LLAMA, Parallelism(dp=2, tp=2, nm=2), Policy(sequence_parallel=True),
            _final_norm_grad_not_reduced, GBS),
    RealBug("deepspeed-5248", "DeepSpeed issue 5248",
            "Ulysses sequence parallelism: gradients scaled by the SP size",
            LLAMA, Parallelism(dp=2, cp=2, nm=2), Policy(ulysses=True), _grads_scaled_by_sp, GBS),
    RealBug("megatron-673", "Megatron-LM issue 673",
            "context parallelism with per-token loss: the x cp loss scale meets per-token "
            "normalization, gradients cp times too large",
            LLAMA, Parallelism(dp=2, cp=2, nm=2), Policy(), _cp_scale_meets_per_token, GBS),
    RealBug("megatron-906", "Megatron-LM issue 906",
            "loss multiplied by cp_size, gradient buffer divided by the data-parallel size only",
            LLAMA, Parallelism(dp=2, cp=2, nm=2), Policy(), _buffer_scaled_by_dp_only, GBS),
    RealBug("megatron-3959", "Megatron-LM PR 3959",
            "multi-token-prediction loss gradient divided by an extra cp_size (on the main loss)",
            LLAMA, Parallelism(cp=2, tp=2, nm=2), Policy(), _main_loss_grad_over_cp, GBS),
)}
