"""From settings to plans: trace the model, derive its training step, emit plans."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from backends.columnar import validate_columns
from backends.planfile import PlanError
from gen_model.autodiff import derive_training_step
from gen_model.config import ConfigError, ModelConfig, Parallelism, world_spec
from gen_model.graph import LogicalGraph
from gen_model.microbatches import SIZES as MICROBATCH_SIZES
from gen_model.microbatches import expand_microbatches, microbatches_replicable
from gen_model.models import ZOO, build
from gen_model.parallelize import Policy, Program, check_parallelism, check_policy, parallel_plan
from gen_model.replicate import (
    NotReplicable,
    replicable,
    replicas,
    replicate,
    second_size,
    small_policy,
    small_sizes,
)
from gen_model.single import single_plan
from gen_model.spill import keep
from gen_model.trace import trace_forward
from verdict.columns import Columns
from verdict.plan import Plan

#: How many replicas and microbatches a folded plan shows (docs/soundness.md).
FOLD_SHOWN = 2


def logical_graph(cfg: ModelConfig, gbs: int, loss_rows: int | None = None) -> LogicalGraph:
    """The single-device training step of a model (forward, backward, step).
    ``loss_rows``: the batch size the loss normalizes by, when it is not
    ``gbs`` (a folded plan: traced at the shown rows, the real constants)."""
    model = build(cfg, device="meta")
    for module in model.modules():
        if hasattr(module, "loss_rows"):
            module.loss_rows = loss_rows
    graph = trace_forward(model, ZOO[cfg.model].inputs(cfg, gbs))
    return derive_training_step(graph, cfg.optimizer)


def fold_sizes(par: Parallelism, gbs: int, policy: Policy) -> tuple[Parallelism, int]:
    """The shown parallelism and batch of a folded plan: min(dp, 2) replicas
    and min(nm, 2) microbatches of the real rows each. Refused where
    replicas do not run one program (docs/soundness.md, "Folded plans")."""
    if par.dp * par.nm == 1:
        raise ConfigError("--fold needs --dp or --nm above 1 (nothing to fold)")
    if par.ep > 1:
        raise ConfigError("--fold with --ep is not supported: the expert-parallel index is part "
                          "of the data-parallel index")
    if policy.virtual_stages > 1:
        raise ConfigError("--fold with --vpp is not supported: the interleaved schedule needs "
                          "a multiple of pp microbatches")
    if policy.zero:
        raise ConfigError("--fold with --zero is refused: each replica owns another shard, so "
                          "replicas do not run one program")
    if gbs % (par.dp * par.nm):
        raise ConfigError(f"--gbs {gbs} does not split into dp {par.dp} x nm {par.nm} microbatches")
    shown = replace(par, dp=min(par.dp, FOLD_SHOWN), nm=min(par.nm, FOLD_SHOWN))
    return shown, gbs // (par.dp * par.nm) * shown.dp * shown.nm


def make_plan(cfg: ModelConfig, par: Parallelism, gbs: int, variant: str = "default",
              policy: Policy | None = None, fold: bool = False,
              edit: Callable[[Program], Program] | None = None) -> Plan:
    """The plan of ``par``; with ``fold``, the folded plan that stands for it
    (shown sizes, real constants, world keys ``fold_dp``, ``fold_nm``,
    ``fold_gbs``)."""
    if fold:
        shown, shown_gbs = fold_sizes(par, gbs, policy or Policy())
        plan = make_plan_at(cfg, shown, shown_gbs, variant, policy, loss_rows=gbs, edit=edit)
        plan.world.update(fold_dp=par.dp, fold_nm=par.nm, fold_gbs=gbs)
        return plan
    return make_plan_at(cfg, par, gbs, variant, policy, edit=edit)


def make_columns(cfg: ModelConfig, par: Parallelism, gbs: int, variant: str = "default",
                 policy: Policy | None = None, fold: bool = False,
                 edit: Callable[[Program], Program] | None = None,
                 spill: Callable[[np.ndarray], np.ndarray] = keep) -> Columns:
    """The plan of :func:`make_plan` as columns. A materialized plan of more
    than 3 replicas or more than 5 microbatches is expanded from small plans
    by array arithmetic (gen_model/replicate.py over replicas,
    gen_model/microbatches.py over microbatches), not built node by node;
    plans those paths do not express (bug variants, interleaved stages over
    microbatches, ZeRO over replicas at a D without a small divisor, or any
    the expansions' checks refuse) are built by the row generator. ``spill``
    takes each column of the replica expansion as it is made
    (gen_model/spill.py: to disk). The columns returned are validated
    (:func:`backends.columnar.validate_columns`; PlanError if not), once:
    the expansion needs the verdict to fall back to rows, and a writer told
    so need not validate them again."""
    policy = policy or Policy()
    if not fold and (replicable(par, policy, variant) or
                     microbatches_replicable(par, policy, variant)):
        check_parallelism(cfg, par, gbs)
        check_policy(cfg, par, policy)
        try:
            return expanded_columns(cfg, par, gbs, variant, policy, edit, spill)
        except NotReplicable as e:  # correct but slow: say why
            logging.getLogger("gen_model").warning("the array path refused this plan (%s); "
                                                   "generating it row by row", e)
    cols = Columns.from_plan(make_plan(cfg, par, gbs, variant, policy, fold, edit))
    validate_columns(cols)
    return cols


def expanded_columns(cfg: ModelConfig, par: Parallelism, gbs: int, variant: str,
                     policy: Policy, edit: Callable[[Program], Program] | None,
                     spill: Callable[[np.ndarray], np.ndarray] = keep) -> Columns:
    """The columns of ``par`` expanded from small plans: over microbatches
    (from 3, 4 and 5) when there are more than 5 and the policy allows it,
    then over replicas (from dp 2 and dp S, :func:`second_size`) when there
    are more than 3. The result is validated (an execution order, reads
    after writes); a plan that fails raises NotReplicable."""
    over_nm = microbatches_replicable(par, policy, variant)
    if replicable(par, policy, variant):
        policy = small_policy(par, policy)

    def at_dp(count: int) -> Columns:
        par_d, gbs_d = small_sizes(par, gbs, count)
        if not over_nm:
            return Columns.from_plan(make_plan_at(cfg, par_d, gbs_d, variant, policy,
                                                 loss_rows=gbs, edit=edit))
        smalls = [Columns.from_plan(make_plan_at(cfg, replace(par_d, nm=n), gbs_d // par.nm * n,
                                                 variant, policy, loss_rows=gbs, edit=edit))
                  for n in MICROBATCH_SIZES]
        return expand_microbatches(smalls, par.nm,
                                   plan_world(cfg, par_d, gbs_d, variant, policy))

    world = plan_world(cfg, par, gbs, variant, policy)
    cols = (replicate(at_dp(2), at_dp(second_size(par, policy)), par, world, spill)
            if replicable(par, policy, variant) else at_dp(replicas(par)))
    try:
        validate_columns(cols)
    except PlanError as e:
        raise NotReplicable(f"the expanded plan is invalid: {e.problem}") from None
    return cols


def plan_world(cfg: ModelConfig, par: Parallelism, gbs: int, variant: str,
               policy: Policy | None) -> dict:
    """The world spec of a plan, with the parallelizer's choices when parallel."""
    world = world_spec(cfg, par, gbs, variant)
    if par.is_single():
        return world
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
    return world


def make_plan_at(cfg: ModelConfig, par: Parallelism, gbs: int, variant: str,
                 policy: Policy | None, loss_rows: int | None = None,
                 edit: Callable[[Program], Program] | None = None) -> Plan:
    graph = logical_graph(cfg, gbs, loss_rows)
    world = plan_world(cfg, par, gbs, variant, policy)
    if par.is_single():
        return single_plan(graph, world)
    return parallel_plan(graph, cfg, par, gbs, world, policy or Policy(), edit)
