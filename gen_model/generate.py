"""From settings to plans: trace the model, derive its training step, emit plans."""

from __future__ import annotations

from gen_model.autodiff import derive_training_step
from gen_model.bugs import inject
from gen_model.config import ModelConfig, Parallelism, world_spec
from gen_model.graph import LogicalGraph
from gen_model.models import ZOO, build
from gen_model.parallelize import Policy, parallel_plan
from gen_model.single import single_plan
from gen_model.trace import trace_forward
from verdict.plan import Plan


def logical_graph(cfg: ModelConfig, gbs: int) -> LogicalGraph:
    """The single-device training step of a model (forward, backward, step)."""
    model = build(cfg, device="meta")
    graph = trace_forward(model, ZOO[cfg.model].inputs(cfg, gbs))
    return derive_training_step(graph, cfg.optimizer)


def make_plan(cfg: ModelConfig, par: Parallelism, gbs: int, variant: str = "default",
              policy: Policy | None = None) -> Plan:
    graph = logical_graph(cfg, gbs)
    world = world_spec(cfg, par, gbs, variant)
    if par.is_single():
        return single_plan(graph, world)
    policy = policy or Policy()
    world.update(vocab_parallel=policy.vocab_parallel, schedule=policy.schedule)
    if policy.sequence_parallel:
        world["sequence_parallel"] = True
    if policy.ulysses:
        world["ulysses"] = True
    if policy.cp_balance:
        world["cp_balance"] = True
    if policy.virtual_stages > 1:
        world["virtual_stages"] = policy.virtual_stages
    if policy.zero:
        world.update(zero=policy.zero)
    plan = parallel_plan(graph, cfg, par, gbs, world, policy)
    return inject(plan, int(variant[2:])) if variant.startswith("br") else plan  # docs/bugs.md
