"""Mutation testing of the verifier: wrong plans must FAIL, rewrites must pass.

    .venv/bin/python scripts/mutate.py [--per-operator N] [--seed S] [--quick]
        [--bases NAME,...] [--operators NAME,...] [--csv FILE]

Each base plan (small mlp, llama3 and moe plans, ring attention layers) is
mutated by every operator of harness/mutations.py (context-parallel plans
by its CP operators too), N times with different targets. Each
mutant is judged by the oracle (harness/oracle.py: run in float64, compare
what every rank ends with; no claim of a computed tensor is trusted) and by
the verifier (in process, with one memo shared by all mutants: a memo entry
is a proved canonical problem, so sharing it is sound). The table counts,
per operator, each (oracle, verifier) outcome.

Exit 1 when the verifier says SUCCESS on a mutant the oracle finds wrong, or
FAIL on a semantics-preserving rewrite, or ends a run without a verdict
(an internal error); exit 0 otherwise. Mutants the oracle finds right (the
mutation happened to change nothing, e.g. a peer that holds the same
replica) may FAIL: the verifier also checks the plan's claims, which the
oracle ignores; they are counted apart. ``--quick`` is the seeded subset
(``--quick --bases`` part of it: ``make test`` runs six of its seven
bases). docs/mutation.md describes the operators.

The harness also checks that it still sees (harness/blindness.py): the
canaries of harness/canaries.py (wrong plans every unfolded base yields)
must be judged wrong by the oracle and fail the verifier; equivalent
outcomes stay under a ceiling; and the ``--quick`` run catches at least
the floors of harness/quick_floors.json (``--write-floors`` records a
clean ``--quick`` run's counts there). Any of these exits 1.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.planfile import PlanError, validate  # noqa: E402
from gen_model.config import ModelConfig, Parallelism  # noqa: E402
from gen_model.generate import fold_sizes, make_plan, make_plan_at  # noqa: E402
from gen_model.parallelize import Policy  # noqa: E402
from gen_model.ring import Ring, ring_pair  # noqa: E402
from harness.blindness import blind_spots, write_floors  # noqa: E402
from harness.canaries import CANARIES  # noqa: E402
from harness.mutations import (  # noqa: E402
    CP_MUTATIONS,
    CP_REWRITES,
    FOLD_MUTATIONS,
    FOLD_REWRITES,
    MATERIALIZED_MUTATIONS,
    MUTATIONS,
    REWRITES,
)
from harness.oracle import judge, judge_folded  # noqa: E402
from main import verify  # noqa: E402
from verdict.columns import Columns  # noqa: E402
from verdict.plan import Plan, pair_problem  # noqa: E402
from verdict.report import append_rows  # noqa: E402
from verdict.symmetry.fold import FoldError, fold_pair  # noqa: E402

MLP = ModelConfig("mlp", layers=2, hidden=8)
LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=4)
MOE = ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12, seqlen=4,
                  experts=4, topk=2, moe_ffn=8, first_dense=1)
GBS = 8

#: name -> (model, parallelism, policy)
BASES: dict[str, tuple[ModelConfig, Parallelism, Policy]] = {
    "mlp_dp2_pp2_tp2_nm2": (MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), Policy()),
    "llama3_dp2_pp2_tp2_nm2": (LLAMA, Parallelism(dp=2, tp=2, pp=2, nm=2), Policy()),
    "llama3_tp2_vocab": (LLAMA, Parallelism(tp=2, nm=2), Policy(vocab_parallel=True)),
    "moe_dp2_ep2_tp2_nm2": (MOE, Parallelism(dp=2, tp=2, ep=2, nm=2), Policy()),
    "llama3_sp_dp2_tp2_nm2": (LLAMA, Parallelism(dp=2, tp=2, nm=2),
                              Policy(sequence_parallel=True)),
    "llama3_cp2_tp2_nm2": (LLAMA, Parallelism(cp=2, tp=2, nm=2), Policy()),
    "llama3_cpbal2_tp2_nm2": (LLAMA, Parallelism(cp=2, tp=2, nm=2), Policy(cp_balance=True)),
    "llama3_ulysses2_dp2_nm2": (LLAMA, Parallelism(cp=2, dp=2, nm=2), Policy(ulysses=True)),
    "mlp_pp2_vpp2_nm2": (ModelConfig("mlp", layers=4, hidden=8), Parallelism(pp=2, nm=2),
                         Policy(virtual_stages=2)),
    "mlp_zero1_dp2_pp2_tp2_nm2": (MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), Policy(zero=1)),
    "mlp_zero2_dp2_nm2": (MLP, Parallelism(dp=2, nm=2), Policy(zero=2)),
    "llama3_zero3_dp2_pp2_tp2_nm2": (LLAMA, Parallelism(dp=2, tp=2, pp=2, nm=2),
                                     Policy(zero=3)),
    "moe_zero3_dp4_ep2_nm2": (MOE, Parallelism(dp=4, ep=2, nm=2), Policy(zero=3)),
    "llama3_adamw_zero1_dp2_tp2_nm2": (replace(LLAMA, optimizer="adamw"),
                                       Parallelism(dp=2, tp=2, nm=2), Policy(zero=1)),
    "mlp_sgd_dp2_tp2_nm2": (replace(MLP, optimizer="sgd"), Parallelism(dp=2, tp=2, nm=2),
                            Policy()),
    "mlp_adam_zero2_dp2_nm2": (replace(MLP, optimizer="adam"), Parallelism(dp=2, nm=2),
                               Policy(zero=2)),
    "llama3_sp_cp2_tp2_nm2": (LLAMA, Parallelism(cp=2, tp=2, nm=2),
                              Policy(sequence_parallel=True)),
}
#: Folded bases (docs/soundness.md, "Folded plans"): 2 of 4 replicas and 2 of
#: 4 microbatches shown, 2 rows per block; name -> (model, real parallelism,
#: policy). Their mutants are judged by harness.oracle.judge_folded.
FOLD_GBS = 32
FOLD_BASES: dict[str, tuple[ModelConfig, Parallelism, Policy]] = {
    "mlp_fold_dp4_pp2_tp2_nm4": (MLP, Parallelism(dp=4, tp=2, pp=2, nm=4), Policy()),
    "llama3_fold_dp4_pp2_tp2_nm4": (LLAMA, Parallelism(dp=4, tp=2, pp=2, nm=4), Policy()),
    "llama3_fold_cp2_dp4_nm4": (LLAMA, Parallelism(cp=2, dp=4, nm=4), Policy()),
    "moe_fold_dp4_tp2_nm4": (MOE, Parallelism(dp=4, tp=2, nm=4), Policy()),
}
#: Materialized bases (docs/soundness.md, "Materialized plans"): every rank
#: and microbatch written out, more than two of each, FOLD_GBS rows; proved
#: by their representatives when their blocks are uniform, else in full.
#: Their mutants are judged by harness.oracle.judge at that (real) size, and
#: take the materialized operators too (one replica's rows, the last
#: microbatch, a group wrong past replica 1); a rewrite on one rank makes
#: the blocks differ and must still verify (in full).
MATERIALIZED_BASES: dict[str, tuple[ModelConfig, Parallelism, Policy]] = {
    "mlp_mat_dp4_pp2_tp2_nm4": (MLP, Parallelism(dp=4, tp=2, pp=2, nm=4), Policy()),
    "llama3_mat_cp2_dp4_nm4": (LLAMA, Parallelism(cp=2, dp=4, nm=4), Policy()),
    "mlp_mat_pp2_vpp2_dp4_nm4": (ModelConfig("mlp", layers=4, hidden=8),
                                 Parallelism(dp=4, pp=2, nm=4), Policy(virtual_stages=2)),
    "mlp_mat_zero1_dp4_nm4": (MLP, Parallelism(dp=4, nm=4), Policy(zero=1)),
    "mlp_mat_zero1_dp4_pp2_tp2_nm4": (MLP, Parallelism(dp=4, tp=2, pp=2, nm=4),
                                      Policy(zero=1)),
    "mlp_adam_mat_zero1_dp4_nm4": (replace(MLP, optimizer="adam"), Parallelism(dp=4, nm=4),
                                   Policy(zero=1)),
    "mlp_mat_zero3_dp4_nm4": (MLP, Parallelism(dp=4, nm=4), Policy(zero=3)),
    "mlp_mat_zero2_dp4_nm4": (MLP, Parallelism(dp=4, nm=4), Policy(zero=2)),
    "mlp_adam_mat_zero3_dp4_pp2_nm4": (replace(MLP, optimizer="adam"),
                                       Parallelism(dp=4, pp=2, nm=4), Policy(zero=3)),
    "moe_mat_dp4_ep2_nm4": (MOE, Parallelism(dp=4, ep=2, nm=4), Policy()),
    "moe_mat_dp8_ep2_nm2": (MOE, Parallelism(dp=8, ep=2, nm=2), Policy()),
    "moe_mat_zero1_dp8_ep2_nm2": (MOE, Parallelism(dp=8, ep=2, nm=2), Policy(zero=1)),
    "moe_mat_zero2_dp8_ep2_nm2": (MOE, Parallelism(dp=8, ep=2, nm=2), Policy(zero=2)),
    "moe_mat_zero3_dp8_ep2_nm2": (MOE, Parallelism(dp=8, ep=2, nm=2), Policy(zero=3)),
}
#: Ring attention bases (gen_model/ring.py): one causal attention layer whose
#: ring merges key blocks by their log-sum-exps, cp 2 and 4, contiguous and
#: head-tail load-balanced chunks. The single-device step also computes its
#: masked scores' row maximum (``scores``), which the mutants that take a
#: block's shift off claim. They take the context-parallel operators too.
RING_BASES: dict[str, Ring] = {
    "ring_cp2": Ring(cp=2, scores=True),
    "ring_cpbal2": Ring(cp=2, balanced=True, scores=True),
    "ring_cp4": Ring(cp=4, scores=True),
    "ring_cpbal4": Ring(cp=4, balanced=True, scores=True),
}
#: The seeded subset of ``--quick``: pipeline, tensor and data parallelism,
#: Megatron sequence parallelism with context parallelism, ZeRO-1 and ZeRO-2,
#: both optimizers, a folded plan and a load-balanced ring (the mlp bases
#: and the ring cost seconds, the llama3 one most: two thirds of the run;
#: the test suite runs all bases but that one).
QUICK_BASES = ("mlp_dp2_pp2_tp2_nm2", "llama3_sp_cp2_tp2_nm2", "mlp_zero1_dp2_pp2_tp2_nm2",
               "mlp_sgd_dp2_tp2_nm2", "mlp_adam_zero2_dp2_nm2", "mlp_fold_dp4_pp2_tp2_nm4",
               "ring_cpbal2")


@dataclass
class Row:
    base: str
    kind: str  # mutation | rewrite | canary
    operator: str
    target: str
    oracle: str  # right | wrong
    verifier: str  # SUCCESS | FAIL:<kind> | INVALID | NO VERDICT:<why>
    seconds: float

    @property
    def outcome(self) -> str:
        ok = self.verifier == "SUCCESS"
        if self.verifier == "INVALID":
            return "invalid plan"
        if self.verifier.startswith("NO VERDICT"):
            return "NO VERDICT"
        if self.kind == "canary":
            return "BLIND ORACLE" if self.oracle == "right" else (
                "WRONG SUCCESS" if ok else "caught")
        if self.kind == "rewrite":
            return "proved" if ok and self.oracle == "right" else "FALSE ALARM"
        if self.oracle == "wrong":
            return "WRONG SUCCESS" if ok else "caught"
        return "equivalent, proved" if ok else "equivalent, failed"


def run_one(single: Plan, mutant: Plan, memo: dict, columns: bool = False) -> str:
    """The verifier's outcome on a mutant, as main.py would reach it. With
    ``columns`` (materialized bases) the mutant is verified as a Plan and as
    its columns (what a .npz file loads): a SUCCESS needs both, a FAIL of
    either is the outcome, and a crash of either is no verdict."""
    try:
        validate(mutant.to_data())
    except PlanError:
        return "INVALID"
    try:
        single, _ = fold_pair(single, mutant)
    except FoldError:
        return "FAIL:refused"  # main.py: exit 2, one line
    if pair_problem(single, mutant):
        return "FAIL:refused"  # main.py: exit 2, one line
    forms: list[Plan | Columns] = [mutant]
    if columns:
        forms.append(Columns.from_plan(mutant))
    outcomes = []
    for form in forms:
        try:
            v = verify(single, form, memo=memo)
        except Exception as e:  # a crash is reported, never counted as a verdict
            return f"NO VERDICT:{type(e).__name__}: {e}"
        if v.kind == "internal":
            return f"NO VERDICT:{v.message}"
        outcomes.append("SUCCESS" if v.success else f"FAIL:{v.kind}")
    return next((o for o in outcomes if o != "SUCCESS"), "SUCCESS")


def mutate_base(single: Plan, plan: Plan, base: str, per_operator: int, seed: int,
                progress: bool = True, only: set[str] | None = None,
                single_shown: Plan | None = None, materialized: bool = False) -> list[Row]:
    """Every operator (or those in ``only``) on one base plan, which must
    verify and be right by the oracle. A folded base comes with
    ``single_shown`` (the generator's single-device plan at the shown rows)
    and takes the fold operators; of the rewrites only those that keep every
    block's program."""
    memo: dict = {}

    def oracle(mutant: Plan):
        if single_shown is None:
            return judge(single, mutant)
        return judge_folded(single, single_shown, mutant)

    if run_one(single, plan, memo, materialized) != "SUCCESS" or not oracle(plan).right:
        raise SystemExit(f"base plan {base} does not verify: the harness needs a good base")
    rows = [] if single_shown is not None else run_canaries(single, plan, base, memo, oracle,
                                                            materialized)
    operators = [("mutation", n, f) for n, f in MUTATIONS.items()]
    operators += [("rewrite", n, f) for n, f in REWRITES.items()
                  if single_shown is None or n in FOLD_REWRITES]
    if int(plan.world.get("cp", 1)) > 1:
        operators += [("mutation", n, f) for n, f in CP_MUTATIONS.items()]
        if single_shown is None:
            operators += [("rewrite", n, f) for n, f in CP_REWRITES.items()]
    if single_shown is not None:
        operators += [("mutation", n, f) for n, f in FOLD_MUTATIONS.items()]
    if materialized:
        operators += [("mutation", n, f) for n, f in MATERIALIZED_MUTATIONS.items()]
    operators = [op for op in operators if only is None or op[1] in only]
    for kind, name, operator in operators:
        for k in range(per_operator):
            made = operator(plan, random.Random(f"{seed}/{base}/{name}/{k}"))
            if made is None:
                break
            mutant, target = made
            start = time.perf_counter()
            right = "right" if oracle(mutant).right else "wrong"
            verdict = run_one(single, mutant, memo, materialized)
            row = Row(base, kind, name, target, right, verdict, time.perf_counter() - start)
            rows.append(row)
            if progress and row.outcome in ("WRONG SUCCESS", "FALSE ALARM", "NO VERDICT"):
                print(f"  !! {row.outcome}: {base} {name}: {target} ({verdict})", flush=True)
    return rows


def run_canaries(single: Plan, plan: Plan, base: str, memo: dict, oracle,
                 materialized: bool = False) -> list[Row]:
    rows = []
    for name, make in CANARIES.items():
        canary = make(plan)
        if canary is None:
            continue
        start = time.perf_counter()
        right = "right" if oracle(canary).right else "wrong"
        row = Row(base, "canary", name, "", right, run_one(single, canary, memo, materialized),
                  time.perf_counter() - start)
        rows.append(row)
        if row.outcome != "caught":
            print(f"  !! canary {name} on {base}: {row.outcome} ({row.verifier})", flush=True)
    return rows


def run(bases: list[str], per_operator: int, seed: int, progress: bool,
        only: set[str] | None = None) -> list[Row]:
    rows = []
    for base in bases:
        if base in RING_BASES:
            single, plan = ring_pair(RING_BASES[base])
            rows += mutate_base(single, plan, base, per_operator, seed, progress, only)
            continue
        if base in FOLD_BASES:
            cfg, par, policy = FOLD_BASES[base]
            single = make_plan(cfg, Parallelism(), FOLD_GBS)
            shown_gbs = fold_sizes(par, FOLD_GBS, policy)[1]
            shown = make_plan_at(cfg, Parallelism(), shown_gbs, "default", None,
                                 loss_rows=FOLD_GBS)
            plan = make_plan(cfg, par, FOLD_GBS, policy=policy, fold=True)
            rows += mutate_base(single, plan, base, per_operator, seed, progress, only, shown)
            continue
        if base in MATERIALIZED_BASES:
            cfg, par, policy = MATERIALIZED_BASES[base]
            single = make_plan(cfg, Parallelism(), FOLD_GBS)
            plan = make_plan(cfg, par, FOLD_GBS, policy=policy)
            rows += mutate_base(single, plan, base, per_operator, seed, progress, only,
                                materialized=True)
            continue
        cfg, par, policy = BASES[base]
        single = make_plan(cfg, Parallelism(), GBS)
        plan = make_plan(cfg, par, GBS, policy=policy)
        rows += mutate_base(single, plan, base, per_operator, seed, progress, only)
    return rows


def table(rows: list[Row]) -> list[str]:
    outcomes = ["caught", "WRONG SUCCESS", "BLIND ORACLE", "equivalent, proved",
                "equivalent, failed", "proved", "FALSE ALARM", "NO VERDICT", "invalid plan"]
    counts = Counter((r.kind, r.operator, r.outcome) for r in rows)
    ops = sorted({(r.kind, r.operator) for r in rows})
    used = [o for o in outcomes if any(counts[(k, n, o)] for k, n in ops)]
    width = max(len(n) for _, n in ops) + 2
    lines = [f"{'operator':{width}s}" + "".join(f"{o:>20s}" for o in used)]
    for kind, name in ops:
        lines.append(f"{name:{width}s}" + "".join(f"{counts[(kind, name, o)]:20d}" for o in used))
    total = Counter(r.outcome for r in rows)
    lines.append(f"{'total':{width}s}" + "".join(f"{total[o]:20d}" for o in used))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-operator", type=int, default=14, help="mutants per operator and base")
    ap.add_argument("--seed", type=int, default=0)
    every = [*BASES, *FOLD_BASES, *MATERIALIZED_BASES, *RING_BASES]
    ap.add_argument("--bases", help=f"from {', '.join(every)} (default: all; with --quick, "
                    "part of QUICK_BASES, their floors checked)")
    ap.add_argument("--quick", action="store_true",
                    help="the seeded subset (QUICK_BASES, 2 per operator) and its floors")
    ap.add_argument("--operators", help="only these mutations and rewrites (comma-separated)")
    ap.add_argument("--csv", type=Path, help="append one row per mutant to this CSV file")
    ap.add_argument("--write-floors", action="store_true",
                    help="with --quick: record this run's caught counts as the floors")
    args = ap.parse_args(argv)
    bases = args.bases.split(",") if args.bases else list(QUICK_BASES) if args.quick else every
    per = 2 if args.quick else args.per_operator
    known_bases = QUICK_BASES if args.quick else every
    unknown = [b for b in bases if b not in known_bases]
    if unknown:
        print(f"error: unknown base {unknown[0]} ({'--quick ' if args.quick else ''}bases: "
              f"{', '.join(known_bases)})", file=sys.stderr)
        return 2
    only = set(args.operators.split(",")) if args.operators else None
    known = set(MUTATIONS) | set(REWRITES) | set(FOLD_MUTATIONS) | set(MATERIALIZED_MUTATIONS) \
        | set(CP_MUTATIONS) | set(CP_REWRITES)
    if only and only - known:
        print(f"error: unknown operator {sorted(only - known)[0]} (operators: "
              f"{', '.join(sorted(known))})", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = run(bases, per, args.seed, progress=True, only=only)
    for line in table(rows):
        print(line)
    bad = [r for r in rows if r.outcome in ("WRONG SUCCESS", "FALSE ALARM", "NO VERDICT",
                                            "BLIND ORACLE")]
    mutants = sum(r.kind == "mutation" for r in rows)
    rewrites = sum(r.kind == "rewrite" for r in rows)
    print(f"{mutants} mutants, {rewrites} rewrites on {len(bases)} base plans in "
          f"{time.perf_counter() - start:.0f} s: "
          f"{sum(r.outcome == 'WRONG SUCCESS' for r in rows)} wrong SUCCESS (a wrong mutant "
          f"verified), {sum(r.outcome == 'FALSE ALARM' for r in rows)} false alarms (a rewrite "
          f"that changes nothing FAILed), "
          f"{sum(r.outcome == 'NO VERDICT' for r in rows)} without a verdict; "
          f"{sum(r.outcome == 'equivalent, failed' for r in rows)} 'equivalent, failed' (a "
          f"mutant the oracle finds harmless that FAILed on the plan's claims, which the "
          f"verifier checks and the oracle ignores: allowed, not a false alarm)")
    blind = blind_spots(rows, args.quick and only is None and args.seed == 0, bases)
    for line in blind:
        print(f"blind spot: {line}")
    canaries = [r for r in rows if r.kind == "canary"]
    print(f"harness blindness: {sum(r.outcome == 'caught' for r in canaries)} of "
          f"{len(canaries)} canaries caught, {len(blind)} blind spots")
    if args.write_floors and args.quick and set(bases) == set(QUICK_BASES) and not bad \
            and not blind:
        write_floors(rows)
    if args.csv:
        append_rows(args.csv, [{**r.__dict__, "outcome": r.outcome} for r in rows])
    return 1 if bad or blind else 0


if __name__ == "__main__":
    sys.exit(main())
