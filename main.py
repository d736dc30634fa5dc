"""python main.py --sm single.pkl --pm parallel.pkl: are the two plans equivalent?

python main.py --convert IN OUT: rewrite plan file IN (pickled or columnar) as
OUT, columnar when OUT ends in .npz, else pickled (docs/plan-format.md).

main.py wires the parts: the plan loader and the Z3 symbolic backend
(backends/) are passed into the verifier (verdict/), which imports neither.
:func:`verify` is the verifier with the Z3 backend wired in.

Exit 0: equivalent. Exit 1: not equivalent (the difference is printed).
Exit 2: bad input or usage (one line on stderr). Exit 3: no verdict, because
of an internal error (an exception, a killed worker, memory exhausted) or a
stage the solver could not decide (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from backends.plancache import load_plan_cached
from backends.planfile import PlanError, load_plan, save_plan
from backends.userdirs import user_dir
from backends.z3backend import Z3
from verdict import engine
from verdict.cache import StageCache
from verdict.columns import Columns
from verdict.diagnosis import diagnose, mesh_lines
from verdict.differential import NumericRefused, check_size, compare
from verdict.engine import Verdict
from verdict.executor import EXECUTORS, ExecutorUnavailable, make_executor
from verdict.plan import InputError, Plan, pair_problem
from verdict.report import append_stats, assumed, evidence, failure, make_stats, time_line, tp_label, ts_label
from verdict.solve import Outcome, Prover
from verdict.structure import node_label
from verdict.symmetry.fold import FoldError, fold_pair

EXIT_EQUAL, EXIT_DIFFERENT, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_CODES = """exit codes:
  0  equivalent (✅ SUCCESS, or ✅ EQUAL with --numeric)
  1  not equivalent, with the evidence printed (❌ FAIL, or ❌ DIFFERENT with --numeric)
  2  bad input or usage: one line on stderr, nothing written
  3  no verdict: an internal error or a stage the solver could not decide (one line on stderr)"""
#: One stage's proof: verdict's solver over the Z3 symbolic backend.
PROVER = Prover(Z3)


def verify(single: Plan, parallel: Plan, **options) -> Verdict:
    """``verdict.engine.verify`` with the Z3 backend wired in (``options``:
    its keyword arguments but ``prover``)."""
    return engine.verify(single, parallel, prover=PROVER, **options)


class UsageError(Exception):
    """Bad command-line usage or input: one line, exit 2."""


class NoVerdict(Exception):
    """The run reached no verdict (internal error, undecided stage): one line, exit 3."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python main.py", description=__doc__.split("\n\n")[0],
                epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sm", type=Path, help="single-device plan (.pkl or .npz)")
    p.add_argument("--pm", type=Path, help="parallel plan (.pkl or .npz)")
    p.add_argument("--convert", nargs=2, type=Path, metavar=("IN", "OUT"),
                   help="rewrite plan file IN as OUT (columnar if OUT ends in .npz) and exit")
    p.add_argument("--seed", type=int, default=0, help="random seed (inputs, solver)")
    p.add_argument("--time", action="store_true", help="print the time of each phase")
    p.add_argument("--max_ser_proc", type=int, default=1,
                   help="accepted for compatibility; graphs are built in one process, "
                        "which measured faster than several")
    p.add_argument("--max_vrf_proc", type=int, default=1,
                   help="processes that verify stages (with --executor ray and no --ray-address: "
                        "the local Ray instance's CPUs)")
    p.add_argument("--executor", choices=EXECUTORS, default="process",
                   help="where stage proofs run: a local process pool, or Ray (docs/cluster.md)")
    p.add_argument("--ray-address", dest="ray_address", metavar="ADDR",
                   help="Ray cluster to use (default: start a local Ray instance)")
    p.add_argument("--loglevel", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="logging level; DEBUG logs every stage's outcome (default: %(default)s)")
    p.add_argument("--use_cache_nodes", dest="cache_nodes", action="store_true", default=True,
                   help="remember in --cache_dir which plan files (by content) were "
                        "validated, and skip validating them again (the default)")
    p.add_argument("--no_cache_nodes", dest="cache_nodes", action="store_false",
                   help="validate the plan files on every load, without the plan cache")
    p.add_argument("--use_cache_stages", dest="cache_stages", action="store_true", default=True,
                   help="remember proved stages in --cache_dir (by canonical problem) and "
                        "skip them in later runs (the default)")
    p.add_argument("--no_cache_stages", dest="cache_stages", action="store_false",
                   help="prove every stage again, without the stage cache")
    p.add_argument("--dump_nodes", action="store_true",
                   help="write both plans' nodes to LOG_DIR/<parallel plan>/nodes.txt")
    p.add_argument("--dump_lineages", action="store_true",
                   help="write every lineage (single-device tensor = parallel pieces) to "
                        "LOG_DIR/<parallel plan>/lineages.txt")
    p.add_argument("--dump_stages", action="store_true",
                   help="write every stage, its outcome and its nodes to "
                        "LOG_DIR/<parallel plan>/stages.txt")
    p.add_argument("--cache_dir", type=Path, default=user_dir("cache"),
                   help="where the plan and stage caches live (default: %(default)s)")
    p.add_argument("--log_dir", type=Path, default=user_dir("logs"),
                   help="where --dump_* write (default: %(default)s)")
    p.add_argument("--stats_dir", type=Path, default=user_dir("stats"),
                   help="where the Stats row is appended, as stats.csv (default: %(default)s)")
    p.add_argument("--brief", action="store_true",
                   help="on a FAIL print the diagnosis only and write the full counterexample "
                        "to LOG_DIR/<parallel plan>/failure.txt")
    p.add_argument("--keep-going", dest="keep_going", action="store_true",
                   help="report every failing stage instead of stopping at the first")
    p.add_argument("--numeric", action="store_true",
                   help="differential numeric check in float64 instead of a proof")
    p.add_argument("--json", type=Path, help="write a JSON summary to this file")
    return p


def load_pair(args: argparse.Namespace, columns: bool = False) -> tuple[Plan, Plan | Columns]:
    """With ``columns``, a columnar --pm stays columns: verify() proves a
    materialized plan by its representatives without making every node."""
    cache = args.cache_dir if args.cache_nodes else None
    single = load_plan_cached(args.sm, cache)
    parallel = load_plan_cached(args.pm, cache, columns=columns)
    try:
        single, _ = fold_pair(single, parallel)  # a folded plan: the shown rows of --sm
    except FoldError as e:
        raise UsageError(str(e)) from None
    problem = pair_problem(single, parallel)
    if problem:
        raise UsageError(problem)
    return single, parallel


def run_verify(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.loglevel, format="%(levelname)s %(message)s")
    start = time.perf_counter()
    single, parallel = load_pair(args, columns=True)
    t_load = time.perf_counter() - start
    return verify_and_report(args, single, parallel, t_load)


def verify_and_report(args: argparse.Namespace, single: Plan, parallel: Plan,
                      t_load: float = 0.0) -> int:
    """Verify a loaded pair and print the verdict (scripts/run_br.py calls it
    too, on plans made in memory); the exit code."""
    cache = StageCache(args.cache_dir if args.cache_stages else None)
    memo = {key: Outcome("proved") for key in cache.proved}
    earlier = set(cache.proved)  # proved by an earlier run: assumed by this one
    progress = sys.stderr.isatty()
    executor = make_executor(args.executor, args.max_vrf_proc, args.ray_address, PROVER)
    verdict = verify(single, parallel, seed=args.seed, keep_going=args.keep_going, memo=memo,
                     progress=progress, executor=executor)
    cache.save({r.key for r in verdict.results if r.outcome.ok})
    log = logging.getLogger("verdict")
    for r in verdict.results:
        log.debug("stage %d (%s): %s in %.3fs%s", r.stage.id, r.key[:8], r.outcome.status,
                  r.outcome.seconds, " (memo)" if r.memo else "")
    stats = make_stats(verdict, parallel, t_load)
    took = assumed(parallel, verdict, sum(r.key in earlier for r in verdict.results))
    if verdict.pair:  # a materialized plan proved by its representatives
        single, parallel = verdict.pair
    dump(args, single, parallel, verdict)
    if verdict.kind == "internal":
        raise NoVerdict(verdict.message)
    if verdict.success:
        for line in evidence(verdict, single):
            print(line)
        print(took)
        if single.world.get("routing"):  # top-k routing recorded when traced (tracer/routing.py)
            print(f"for the routing traced, not every routing: {single.world['routing']}")
        if single.world.get("final_buffers"):  # compared when traced (tracer/final_buffers.py)
            print(f"and, checked by value when traced: {single.world['final_buffers']}")
        if single.world.get("guards"):  # branches on numbers read with .item() (tracer/build.py)
            print(f"for the inputs on which the single-device step takes the branches traced "
                  f"(every rank's numbers proved equal to its, so each rank takes them too), "
                  f"not every input: {single.world['guards']}")
        if single.world.get("assumed"):  # rank-only guards settled (backends/torch/tracer/rank_guards.py)
            print(f"and on the inputs where: {single.world['assumed']}")
        print(f"PID: {os.getpid()} - ✅ SUCCESS")
    else:
        for line in fail_lines(args, verdict, single, parallel):
            print(line)
        print(f"PID: {os.getpid()} - ❌ FAIL")
    print(stats.line())
    if args.time:
        print(time_line(stats, t_load))
    append_stats(stats, args.stats_dir)
    if args.json:
        write_json(args.json, verdict, stats, single, parallel, took)
    return EXIT_EQUAL if verdict.success else EXIT_DIFFERENT


def fail_lines(args: argparse.Namespace, verdict: Verdict, single: Plan, parallel: Plan) -> list[str]:
    """A FAIL: the diagnosis in the model's names (verdict/diagnosis.py), then
    the full dump (Node/Tensor lines, the counterexample's values); with
    --brief the dump goes to LOG_DIR/<parallel plan>/failure.txt instead."""
    full = failure(verdict, single, parallel)
    if verdict.kind != "stage":  # a structural finding: its message is the lead line
        return [*full, *mesh_lines(parallel, verdict.message)]
    lead = diagnose(verdict, single, parallel)
    if not args.brief:  # the diagnosis right under its stage's first line
        at = full.index(lead[0]) + 1 if lead and lead[0] in full else 0
        return [*full[:at], *(lead[1:] if at else lead), *full[at:]]
    folder = args.log_dir / args.pm.stem
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "failure.txt").write_text("\n".join(full) + "\n")
    return [*lead, f"   the full counterexample (nodes, tensors, values): {folder / 'failure.txt'}"]


def dump(args: argparse.Namespace, single: Plan, parallel: Plan, verdict: Verdict) -> None:
    """--dump_nodes / --dump_lineages / --dump_stages: text files under log_dir."""
    if not (args.dump_nodes or args.dump_lineages or args.dump_stages):
        return
    if isinstance(parallel, Columns):  # no stage ran on it (a structural finding)
        parallel = parallel.to_plan()
    folder = args.log_dir / args.pm.stem
    folder.mkdir(parents=True, exist_ok=True)
    if args.dump_nodes:
        lines = [node_label(single, i).replace("Node(", "Node(wtype='s', ")
                 for i in range(len(single.nodes))]
        lines += [node_label(parallel, i).replace("Node(", "Node(wtype='p', ")
                  for i in range(len(parallel.nodes))]
        (folder / "nodes.txt").write_text("\n".join(lines) + "\n")
    if args.dump_lineages:
        lines = []
        for lin in verdict.lineages:
            lines.append(f"{ts_label(single, lin.ts)} {single.logical[single.tensors[lin.ts].tid].name}")
            for slices, group in lin.groups:
                lines.append(f"  {tuple(slices)} = " + " + ".join(tp_label(parallel, t) for t in group))
            for t in lin.loose:
                lines.append(f"  loose {tp_label(parallel, t)}")
        (folder / "lineages.txt").write_text("\n".join(lines) + "\n")
    if args.dump_stages:
        lines = []
        for r in verdict.results:
            st = r.stage
            gs = node_label(single, st.gs_node) if st.gs_node >= 0 else "input stage"
            lines.append(f"stage {st.id} key {r.key} {r.outcome.status}"
                         f"{' memo' if r.memo else ''}: {gs}")
            lines += ["  " + node_label(parallel, i) for i in st.gp_nodes]
        (folder / "stages.txt").write_text("\n".join(lines) + "\n")


def write_json(path: Path, verdict: Verdict, stats, single: Plan, parallel: Plan,
               took: str) -> None:
    failing = []
    for r in verdict.failed:
        failing.append({
            "stage": r.stage.id, "status": r.outcome.status, "detail": r.outcome.detail,
            "single_node": node_label(single, r.stage.gs_node) if r.stage.gs_node >= 0 else None,
            "parallel_nodes": [node_label(parallel, i) for i in r.stage.gp_nodes],
            "lineages": [ts_label(single, verdict.lineages[lid].ts) for lid in r.stage.outputs],
        })
    summary = {"mode": "symbolic", "success": verdict.success, "kind": verdict.kind,
               "message": verdict.message, "stats": asdict(stats), "failing_stages": failing,
               "coverage": verdict.coverage, "assumed": took if verdict.success else "",
               "diagnosis": [] if verdict.success else diagnose(verdict, single, parallel)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")


def run_numeric(args: argparse.Namespace) -> int:
    single, parallel = load_pair(args)
    check_size(single, str(args.sm))
    check_size(parallel, str(args.pm))
    start = time.perf_counter()
    report = compare(single, parallel, seed=args.seed)
    took = time.perf_counter() - start
    print(f"numeric check (float64, seed {args.seed}): {report.checked} tensors and "
          f"{report.groups} partial-sum groups compared with their single-device pieces")
    if report.broken:
        print(f"  🚨 broken dataflow: {report.broken}")
    for d in report.differences[:10]:
        print(f"  🚨 {d.describe()}")
    for u in report.uncovered:
        print(f"  🚨 {u}")
    if args.time:
        print(f"t_numeric={took:.3f}s")
    if args.json:
        summary = {
            "mode": "numeric", "equal": report.equal, "checked": report.checked,
            "groups": report.groups, "differences": [d.describe() for d in report.differences],
            "uncovered": report.uncovered, "broken": report.broken,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    if report.equal:
        print("✅ EQUAL (numeric check of one input; not a proof)")
        return EXIT_EQUAL
    first = report.broken or (
        report.differences[0].describe() if report.differences else report.uncovered[0])
    print(f"❌ DIFFERENT: first difference: {first}")
    return EXIT_DIFFERENT


def run_convert(source: Path, target: Path) -> int:
    """--convert: load (and validate) one plan file, write it in the other form."""
    plan = load_plan(source)
    out, spec = save_plan(plan, target)
    print(f"wrote {out} ({len(plan.nodes)} nodes, {len(plan.tensors)} tensors)")
    print(f"wrote {spec}")
    return EXIT_EQUAL


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.convert:
            if args.sm or args.pm:
                raise UsageError("--convert takes no --sm or --pm")
            return run_convert(*args.convert)
        if args.sm is None or args.pm is None:
            raise UsageError("the following arguments are required: --sm, --pm")
        if args.max_vrf_proc < 1 or args.max_ser_proc < 1:
            raise UsageError("--max_vrf_proc and --max_ser_proc must be at least 1")
        if not args.numeric:
            make_executor(args.executor, args.max_vrf_proc, args.ray_address, PROVER)
        return run_numeric(args) if args.numeric else run_verify(args)
    except (UsageError, PlanError, InputError, NumericRefused, ExecutorUnavailable) as e:
        sys.stderr.write(f"error: {e}\n")
        return EXIT_BAD_INPUT
    except NoVerdict as e:
        sys.stderr.write(f"internal error: no verdict: {e}\n")
        return EXIT_INTERNAL
    except MemoryError:
        sys.stderr.write("internal error: out of memory (MemoryError); no verdict\n")
        return EXIT_INTERNAL
    except Exception as e:  # never a traceback, never a verdict
        sys.stderr.write(f"internal error: {type(e).__name__}: {e}\n")
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
