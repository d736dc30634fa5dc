"""python main.py --sm single.pkl --pm parallel.pkl: are the two plans equivalent?

Exit 0: equivalent. Exit 1: not equivalent (the difference is printed).
Exit 2: bad input or usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from backends.planfile import PlanError, load_plan
from verdict.differential import NumericRefused, check_size, compare
from verdict.plan import pair_problem

EXIT_EQUAL, EXIT_DIFFERENT, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(Exception):
    """Bad command-line usage or input: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python main.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sm", type=Path, required=True, help="single-device plan (.pkl)")
    p.add_argument("--pm", type=Path, required=True, help="parallel plan (.pkl)")
    p.add_argument("--seed", type=int, default=0, help="random seed (inputs, solver)")
    p.add_argument("--time", action="store_true", help="print the time of each phase")
    p.add_argument("--max_ser_proc", type=int, default=1, help="processes that build graphs")
    p.add_argument("--max_vrf_proc", type=int, default=1, help="processes that verify stages")
    p.add_argument("--loglevel", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    p.add_argument("--use_cache_nodes", dest="cache_nodes", action="store_true", default=True)
    p.add_argument("--no_cache_nodes", dest="cache_nodes", action="store_false")
    p.add_argument("--use_cache_stages", dest="cache_stages", action="store_true", default=True)
    p.add_argument("--no_cache_stages", dest="cache_stages", action="store_false")
    p.add_argument("--dump_nodes", action="store_true")
    p.add_argument("--dump_lineages", action="store_true")
    p.add_argument("--dump_stages", action="store_true")
    p.add_argument("--cache_dir", type=Path, default=Path("data/cache"))
    p.add_argument("--log_dir", type=Path, default=Path("data/logs"))
    p.add_argument("--stats_dir", type=Path, default=Path("data/stats"))
    p.add_argument("--keep-going", dest="keep_going", action="store_true",
                   help="report every failing stage instead of stopping at the first")
    p.add_argument("--numeric", action="store_true",
                   help="differential numeric check in float64 instead of a proof")
    p.add_argument("--json", type=Path, help="write a JSON summary to this file")
    return p


def run_numeric(args: argparse.Namespace) -> int:
    single, parallel = load_plan(args.sm), load_plan(args.pm)
    problem = pair_problem(single, parallel)
    if problem:
        raise UsageError(problem)
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


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        if not args.numeric:
            raise UsageError("symbolic verification is not available in this version; "
                             "run with --numeric for the differential numeric check")
        return run_numeric(args)
    except (UsageError, PlanError, NumericRefused) as e:
        sys.stderr.write(f"error: {e}\n")
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
