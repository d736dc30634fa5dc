"""Time and peak memory of verification, each case in a fresh process.

    .venv/bin/python scripts/bench_verify.py [--workers 2]

Generates the plans (not timed), then runs main.py --no_cache_nodes
--no_cache_stages --max_vrf_proc N on each pair. Appends rows to
data/stats/bench_verify.csv and prints a table.
"""

from __future__ import annotations

import argparse
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
    "mlp demo ly2 hi128 gbs128 dp2 pp2 tp2 nm2": [
        "--model", "mlp", "--layers", "2", "--hidden", "128", "--gbs", "128"],
    "llama3 ly2 h4 hi128 sq128 gbs32 dp2 pp2 tp2 nm2": [
        "--model", "llama3", "--layers", "2", "--heads", "4", "--kv_heads", "2", "--hidden", "128",
        "--seqlen", "128", "--gbs", "32"],
    "llama3 ly32 h32 hi128 sq8192 gbs32 dp2 pp2 tp2 nm2": [
        "--model", "llama3", "--layers", "32", "--heads", "32", "--hidden", "128",
        "--seqlen", "8192", "--gbs", "32"],
}
PARALLEL = ["--dp", "2", "--pp", "2", "--tp", "2", "--nm", "2"]

_CHILD = (
    "import resource, sys\n"
    "import main\n"
    "code = main.main(sys.argv[1:])\n"
    "own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "print(f'BENCH {code} {max(own, kids)}')\n"
)


def generate(flags: list[str], out: Path) -> tuple[Path, Path]:
    for extra in ([], PARALLEL):
        subprocess.run([sys.executable, "-m", "gen_model", *flags, *extra, "-o", str(out)],
                       cwd=ROOT, check=True, capture_output=True)
    single = next(out.glob("*_dp1_pp1_tp1_nm1_*.pkl"))
    parallel = next(p for p in out.glob("*.pkl") if p != single)
    return single, parallel


def verify(single: Path, parallel: Path, workers: int, stats: Path) -> tuple[float, int, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, "--sm", str(single), "--pm", str(parallel),
         "--max_vrf_proc", str(workers), "--no_cache_nodes", "--no_cache_stages",
         "--stats_dir", str(stats)],
        cwd=ROOT, capture_output=True, text=True)
    took = time.perf_counter() - start
    line = next(x for x in done.stdout.splitlines() if x.startswith("BENCH"))
    _, code, peak = line.split()
    return took, int(code), int(peak) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name, flags in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            single, parallel = generate(flags, Path(tmp))
            took, code, peak = verify(single, parallel, args.workers, ROOT / "data" / "stats")
        rows.append({"case": name, "exit": code, "seconds": f"{took:.2f}",
                     "peak_rss_mib": f"{peak:.0f}", "workers": args.workers,
                     "machine": f"{platform.machine()} cpus={os.cpu_count()}",
                     "date": time.strftime("%Y-%m-%d")})
        print(f"{name}: exit {code}, {took:.2f} s, peak {peak:.0f} MiB")
    append_rows(ROOT / "data" / "stats" / "bench_verify.csv", rows)

if __name__ == "__main__":
    main()
