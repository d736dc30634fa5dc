"""Columnar plans at scale: generate, open and validate Llama3-8B shapes
(32 layers) materialized at several data-parallel sizes, each step in a
fresh process (wall time, peak resident memory).

    .venv/bin/python scripts/bench_columns.py              # dp 8, 64, 512
    .venv/bin/python scripts/bench_columns.py --dp 8 64

Per size: ``generate`` is ``python -m gen_model ... --format npz`` (the
array path of gen_model/replicate.py, written and validated); ``load`` opens
the file and validates it (backends.columnar.load_columns_file), without
making Python objects per node. Prints a Markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_generate import GENERATE_CHILD

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_8B = ["--model", "llama3", "--layers", "32", "--heads", "32", "--kv_heads", "8",
             "--hidden", "4096", "--ffn", "14336", "--vocab", "128256", "--seqlen", "8192"]


_LOAD = (
    "import resource, sys, time\n"
    "from backends.columnar import load_columns_file\n"
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "start = time.perf_counter()\n"
    "cols = load_columns_file(sys.argv[1])\n"
    "took = time.perf_counter() - start\n"
    "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "print(len(cols.nodes), len(cols.tensors), cols.nbytes(), took, before, peak)\n"
)


def generate(dp: int, out: Path) -> tuple[float, float, Path]:
    """Wall seconds, peak RSS in MiB, the file written."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", GENERATE_CHILD, *LLAMA3_8B, "--dp", str(dp),
                           "--gbs", str(dp), "--format", "npz", "-o", str(out)],
                          cwd=ROOT, check=True, capture_output=True, text=True)
    took = time.perf_counter() - start
    (path,) = out.glob("*.npz")
    return took, int(done.stdout.strip().splitlines()[-1]) / 1024, path


def load(path: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _LOAD, str(path)], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    nodes, tensors, nbytes, took, before, peak = done.stdout.split()
    return {"nodes": int(nodes), "tensors": int(tensors), "nbytes": int(nbytes),
            "seconds": float(took), "base_mib": int(before) / 1024, "peak_mib": int(peak) / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512])
    args = p.parse_args()
    print("| dp | nodes | generate (wall, peak) | file B/node | load + validate | us/node "
          "| resident B/node | load peak (interpreter) |")
    print("|---|---|---|---|---|---|---|---|")
    for dp in args.dp:
        with tempfile.TemporaryDirectory() as tmp:
            gen_s, gen_mib, path = generate(dp, Path(tmp))
            size = path.stat().st_size
            r = load(path)
        n = r["nodes"]
        print(f"| {dp} | {n:,} | {gen_s:.1f} s, {gen_mib:.0f} MiB | {size / n:.0f} "
              f"| {r['seconds']:.2f} s | {r['seconds'] / n * 1e6:.2f} | {r['nbytes'] / n:.0f} "
              f"| {r['peak_mib']:.0f} MiB ({r['base_mib']:.0f}) |", flush=True)


if __name__ == "__main__":
    main()
