"""Where the time and memory of verifying a materialized columnar plan go.

    .venv/bin/python scripts/profile_verify.py SINGLE.pkl PARALLEL.npz [--steps]

Runs the phases main.py runs before the representatives' proof, one after
the other, and prints for each its wall and CPU seconds (this process: the
figure to compare on a loaded machine), the peak of Python-tracked
allocations during it (tracemalloc: numpy arrays included, the file's
memory-mapped pages not), what it leaves allocated, and the process's PSS
(mapped pages included) at its start and its highest during it, sampled;
then the bytes per node of the block check's arrays. Phases: open and validate the file, the
block check's arrays, the check, the representatives' cut. With --steps, each step of the
check's first pass also prints its wall and CPU seconds and the tracemalloc bytes per node at its start,
its peak and its end (the run phase's own peak is then that of its last step). The figures go
to docs/benchmarks.md ("Columnar plans, materialized").
"""

from __future__ import annotations

import argparse
import functools
import re
import resource
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.columnar import load_columns_file  # noqa: E402
from backends.planfile import load_plan  # noqa: E402
from verdict.symmetry.blocks import BlockCheck  # noqa: E402
from verdict.symmetry.cut import Cut  # noqa: E402
from verdict.symmetry.fold import SHOWN, Fold  # noqa: E402


def pss() -> int:
    """This process's proportional resident bytes (mapped file pages included)."""
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"^Pss:\s+(\d+)", rollup, re.M).group(1)) * 1024


class PssPeak:
    """The highest PSS seen since the last reset, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.sample, daemon=True).start()

    def sample(self) -> None:
        while True:
            now = pss()
            with self.lock:
                self.peak = max(self.peak, now)
            time.sleep(0.02)

    def reset(self) -> int:
        with self.lock:
            self.peak = pss()
            return self.peak


def phase(name: str, nodes: int, run: Callable[[], Any], sampler: PssPeak) -> Any:
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    start_pss = sampler.reset()
    start, cpu = time.perf_counter(), time.process_time()
    out = run()
    took, cpu = time.perf_counter() - start, time.process_time() - cpu
    now, peak = tracemalloc.get_traced_memory()
    print(f"{name:<28} {took:8.2f} s ({cpu:6.2f} s CPU)  peak {(peak - before) / 2**20:8.0f} MiB "
          f"({(peak - before) / nodes:6.0f} B/node)  kept {(now - before) / 2**20:8.0f} MiB  "
          f"PSS {start_pss / nodes:5.0f} -> peak {sampler.peak / nodes:5.0f} B/node",
          flush=True)
    return out


#: The block check's steps that --steps reports, in the order the first pass runs them.
STEPS = ("check_offsets", "input_views", "representatives", "check_chains", "orbits",
         "check_kwargs", "check_entries", "check_glue")


def report_steps(nodes: int) -> None:
    """Make each of BlockCheck's STEPS print its seconds and tracemalloc
    bytes per node (start, peak, end) when it returns."""
    for name in STEPS:
        method = getattr(BlockCheck, name)

        @functools.wraps(method)
        def timed(*args: Any, _method: Callable = method, _name: str = name, **kwargs: Any) -> Any:
            start_bytes = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            start, cpu = time.perf_counter(), time.process_time()
            out = _method(*args, **kwargs)
            now, peak = tracemalloc.get_traced_memory()
            print(f"  {_name:<26} {time.perf_counter() - start:8.2f} s "
                  f"({time.process_time() - cpu:6.2f} s CPU)  B/node: start "
                  f"{start_bytes / nodes:5.0f}, peak {peak / nodes:5.0f}, end {now / nodes:5.0f}",
                  flush=True)
            return out

        setattr(BlockCheck, name, timed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("single", type=Path)
    p.add_argument("parallel", type=Path)
    p.add_argument("--steps", action="store_true",
                   help="also report each step of the block check (tracemalloc, B/node)")
    args = p.parse_args()
    single = load_plan(args.single)
    tracemalloc.start()
    cols = load_columns_file(args.parallel)
    nodes = len(cols.nodes)
    print(f"{nodes} nodes, {len(cols.tensors)} tensors, {len(cols.nodes.inputs)} input entries; "
          f"file {args.parallel.stat().st_size / nodes:.0f} B/node", flush=True)
    tracemalloc.reset_peak()
    sampler = PssPeak()
    phase("open and validate", nodes, lambda: load_columns_file(args.parallel), sampler)
    w = cols.world
    dp, nm, gbs = w.get("dp", 1), w.get("nm", 1), w["gbs"]
    check = phase("block check: arrays", nodes,
                  lambda: BlockCheck(single, cols, Fold(dp, nm, gbs, dp, nm, gbs)), sampler)
    sizes = {k: v.nbytes for k, v in vars(check.cols).items() if isinstance(v, np.ndarray)}
    print("  arrays:", ", ".join(f"{k} {v / nodes:.1f}" for k, v in
                                 sorted(sizes.items(), key=lambda kv: -kv[1])),
          f"= {sum(sizes.values()) / nodes:.0f} B/node", flush=True)
    if args.steps:
        report_steps(nodes)
    phase("block check: run", nodes, check.run, sampler)
    check.finish()
    shown = Fold(min(dp, SHOWN), min(nm, SHOWN), min(dp, SHOWN) * min(nm, SHOWN) * check.rows,
                 dp, nm, gbs)
    phase("representatives' cut", nodes, lambda: Cut(cols, check, shown).plan(), sampler)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak resident {rss / 2**20:.2f} GiB ({rss * 1024 / nodes:.0f} B/node), "
          f"mapped file pages included", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
