"""Bug reproduction (paper §8.3): the 14 buggy llama3 plans of docs/bugs.md.

Makes the single-device plan and the correct parallel plan (dp2 pp2 tp2 nm2
of a 32-layer llama3) once, in this process, injects each bug into a copy
of the correct plan (harness/bugs.py, as ``python -m gen_model --variant
brN`` does), and verifies the 14 bug plans and the correct plan as
``python main.py --no_cache_stages`` would (the same code, the same report;
each plan proved in full, no stage taken from another plan), spread over
``--jobs`` forked processes. Each report goes to LOGS/br{N}.log (the
correct plan's to LOGS/br_clean.log). Prints one line per plan: the exit
code and the first ❌ line of its report. Exit 0 when every bug plan exits 1
and the correct plan exits 0.

    python scripts/run_br.py [--jobs 2] [--logs data/logs] [--plans DIR]

``--plans DIR`` also writes the 16 plan files (as gen_model names them).
docs/benchmarks.md gives the time and where it goes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import queue
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import main as verifier  # noqa: E402
from backends.planfile import save_plan, validate  # noqa: E402
from gen_model.__main__ import config_from, parser  # noqa: E402
from gen_model.config import Parallelism, plan_stem  # noqa: E402
from gen_model.generate import make_plan  # noqa: E402
from harness.bugs import BUGS, inject  # noqa: E402
from verdict.plan import Plan, pair_problem  # noqa: E402

SIZE = ["--model", "llama3", "--layers", "32", "--heads", "32", "--hidden", "128",
        "--seqlen", "8192", "--gbs", "32"]
PAR = ["--dp", "2", "--pp", "2", "--tp", "2", "--nm", "2"]
NAMES = ["clean", *(str(b) for b in sorted(BUGS))]


@dataclass
class Outcome:
    name: str
    code: int
    summary: str
    cpu: float  # CPU seconds of injecting and verifying it

    @property
    def label(self) -> str:
        return "clean" if self.name == "clean" else f"br{self.name}"

    @property
    def expected(self) -> int:
        return 0 if self.name == "clean" else 1


def bug_plan(clean: Plan, bug: int) -> Plan:
    """The plan ``python -m gen_model ... --variant br{bug}`` writes."""
    plan = inject(clean, bug)
    plan.world["variant"] = f"br{bug}"
    return plan


def make_plans(plans_dir: Path | None) -> tuple[Plan, Plan]:
    """The single-device plan and the correct parallel plan (validated as a
    plan file would be), written to ``plans_dir`` when given."""
    args = parser().parse_args([*SIZE, *PAR])
    cfg, par = config_from(args)
    single = make_plan(cfg, Parallelism(), args.gbs)
    clean = make_plan(cfg, par, args.gbs)
    for plan in (single, clean):
        validate(plan.to_data())
    if plans_dir is not None:
        save_plan(single, plans_dir / f"{plan_stem(cfg, Parallelism(), args.gbs)}.pkl")
        save_plan(clean, plans_dir / f"{plan_stem(cfg, par, args.gbs)}.pkl")
        for bug in sorted(BUGS):
            stem = plan_stem(cfg, par, args.gbs, f"br{bug}")
            save_plan(bug_plan(clean, bug), plans_dir / f"{stem}.pkl")
    return single, clean


def verify_one(name: str, single: Plan, clean: Plan, logs: Path, stats: Path) -> Outcome:
    """One plan of the suite: inject its bug, verify it, write its report."""
    start = time.process_time()
    log = logs / ("br_clean.log" if name == "clean" else f"br{name}.log")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        plan = clean if name == "clean" else bug_plan(clean, int(name))
        problem = pair_problem(single, plan)
        if problem:
            print(f"error: {problem}")
            code = verifier.EXIT_BAD_INPUT
        else:
            args = verifier.parser().parse_args(
                ["--sm", "-", "--pm", "-", "--no_cache_stages", "--stats_dir", str(stats)])
            try:
                code = verifier.verify_and_report(args, single, plan)
            except verifier.NoVerdict as e:
                print(f"internal error: no verdict: {e}")
                code = verifier.EXIT_INTERNAL
    log.write_text(text.getvalue())
    return Outcome(name, code, summary(text.getvalue()), time.process_time() - start)


def worker(todo: multiprocessing.Queue, done: multiprocessing.Queue, single: Plan, clean: Plan,
           logs: Path, stats: Path) -> None:
    """Verify plans named on ``todo`` until it gives None; each outcome goes
    to ``done`` (an exception becomes exit 3, no verdict)."""
    while (name := todo.get()) is not None:
        try:
            done.put(verify_one(name, single, clean, logs, stats))
        except Exception as e:  # reported as no verdict, never as one
            done.put(Outcome(name, verifier.EXIT_INTERNAL, f"internal error: {type(e).__name__}: "
                                                            f"{e}", 0.0))


def verify_all(single: Plan, clean: Plan, jobs: int, logs: Path, stats: Path) -> list[Outcome]:
    """Every plan of the suite, over ``jobs`` forked processes (a fork shares
    the two plans, nothing is sent but names and outcomes); in NAMES order."""
    ctx = multiprocessing.get_context("fork")
    todo, done = ctx.Queue(), ctx.Queue()
    for name in [*NAMES, *[None] * jobs]:
        todo.put(name)
    procs = [ctx.Process(target=worker, args=(todo, done, single, clean, logs, stats))
             for _ in range(jobs)]
    for proc in procs:
        proc.start()
    found: dict[str, Outcome] = {}
    while len(found) < len(NAMES):
        try:
            outcome = done.get(timeout=5)
        except queue.Empty:
            if any(proc.is_alive() for proc in procs):
                continue
            break  # a process died without a word: its plans get no verdict
        found[outcome.name] = outcome
    for proc in procs:
        proc.join()
    lost = Outcome("", verifier.EXIT_INTERNAL, "internal error: its process died", 0.0)
    return [found.get(name, replace(lost, name=name)) for name in NAMES]


def summary(report: str) -> str:
    """The first ❌ (or ✅) line; for a counterexample also the single-device
    node of the failing stage and the (rank, microbatch) of each parallel
    tensor under 🚨."""
    lines = report.splitlines()
    first = next((line[:200] for line in lines if "✅ SUCCESS" in line or "❌" in line), "")
    if "the solver found inputs" not in first:
        return first
    node = next((line for line in lines if line.startswith("Node(wtype='s'")), "")
    found = re.search(r"op='([^']*)', dir='([^']*)', name='([^']*)'", node)
    where = ", ".join(found.groups()) if found else "?"
    bad: list[str] = []
    tensor = ""
    for line in lines:
        t = re.search(r"⨁ Tensor\(wtype='p', rank=(\d+), mb=(-?\d+)", line)
        if t:
            tensor = f"r{t.group(1)}/mb{t.group(2)}"
        elif line.strip() == "🚨 ⬆️" and tensor not in bad:
            bad.append(tensor)
    return f"{first} | Gs node: {where} | 🚨 under {' '.join(bad)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2, help="processes verifying plans (default: 2)")
    p.add_argument("--logs", type=Path, default=Path("data/logs"),
                   help="where the reports go (default: %(default)s)")
    p.add_argument("--stats", type=Path, default=Path("data/stats"),
                   help="where the Stats rows are appended (default: %(default)s)")
    p.add_argument("--plans", type=Path, help="also write the plan files here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    args.logs.mkdir(parents=True, exist_ok=True)
    single, clean = make_plans(args.plans)
    made = time.perf_counter() - start
    made_cpu = time.process_time()
    outcomes = verify_all(single, clean, max(1, args.jobs), args.logs, args.stats)
    ok = True
    print(f"{'plan':<9} {'exit':<6} first ❌ line")
    for o in outcomes:
        mark = "" if o.code == o.expected else f"  <-- expected exit {o.expected}"
        ok &= o.code == o.expected
        print(f"{o.label:<9} {o.code:<6} {o.summary}{mark}")
    work = sum(o.cpu for o in outcomes)
    print(f"total time: {time.perf_counter() - start:.1f} s; making the two plans {made:.1f} s "
          f"({made_cpu:.1f} s CPU, with the imports), injecting and verifying the 15 "
          f"{work:.1f} s CPU over {args.jobs} processes")
    if ok:
        print(f"all {len(BUGS)} bugs detected (exit 1); the correct plan verified (exit 0)")
        return 0
    print(f"some plan did not give the expected verdict (see the logs in {args.logs}/)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
