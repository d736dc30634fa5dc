"""Uniform mutations of folded plans, judged at the real size.

    .venv/bin/python scripts/mutate_fold.py [--per-operator N] [--seed S]
        [--bases NAME,...] [--csv FILE]

A parallelizer that is wrong is usually wrong the same way on every replica
and microbatch, and such a plan passes the fold's uniformity check: only the
stage proofs at the shown size stand between it and a SUCCESS. This harness
makes such plans and judges them where the fold argument cannot help: at the
real size. Each operator changes the sharded program (one program per
pipeline stage, `gen_model.parallelize.shard`, before it is expanded per rank
and microbatch); the changed program is emitted twice, folded (2 replicas and
2 microbatches, the real constants) and at the real sizes with every rank.
The folded plan is verified; the real plan is judged by the oracle
(`harness.oracle.judge`, float64, no claim trusted) against the real
single-device plan, and verified too, for comparison.

A SUCCESS on the folded plan of a program whose real-size plan the oracle
finds wrong is a wrong SUCCESS: exit 1. A FAIL on the folded plan where the
real plan is right and verifies is a false alarm of the fold: exit 1 too.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutate import FOLD_BASES, FOLD_GBS, run_one  # noqa: E402

from gen_model.config import ConfigError, Parallelism  # noqa: E402
from gen_model.generate import logical_graph, make_plan  # noqa: E402
from gen_model.parallelize import Program  # noqa: E402
from harness.mutations import CONSTANTS  # noqa: E402
from harness.oracle import judge  # noqa: E402
from verdict.plan import Plan  # noqa: E402

#: Collectives of the sharded program an operator may drop or move.
COLLECTIVES = ("all_reduce", "all_reduce_max", "all_gather", "reduce_scatter", "all_to_all")
#: Axes a collective may be moved to, in a fixed order (both emissions pick alike).
GROUP_AXES = ("edp", "cp", "tp")


def _signature(prog: Program) -> list[tuple]:
    return [(s.kind, s.op, s.dir, s.name, s.stage, s.axis) for s in prog.ops]


def _substitute(prog: Program, old, new) -> None:
    """Every later read of ``old`` reads ``new`` (the op that made it is gone)."""
    for sop in prog.ops:
        sop.inputs = [new if sv == old else sv for sv in sop.inputs]
    prog.params = {tid: (stage, new if grad == old else grad)
                   for tid, (stage, grad) in prog.params.items()}
    if prog.loss == old:
        prog.loss = new


def scale_constant(prog: Program, rng: random.Random) -> str | None:
    """One constant of one op (a normalizer, a scale, eps) changed, alike on
    every rank that runs the op."""
    sites = [(i, k) for i, s in enumerate(prog.ops) if s.kind == "op" for k in CONSTANTS
             if isinstance(s.kwargs.get(k), (int, float)) and not isinstance(s.kwargs.get(k), bool)]
    if not sites:
        return None
    i, k = rng.choice(sites)
    old = prog.ops[i].kwargs[k]
    prog.ops[i].kwargs = {**prog.ops[i].kwargs, k: old * 2 if old else 1.0}
    return f"{prog.ops[i].op} {prog.ops[i].name}: {k} {old} -> {prog.ops[i].kwargs[k]}"


def drop_collective(prog: Program, rng: random.Random) -> str | None:
    """One collective left out: its readers read its input."""
    sites = [i for i, s in enumerate(prog.ops) if s.kind == "conv" and s.op in COLLECTIVES
             and len(s.inputs) == 1 and len(s.outputs) == 1]
    if not sites:
        return None
    i = rng.choice(sites)
    sop = prog.ops.pop(i)
    _substitute(prog, sop.outputs[0], sop.inputs[0])
    return f"{sop.op} ({sop.dir}) of {sop.name} on {sop.axis} dropped"


def other_axis(prog: Program, rng: random.Random, sizes: dict[str, int]) -> str | None:
    """One collective run over another mesh axis (the wrong process group)."""
    sites = [(i, a) for i, s in enumerate(prog.ops) if s.kind == "conv" and s.op in COLLECTIVES
             for a in GROUP_AXES if a != s.axis and sizes.get(a, 1) > 1]
    if not sites:
        return None
    i, axis = rng.choice(sites)
    old = prog.ops[i].axis
    prog.ops[i].axis = axis
    return f"{prog.ops[i].op} ({prog.ops[i].dir}) of {prog.ops[i].name} on {axis}, not {old}"


def swap_inputs(prog: Program, rng: random.Random, shapes: Callable[[int], tuple]) -> str | None:
    """Two operands of one op swapped where their shapes and layouts allow it."""
    sites = []
    for i, s in enumerate(prog.ops):
        ins = [(j, sv) for j, sv in enumerate(s.inputs) if sv is not None]
        for (a, x), (b, y) in zip(ins, ins[1:]):
            if s.kind == "op" and x != y and x.layout == y.layout and shapes(x.tid) == shapes(y.tid):
                sites.append((i, a, b))
    if not sites:
        return None
    i, a, b = rng.choice(sites)
    s = prog.ops[i]
    s.inputs[a], s.inputs[b] = s.inputs[b], s.inputs[a]
    return f"{s.op} ({s.dir}) {s.name}: inputs {a} and {b} swapped"


@dataclass
class Row:
    base: str
    operator: str
    target: str
    oracle: str  # right | wrong | invalid
    folded: str  # the folded plan's verdict
    real: str  # the real plan's verdict
    seconds: float

    @property
    def outcome(self) -> str:
        if self.oracle == "invalid":
            return "invalid program"
        if self.folded.startswith("NO VERDICT"):
            return "NO VERDICT"
        ok = self.folded == "SUCCESS"
        if self.oracle == "wrong":
            # the real plan is materialized: verified by its checked symmetry
            # (docs/soundness.md "Materialized plans"), judged here too
            return "WRONG SUCCESS" if ok or self.real == "SUCCESS" else "caught"
        if not ok and self.real == "SUCCESS":
            return "FOLD FALSE ALARM"
        return "equivalent, proved" if ok else "equivalent, failed"


class _Edit:
    """One operator applied alike to the shown and the real program: the
    same target, checked by the programs' signatures."""

    def __init__(self, name: str, rng_seed: str, sizes: dict[str, int], shapes):
        self.name, self.seed, self.sizes, self.shapes = name, rng_seed, sizes, shapes
        self.seen: list[tuple[list[tuple], str | None]] = []

    def __call__(self, prog: Program) -> Program:
        prog = copy.deepcopy(prog)
        before = _signature(prog)
        rng = random.Random(self.seed)
        if self.name == "scale_constant":
            target = scale_constant(prog, rng)
        elif self.name == "drop_collective":
            target = drop_collective(prog, rng)
        elif self.name == "other_axis":
            target = other_axis(prog, rng, self.sizes)
        else:
            target = swap_inputs(prog, rng, self.shapes)
        self.seen.append((before, target))
        return prog


OPERATORS = ("scale_constant", "drop_collective", "other_axis", "swap_inputs")


def _emit(cfg, par, policy, fold: bool, edit: _Edit) -> Plan | None:
    try:
        return make_plan(cfg, par, FOLD_GBS, policy=policy, fold=fold, edit=edit)
    except (ConfigError, AssertionError, ValueError, KeyError, IndexError):
        return None


def mutate_base(base: str, per_operator: int, seed: int) -> list[Row]:
    cfg, par, policy = FOLD_BASES[base]
    single = make_plan(cfg, Parallelism(), FOLD_GBS)
    sizes = {"edp": par.dp // par.ep, "cp": par.cp, "tp": par.tp}
    shapes = _shapes_of(cfg)
    rows = []
    for name in OPERATORS:
        for k in range(per_operator):
            start = time.perf_counter()
            edit = _Edit(name, f"{seed}/{base}/{name}/{k}", sizes, shapes)
            real = _emit(cfg, par, policy, False, edit)
            folded = _emit(cfg, par, policy, True, edit)
            if not edit.seen or edit.seen[0][1] is None:
                break
            target = edit.seen[0][1]
            if len(edit.seen) == 2 and (edit.seen[0][0] != edit.seen[1][0]
                                        or edit.seen[0][1] != edit.seen[1][1]):
                raise SystemExit(f"{base}: the shown and the real program differ; "
                                 "the harness cannot apply one edit to both")
            if real is None or folded is None:
                rows.append(Row(base, name, target, "invalid", "-", "-",
                                time.perf_counter() - start))
                continue
            right = "right" if judge(single, real).right else "wrong"
            memo: dict = {}
            rows.append(Row(base, name, target, right, run_one(single, folded, memo),
                            run_one(single, real, memo), time.perf_counter() - start))
            if rows[-1].outcome in ("WRONG SUCCESS", "FOLD FALSE ALARM", "NO VERDICT"):
                print(f"  !! {rows[-1].outcome}: {base} {name}: {target} "
                      f"(folded {rows[-1].folded}, real {rows[-1].real})", flush=True)
    return rows


def _shapes_of(cfg) -> Callable[[int], tuple]:
    """Logical shapes of the real graph. The shown graph differs only in the
    batch size; an operand swap whose shapes agree only at one size makes
    an invalid plan at the other, counted as such."""
    graph = logical_graph(cfg, FOLD_GBS)
    return lambda tid: tuple(graph.shape(tid))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-operator", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bases", default=",".join(FOLD_BASES), help=f"from {', '.join(FOLD_BASES)}")
    args = ap.parse_args(argv)
    bases = [b for b in args.bases.split(",") if b]
    unknown = [b for b in bases if b not in FOLD_BASES]
    if unknown:
        print(f"unknown base {unknown[0]}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = [row for base in bases for row in mutate_base(base, args.per_operator, args.seed)]
    counts = Counter((r.operator, r.outcome) for r in rows)
    outcomes = sorted({r.outcome for r in rows})
    print(f"{'operator':<18}" + "".join(f"{o:>20}" for o in outcomes))
    for name in OPERATORS:
        print(f"{name:<18}" + "".join(f"{counts[(name, o)]:>20}" for o in outcomes))
    bad = [r for r in rows if r.outcome in ("WRONG SUCCESS", "FOLD FALSE ALARM", "NO VERDICT")]
    wrong = sum(r.outcome == "WRONG SUCCESS" for r in rows)
    alarms = sum(r.outcome == "FOLD FALSE ALARM" for r in rows)
    print(f"{len(rows)} uniform mutants on {len(bases)} folded bases in "
          f"{time.perf_counter() - start:.0f} s: {wrong} wrong SUCCESS, {alarms} fold false "
          f"alarms, {len(bad) - wrong - alarms} without a verdict")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
