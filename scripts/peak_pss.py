"""Peak proportional resident memory of a command, its child processes included.

    .venv/bin/python scripts/peak_pss.py [--every 0.05] -- COMMAND ...

Runs COMMAND, samples the summed PSS (``/proc/PID/smaps_rollup``) of it and
every process it forked every ``--every`` seconds, and prints its exit code,
wall and CPU seconds (children included) and the highest sum seen, in MiB.
Forked workers share pages copy-on-write with their parent: PSS counts such
a page once in all, a sum of plain RSS once per process. The figures go to
docs/benchmarks.md ("Columnar plans, materialized").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def tree_pss_kib(pid: int) -> int:
    """PSS KiB of ``pid`` and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            total += int(re.search(r"^Pss:\s+(\d+)", rollup, re.M).group(1))
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (OSError, AttributeError):
            continue
        stack.extend(int(c) for c in children)
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=float, default=0.05, help="seconds between samples")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command")
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    peak = 0
    while True:
        done, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if done == proc.pid:
            break
        peak = max(peak, tree_pss_kib(proc.pid))
        time.sleep(args.every)
    proc.returncode = os.waitstatus_to_exitcode(status)
    print(f"exit {proc.returncode}, {time.perf_counter() - start:.1f} s wall, "
          f"{usage.ru_utime + usage.ru_stime:.1f} s CPU, peak PSS {peak / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
