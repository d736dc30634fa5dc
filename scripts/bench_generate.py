"""Time and peak memory of plan generation, each case in a fresh process.

    .venv/bin/python scripts/bench_generate.py

Appends rows to data/stats/bench_generate.csv and prints a table.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verdict.report import append_rows

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "llama3-8B single (ly32 h32 hi4096 sq128 gbs512)": [
        "--model", "llama3", "--layers", "32", "--heads", "32", "--hidden", "4096",
        "--seqlen", "128", "--gbs", "512", "--ffn", "14336",
    ],
    "llama3 ly32 h32 hi128 sq8192 gbs32 dp2 pp2 tp2 nm2": [
        "--model", "llama3", "--layers", "32", "--heads", "32", "--hidden", "128",
        "--seqlen", "8192", "--gbs", "32", "--dp", "2", "--pp", "2", "--tp", "2", "--nm", "2",
    ],
    "llama3 ly32 h32 hi128 sq8192 gbs32 single": [
        "--model", "llama3", "--layers", "32", "--heads", "32", "--hidden", "128",
        "--seqlen", "8192", "--gbs", "32",
    ],
}


#: The child process that generates: gen_model's CLI, then its peak RSS in KiB.
GENERATE_CHILD = (
    "import resource, runpy, sys\n"
    "sys.argv = ['gen_model', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('gen_model', run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    if e.code:\n"
    "        raise\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)


def run(flags: list[str], out: Path) -> tuple[float, float, int]:
    """Wall seconds, peak RSS of the generating process in MiB, plan file bytes."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", GENERATE_CHILD, *flags, "-o", str(out)],
                          cwd=ROOT, check=True, capture_output=True, text=True)
    took = time.perf_counter() - start
    peak_kib = int(done.stdout.strip().splitlines()[-1])
    size = sum(p.stat().st_size for p in out.glob("*.pkl"))
    return took, peak_kib / 1024, size


def main() -> None:
    rows = []
    machine = f"{platform.machine()} cpus={os.cpu_count()}"
    for name, flags in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            took, peak, size = run(flags, Path(tmp))
        rows.append({"case": name, "seconds": f"{took:.2f}", "peak_rss_mib": f"{peak:.0f}",
                     "plan_mib": f"{size / 2**20:.1f}", "machine": machine,
                     "date": time.strftime("%Y-%m-%d")})
        print(f"{name}: {took:.2f} s, peak {peak:.0f} MiB, plan {size / 2**20:.1f} MiB")
    append_rows(ROOT / "data" / "stats" / "bench_generate.csv", rows)

if __name__ == "__main__":
    main()
