"""Sequence-dimension bugs that shipped in public frameworks, injected into
plans that otherwise verify.

    SEQ_BUGS[key] -> RealBug(key, source, mechanism, cfg, par, policy, inject, gbs)

``inject(plan)`` edits a copy of the clean plan in place so that it does
what the framework did: node names, views and kwargs are those a
parallelizer writes, nothing names the bug. Entries are records of the
real-bug registry (gen_model/real_bugs.py, docs/real-bugs.md);
scripts/real_bugs.py runs both.
"""

from __future__ import annotations

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.mutations import drop_orphans
from gen_model.parallelize import Policy, number_versions
from gen_model.real_bugs import RealBug
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


SEQ_BUGS: dict[str, RealBug] = {b.key: b for b in (
    RealBug("megatron-1446", "Megatron-LM issue 1446",
            "TP + sequence parallelism: the final layernorm's weight gradient is not "
            "all-reduced across TP ranks",
            LLAMA, Parallelism(dp=2, tp=2, nm=2), Policy(sequence_parallel=True),
            _final_norm_grad_not_reduced, GBS),
    RealBug("deepspeed-5248", "DeepSpeed issue 5248",
            "Ulysses sequence parallelism: gradients scaled by the SP size",
            LLAMA, Parallelism(dp=2, cp=2, nm=2), Policy(ulysses=True), _grads_scaled_by_sp, GBS),
)}
