"""Bugs that shipped, injected into plans that otherwise verify (docs/real-bugs.md).

    .venv/bin/python scripts/real_bugs.py [--out DIR] [--logs DIR] [KEY ...]

For each bug of harness/real_bugs.py and harness/seq_bugs.py (all, or
the KEYs given): writes the
single-device plan, the clean base plan and the injected plan under DIR,
runs `main.py` on the clean pair (must exit 0) and on the injected one
(must exit 1), keeps each log under LOGS, and prints one line per plan:
exit code and the first ❌ line of the log. Exit status 0 when every clean
plan verifies and every injected plan is caught.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.planfile import save_plan  # noqa: E402
from harness.real_bugs import BUGS as FRAMEWORK_BUGS  # noqa: E402
from harness.seq_bugs import SEQ_BUGS  # noqa: E402

BUGS = {**FRAMEWORK_BUGS, **SEQ_BUGS}


def run(sm: Path, pm: Path, log: Path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), "--sm", str(sm), "--pm",
                           str(pm), "--no_cache_stages", "--stats_dir", str(log.parent)],
                          capture_output=True, text=True, cwd=ROOT)
    log.write_text(done.stdout + done.stderr)
    first = next((line for line in done.stdout.splitlines() if line.startswith("❌")), "")
    return done.returncode, first or next(
        (line for line in done.stdout.splitlines() if "✅" in line), "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("keys", nargs="*", help="bugs to run (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "gen_model" / "mgeners" / "real")
    ap.add_argument("--logs", type=Path, default=ROOT / "data" / "logs" / "real")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.logs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    bad = 0
    print(f"{'bug':18} {'plan':6} exit  first line")
    for key in args.keys or list(BUGS):
        bug = BUGS[key]
        base = bug.base()
        sm, _ = save_plan(bug.single(), args.out / f"{key}_single.pkl")
        pm, _ = save_plan(base, args.out / f"{key}_clean.pkl")
        bm, _ = save_plan(bug.plan(base), args.out / f"{key}_bug.pkl")
        for kind, plan, want in (("clean", pm, 0), ("bug", bm, 1)):
            code, line = run(sm, plan, args.logs / f"{key}_{kind}.log")
            bad += code != want
            print(f"{key:18} {kind:6} {code}{'' if code == want else ' (!)'}     {line}",
                  flush=True)
    took = time.perf_counter() - start
    print(f"{len(args.keys or BUGS)} bugs, {bad} unexpected exit codes, {took:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
