"""Logical graph + parallelism -> per-rank parallel plan with lineage views.

Two passes:

1. gen_model/spmd.py (:func:`shard`): the SPMD program per pipeline stage,
   every value in one layout per mesh axis, collectives and send/recv
   inserted where layouts or stages change (gen_model/program.py holds the
   program's types and the mesh axes).
2. gen_model/emit.py (:class:`Emitter`): that program on every rank for every
   microbatch in the order of the pipeline schedule, with gradient
   accumulation, the cross-replica reducer and the optimizer step, merged
   into one execution order (gen_model/order.py).

This module checks the settings and runs both passes. docs/parallelism.md
explains the rank layout and each strategy.
"""

from __future__ import annotations

from collections.abc import Callable

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.emit import Emitter
from gen_model.graph import LogicalGraph
from gen_model.order import merge, number_versions
from gen_model.program import EXPERT, Policy, Program
from gen_model.spmd import shard
from verdict.plan import Plan

__all__ = ["EXPERT", "Policy", "Program", "check_parallelism", "check_policy", "merge",
           "number_versions", "parallel_plan"]


def check_parallelism(cfg: ModelConfig, par: Parallelism, gbs: int) -> None:
    for flag in ("dp", "tp", "pp", "ep", "nm", "cp"):
        if getattr(par, flag) < 1:
            raise ConfigError(f"--{flag} must be at least 1")
    if gbs % (par.dp * par.nm):
        raise ConfigError(f"--gbs {gbs} does not split into dp {par.dp} x nm {par.nm} microbatches")
    if par.pp > cfg.layers:
        raise ConfigError(f"--pp {par.pp} is more than --layers {cfg.layers}")
    if par.dp % par.ep and (par.ep % par.tp or par.dp % (par.ep // par.tp)):
        raise ConfigError(f"--ep {par.ep} must divide --dp {par.dp}, or be --tp {par.tp} times "
                          f"a divisor of --dp")
    if par.ep > 1 and cfg.model != "moe":
        raise ConfigError("--ep needs the moe model")
    if par.ep > 1 and cfg.experts % par.ep:
        raise ConfigError(f"--experts {cfg.experts} is not divisible by --ep {par.ep}")
    if cfg.model != "mlp":
        for name in ("heads", "kv_heads", "ffn", "vocab"):
            if getattr(cfg, name) % par.tp:
                raise ConfigError(f"--{name} {getattr(cfg, name)} is not divisible by --tp {par.tp}")
    elif cfg.hidden % par.tp:
        raise ConfigError(f"--hidden {cfg.hidden} is not divisible by --tp {par.tp}")


def check_policy(cfg: ModelConfig, par: Parallelism, policy: Policy) -> None:
    sp = par.tp if policy.sequence_parallel else 1
    if policy.sequence_parallel and cfg.model != "llama3":
        raise ConfigError("--sequence_parallel needs the llama3 model")
    if par.cp > 1 and cfg.model != "llama3":
        raise ConfigError("--cp needs the llama3 model")
    v = policy.virtual_stages
    if v < 1:
        raise ConfigError("--vpp must be at least 1")
    if v > 1 and (par.pp < 2 or par.nm % par.pp or cfg.layers < par.pp * v):
        raise ConfigError(f"--vpp {v} needs --pp > 1, --nm divisible by --pp {par.pp} and "
                          f"--layers at least pp x vpp = {par.pp * v}")
    if policy.ulysses and (par.cp < 2 or par.tp > 1 or cfg.heads % par.cp):
        raise ConfigError(f"--ulysses needs --cp > 1, --tp 1 and --heads {cfg.heads} "
                          f"divisible by --cp {par.cp}")
    if policy.cp_balance and (par.cp < 2 or policy.ulysses):
        raise ConfigError("--cp_balance needs --cp > 1 and no --ulysses")
    chunks = par.cp * (2 if policy.cp_balance else 1)
    if cfg.seqlen % (chunks * sp):
        raise ConfigError(f"--seqlen {cfg.seqlen} is not divisible by {chunks * sp} "
                          f"(sequence chunks {chunks} x sequence parallel {sp})")
    if cfg.model == "moe" and not par.experts_over_tp and cfg.moe_ffn % par.tp:
        raise ConfigError(f"--moe_ffn {cfg.moe_ffn} is not divisible by --tp {par.tp}")
    if policy.zero and (par.cp > 1 or v > 1):
        raise ConfigError("--zero with --cp or --vpp is not supported yet")


def parallel_plan(g: LogicalGraph, cfg: ModelConfig, par: Parallelism, gbs: int,
                  world: dict, policy: Policy | None = None,
                  edit: Callable[[Program], Program] | None = None) -> Plan:
    """The plan of ``par``. ``edit`` changes the sharded program before it is
    expanded per rank and microbatch (scripts/mutate_fold.py makes every
    replica and microbatch wrong alike that way)."""
    policy = policy or Policy()
    check_parallelism(cfg, par, gbs)
    check_policy(cfg, par, policy)
    prog = shard(g, cfg, par, policy)
    if edit is not None:
        prog = edit(prog)
    return Emitter(g, prog, par, policy, world).run()


