"""The verification pipeline: structure, lineages, stages, proofs, coverage.

    verify(single, parallel) -> Verdict

Stages are proved independently (each assumes only its input lineages), so
they run in any order and in parallel. Identical stages (same canonical
problem) are proved once. The final check (verdict/final.py) makes sure
every rank ends with what the single-device step computes for what it holds.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field

from verdict.columns import Columns
from verdict.executor import Executor, SolveFn, make_executor
from verdict.final import add_loss_groups, check_final, check_layout, loss_groups, rank_states
from verdict.lineage import Lineage, StructureError, infer_lineages
from verdict.plan import InputError, Plan
from verdict.problem import Problem, build_problem
from verdict.progress import progress as bar
from verdict.reduce import RuleMemo, reduce_stage
from verdict.solve import Outcome
from verdict.stages import Stage, cut_stages
from verdict.structure import check_structure
from verdict.symmetry.find import Refusal, Symmetry, find_symmetry, foldable
from verdict.symmetry.fold import fold_of, fold_pair
from verdict.symmetry.uniform import check_uniform


@dataclass
class StageResult:
    stage: Stage
    problem: Problem
    key: str
    outcome: Outcome
    memo: bool  # proved by an identical stage


@dataclass
class Verdict:
    success: bool
    kind: str = ""  # on failure: structure kind, 'stage', 'coverage' or 'internal' (no verdict)
    message: str = ""
    results: list[StageResult] = field(default_factory=list)
    failed: list[StageResult] = field(default_factory=list)
    lineages: list[Lineage] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)
    coverage: list[str] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    unique: int = 0
    memo_hits: int = 0
    fold: str = ""  # a folded plan: what was shown of the real sizes
    #: a materialized plan: which blocks were checked and proved, or why it
    #: was verified in full (verdict/symmetry/find.py)
    symmetry: str = ""
    #: the blocks of the plan: (checked against the representatives, proved,
    #: assumed); (0, 0, 0) when every node was proved
    blocks: tuple[int, int, int] = (0, 0, 0)
    #: a materialized plan proved by symmetry: its classes of blocks (replicas x microbatches)
    classes: int = 0
    #: the pair the stages and lineages index (the representatives of a
    #: materialized plan), when it is not the pair given
    pair: tuple[Plan, Plan] | None = None
    #: the representatives' ranks in the plan ("folded->plan, ...")
    ranks: str = ""


def prepare(single: Plan, parallel: Plan, lineages: list[Lineage], of_gp: list[int],
            stages: list[Stage], progress: bool,
            stopped: list[StructureError] | None = None) -> list[tuple[Stage, Problem, str]]:
    """Reduce every stage and make it a problem with its canonical key.

    One process: sending the plans to helper processes costs more than the
    work (1.2 s here against 6.8 s with two processes, 32-layer llama3 plan).
    With ``stopped``, a stage whose reduction finds the plan wrong ends the
    list there: its finding is appended to ``stopped`` and the stages
    before it are returned, so that a stage among them that fails can be
    reported first (``verify_pair``).
    """
    producer = single.producers()
    memo = RuleMemo()
    prepared = []
    for stage in bar(stages, "reducing stages", enabled=progress):
        tensors = set(stage.sources)
        for i in stage.gp_nodes:
            node = parallel.nodes[i]
            tensors.update(t for t in (*node.inputs, *node.outputs) if t >= 0)
        try:
            red = reduce_stage(single, parallel, stage, lineages, of_gp, sorted(tensors), memo)
        except StructureError as e:
            if stopped is None:
                raise
            stopped.append(e)
            break
        problem = build_problem(single, parallel, stage, lineages, red, producer)
        prepared.append((stage, problem, problem.key()))
    return prepared


def prove(prepared, seed: int, executor: Executor, keep_going: bool, memo: dict[str, Outcome],
          progress: bool) -> tuple[list[StageResult], int]:
    """Outcome of every stage (up to the first failure unless keep_going) and
    the number proved by memo; identical problems are solved once, handed to
    the executor in stage order."""
    todo: dict[str, Problem] = {}
    for _, problem, key in prepared:
        if key not in memo and key not in todo:
            todo[key] = problem
    counter = bar(None, "verifying stages", total=len(todo), enabled=progress)
    jobs = [(k, p, seed) for k, p in todo.items()]
    solved: dict[str, Outcome] = {}
    with closing(executor.results(jobs)) as outcomes:
        for key, outcome in outcomes:
            solved[key] = outcome
            counter.update()
            if not outcome.ok and not keep_going:
                break
    counter.close()
    results = []
    hits = 0
    for stage, problem, key in prepared:
        if key in solved:
            outcome, from_memo = solved[key], False
        elif key in memo:
            outcome, from_memo = memo[key], True
        else:
            continue  # not run: an earlier failure stopped the pool
        if outcome.ok:
            memo[key] = outcome
        hits += from_memo
        results.append(StageResult(stage, problem, key, outcome, from_memo))
    seen_keys = set()
    for r in results:
        if r.key in seen_keys and not r.memo:
            r.memo = True
            hits += 1
        seen_keys.add(r.key)
    return results, hits


def verify(single: Plan, parallel: Plan | Columns, *, prover: SolveFn, seed: int = 0,
           workers: int = 1, keep_going: bool = False, memo: dict[str, Outcome] | None = None,
           progress: bool = False, executor: Executor | None = None) -> Verdict:
    """``prover`` proves one stage (``verdict.solve.Prover`` of a symbolic
    backend, which main.py wires in). ``executor`` runs the stage proofs
    (verdict/executor.py); by default this process, or a pool of ``workers``
    processes running ``prover``. A folded parallel plan
    is compared with the single-device plan restricted to its rows
    (``verdict.symmetry.fold.fold_pair``, which main.py calls; done here when the
    caller passes the real single-device plan, and FoldError when that
    cannot be done); its uniformity is checked here. A materialized plan
    (a Plan, or its columns) whose blocks are uniform is proved by its
    representatives (verdict/symmetry/find.py); any other is verified in full.
    ``Verdict.pair`` is the pair the stages index when it is not the one given
    (the given columns stay columns when no stage ran). A load that claims a
    factor is refused with InputError (``Plan.scaled_load``)."""
    problem = single.scaled_load() or parallel.scaled_load()
    if problem:
        raise InputError(problem)
    memo = {} if memo is None else memo  # shared by the cuts of classes of blocks
    options = dict(prover=prover, seed=seed, workers=workers, keep_going=keep_going, memo=memo,
                   progress=progress, executor=executor)
    verdict, pair = _verify(single, parallel, options)
    if pair[0] is not single or pair[1] is not parallel:
        verdict.pair = pair
    return verdict


def _verify(single: Plan, parallel: Plan | Columns, options: dict
            ) -> tuple[Verdict, tuple[Plan, Plan]]:
    if isinstance(parallel, Columns) and not foldable(parallel):
        parallel = parallel.to_plan()
    if isinstance(parallel, Plan) and parallel.is_folded():
        if single.world.get("gbs") != parallel.world.get("gbs"):
            single, _ = fold_pair(single, parallel)
        verdict = verify_pair(single, parallel, **options)
        w = parallel.world
        ep = int(w.get("ep", 1))  # blocks of expert-data-parallel replicas
        shown = w["dp"] // ep * w["nm"]
        verdict.blocks = (0, shown, w["fold_dp"] // ep * w["fold_nm"] - shown)
        return verdict, (single, parallel)
    if not foldable(parallel):
        return verify_pair(single, parallel, **options), (single, parallel)
    t0 = time.perf_counter()
    try:
        check_structure(single, "the single-device plan")
        found = find_symmetry(single, parallel)  # the layout of every rank first
    except StructureError as e:
        t = time.perf_counter() - t0  # a finding of no stage: the pair as given
        return Verdict(False, e.kind, str(e), times={"t_graph": t, "t_total": t}), (
            single, parallel)
    t_symmetry = time.perf_counter() - t0
    if isinstance(found, Refusal):
        full = parallel if isinstance(parallel, Plan) else parallel.to_plan()
        verdict = verify_pair(single, full, **options)
        verdict.symmetry = (f"the blocks differ: {found.why}; every node was verified"
                            if found.difference else
                            f"verified in full, not by symmetry: {found.why}")
        pair = (single, full)
    else:
        verdict = verify_pair(found.single, found.folded, **options)
        pair = (found.single, found.folded)
        if verdict.success:
            verdict, pair = _verify_classes(verdict, pair, found, options)
        if verdict.kind == "fold":  # cannot happen after the check; never a FAIL by itself
            full = parallel if isinstance(parallel, Plan) else parallel.to_plan()
            verdict = verify_pair(single, full, **options)
            verdict.symmetry = "verified in full: a cut of the representatives was not uniform"
            return verdict, (single, full)
        if not verdict.symmetry:
            verdict.symmetry = found.describe()
        verdict.fold = ""  # nothing assumed: every block was checked
        verdict.blocks = (found.blocks, found.proved(), 0)
        verdict.classes = 1 + len(found.classes)
        verdict.ranks = verdict.ranks or found.ranks()
    verdict.times["t_symmetry"] = t_symmetry
    verdict.times["t_graph"] = verdict.times.get("t_graph", 0.0) + t_symmetry
    verdict.times["t_total"] = verdict.times.get("t_total", 0.0) + t_symmetry
    return verdict, pair


def _verify_classes(base: Verdict, pair: tuple[Plan, Plan], found: Symmetry, options: dict
                    ) -> tuple[Verdict, tuple[Plan, Plan]]:
    """After the base class proved, each other class of blocks by its
    mixed cut (docs/soundness.md, "When the blocks differ: classes"), the
    base's proofs shared through the memo; the first FAIL is the verdict,
    naming the class (a ``fold`` finding of a cut, which the block check
    excludes, is left to the caller: never a FAIL by itself)."""
    for cut in found.classes:
        verdict = verify_pair(cut.single, cut.folded, uniform=False, **options)
        for k, v in verdict.times.items():
            base.times[k] = base.times.get(k, 0.0) + v
        if not verdict.success:
            verdict.times = base.times
            verdict.symmetry = found.failed(cut)
            verdict.ranks = cut.ranks()
            return verdict, (cut.single, cut.folded)
        base.memo_hits += verdict.memo_hits
    return base, pair


def verify_pair(single: Plan, parallel: Plan, *, prover: SolveFn, seed: int = 0, workers: int = 1,
                keep_going: bool = False, memo: dict[str, Outcome] | None = None,
                progress: bool = False, executor: Executor | None = None,
                uniform: bool = True) -> Verdict:
    """The pipeline on one pair as given (a folded plan: ``single`` already
    restricted to its rows). ``uniform=False`` checks only the rules of the
    folded uniformity check, not that its blocks run one program: a mixed
    cut of classes of blocks, whose programs were compared on the whole
    plan (verdict/symmetry/find.py)."""
    memo = {} if memo is None else memo
    executor = executor or make_executor("process", workers, None, prover)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        check_structure(single, "the single-device plan")
        check_structure(parallel, "the parallel plan")
        check_layout(parallel)
        if parallel.is_folded():
            # single: restricted (verdict/symmetry/fold.py fold_pair)
            check_uniform(single, parallel, compare=uniform)
        times["t_graph"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        lineages, of_gs, of_gp = infer_lineages(single, parallel)
        states = rank_states(single, parallel)
        add_loss_groups(single, parallel, lineages, of_gp, loss_groups(single, parallel, states))
        stopped: list[StructureError] = []
        stages = cut_stages(single, parallel, lineages, of_gs, of_gp, stopped)
        times["t_lineage"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        prepared = prepare(single, parallel, lineages, of_gp, stages, progress, stopped)
        times["t_schedule"] = time.perf_counter() - t2
    except StructureError as e:
        times.setdefault("t_graph", time.perf_counter() - t0)
        times["t_total"] = time.perf_counter() - t0
        return Verdict(False, e.kind, str(e), times=times)
    fold = fold_of(parallel).describe() if parallel.is_folded() else ""
    t3 = time.perf_counter()
    results, hits = prove(prepared, seed, executor, keep_going, memo, progress)
    times["t_vrf"] = time.perf_counter() - t3
    failed = [r for r in results if not r.outcome.ok]
    if stopped and not any(r.outcome.status == "counterexample" for r in failed):
        # a reduction found the plan wrong and no stage before it is refuted:
        # that finding is the verdict (never a SUCCESS either way); of a cut's
        # finding and a reduction's among the stages cut before it, the
        # reduction's (the earlier stage)
        times["t_total"] = time.perf_counter() - t0
        return Verdict(False, stopped[-1].kind, str(stopped[-1]), times=times)
    if not keep_going:
        failed = failed[:1]
    for r in failed:
        if r.outcome.status == "counterexample":
            # solved again here, so the counterexample does not depend on which
            # worker solved what before it (Z3 keeps state per process)
            r.outcome = prover(r.problem, seed)
    verdict = Verdict(not failed, results=results, failed=failed, lineages=lineages,
                      stages=stages, times=times, unique=len({k for _, _, k in prepared}),
                      memo_hits=hits, fold=fold)
    undecided = [r for r in failed if r.outcome.status in ("error", "unknown")]
    if failed and len(undecided) == len(failed):
        r = undecided[0]
        verdict.kind = "internal"
        verdict.message = f"stage {r.stage.id} was not decided: {r.outcome.status}: {r.outcome.detail}"
    elif failed:
        verdict.failed = [r for r in failed if r not in undecided]
        verdict.kind, verdict.message = "stage", f"{len(verdict.failed)} stage(s) fail"
    else:
        proved = {lid for r in results for lid in r.stage.outputs}
        proved |= {lin.id for lin in lineages
                   if single.logical[single.tensors[lin.ts].tid].kind in
                   ("data", "tokens", "param", "buffer")}
        verdict.coverage = check_final(single, parallel, states, lineages, of_gp, proved)
        if verdict.coverage:
            verdict.success, verdict.kind = False, "coverage"
            verdict.message = verdict.coverage[0]
    times["t_total"] = time.perf_counter() - t0
    return verdict
