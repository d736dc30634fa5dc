"""Break the checker on purpose and report which check notices.

    .venv/bin/python scripts/sabotage.py [--only NAME,...] [--quick]

Each sabotage is one edit of the source, applied in a temporary copy of
the tracked files (this checkout is never touched). In the copy it runs the
checks that should notice: the oracle tests (tests/test_oracle.py: the
canaries, the single-device maps, the solver behind a right claim) and the
mutation harness on the two small mlp bases, 4 mutants per operator (its
canaries, wrong SUCCESS, the ceilings on equivalent outcomes), or with
``--quick`` its whole ``--quick`` run (the floors too; minutes more). A sabotage that no check
notices is a hole in the checking: exit 1.
docs/mutation.md ("Sabotage") holds the last report.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Sabotage:
    name: str
    what: str
    path: str
    old: str
    new: str


SABOTAGES = (
    Sabotage("mul_scalar_ignores_value", "the rule of mul_scalar ignores its value (both rules)",
             "verdict/ops/elementwise.py",
             'forward=lambda xp, x, value: (x[0] * value,),\n'
             '    backward=lambda xp, s, g, shapes, value: (g[0] * value,),',
             'forward=lambda xp, x, value: (x[0] * 1.0,),\n'
             '    backward=lambda xp, s, g, shapes, value: (g[0] * 1.0,),'),
    Sabotage("oracle_gradient_comparison_removed", "the oracle no longer compares gradients",
             "harness/oracle.py",
             "if not _close(values[got], expected[region]):",
             "if False:"),
    Sabotage("solver_first_obligation_only", "the solver weighs only the first open obligation "
             "of each stage", "verdict/solve.py",
             "solver.add(z3.Or([o for _, _, o in open_]))",
             "solver.add(z3.Or([o for _, _, o in open_[:1]]))"),
)

ORACLE_TESTS = ["tests/test_oracle.py", "-k",
                "canaries or single_device or solver or ceiling"]


HARNESS_ARGS = {False: ["--bases", "mlp_dp2_pp2_tp2_nm2,mlp_sgd_dp2_tp2_nm2", "--per-operator", "4"],
                True: ["--quick"]}


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for name in subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split():
        src = ROOT / name
        if src.is_file() and src.suffix in (".py", ".json"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def apply(dest: Path, s: Sabotage) -> None:
    path = dest / s.path
    text = path.read_text()
    if text.count(s.old) != 1:
        raise SystemExit(f"sabotage {s.name}: the text to change is not in {s.path} once")
    path.write_text(text.replace(s.old, s.new))


def check(dest: Path, args: list[str]) -> tuple[bool, str]:
    """(noticed, the lines that say so)."""
    try:
        done = subprocess.run([sys.executable, *args], cwd=dest, capture_output=True,
                              text=True, timeout=2400)
    except subprocess.TimeoutExpired:
        return False, "no result in 40 minutes"
    out = done.stdout + done.stderr
    keys = ("FAILED", "!!", "blind spot", "wrong SUCCESS,", "harness blindness")
    lines = [ln.strip() for ln in out.splitlines() if any(k in ln for k in keys)]
    return done.returncode != 0, "; ".join(lines[:6])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="these sabotages only (comma-separated)")
    ap.add_argument("--quick", action="store_true",
                    help="run the harness's whole --quick subset, not the two mlp bases")
    args = ap.parse_args(argv)
    chosen = [s for s in SABOTAGES if not args.only or s.name in args.only.split(",")]
    missed = 0
    for s in chosen:
        with tempfile.TemporaryDirectory(prefix="sabotage-") as tmp:
            dest = Path(tmp)
            copy_tree(dest)
            apply(dest, s)
            start = time.perf_counter()
            tests = check(dest, ["-m", "pytest", "-q", "-p", "no:cacheprovider", *ORACLE_TESTS])
            harness = check(dest, ["scripts/mutate.py", *HARNESS_ARGS[args.quick]])
            took = time.perf_counter() - start
        print(f"## {s.name}: {s.what} ({took:.0f} s)")
        print(f"   oracle tests: {'CAUGHT' if tests[0] else 'missed'}  {tests[1]}")
        said = "CAUGHT" if harness[0] else "missed"
        print(f"   mutate.py {' '.join(HARNESS_ARGS[args.quick])}: {said}  {harness[1]}")
        if not (tests[0] or harness[0]):
            missed += 1
        sys.stdout.flush()
    print(f"{len(chosen) - missed} of {len(chosen)} sabotages caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
