"""The cost of running stage proofs on Ray instead of the local process pool.

    .venv/bin/python scripts/bench_ray.py [--repeat 3]

Generates the llama3 ly32 h32 hi128 sq8192 gbs32 dp2 pp2 tp2 nm2 plan and
its single-device twin (not timed), then verifies the pair in a fresh
process each time (no caches) with: the process pool (--max_vrf_proc 2);
Ray with a local instance started by the run (--executor ray); and Ray
against a cluster already running (`ray start --head` on the loopback
address, 2 CPUs; its start is not timed). Prints the median wall time and
the median t_vrf (the proof phase, Ray's start and connection included) of
each, and appends rows to data/stats/bench_ray.csv.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verdict.report import append_rows  # noqa: E402

SIZE = ["--model", "llama3", "--layers", "32", "--heads", "32", "--hidden", "128",
        "--seqlen", "8192", "--gbs", "32"]
PARALLEL = ["--dp", "2", "--pp", "2", "--tp", "2", "--nm", "2"]
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_AUTH_MODE": "token"}  # the head makes ~/.ray/auth_token if there is none


def generate(out: Path) -> tuple[Path, Path]:
    for extra in ([], PARALLEL):
        subprocess.run([sys.executable, "-m", "gen_model", *SIZE, *extra, "-o", str(out)],
                       cwd=ROOT, check=True, capture_output=True)
    single = next(out.glob("llama3_default_dp1_*.pkl"))
    parallel = next(out.glob("llama3_default_dp2_*.pkl"))
    return single, parallel


def verify(single: Path, parallel: Path, extra: list[str], stats: Path) -> tuple[float, float]:
    """Wall seconds of the run and its t_vrf."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "main.py", "--sm", str(single), "--pm", str(parallel),
                           "--max_vrf_proc", "2", "--no_cache_nodes", "--no_cache_stages",
                           "--stats_dir", str(stats), *extra],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **RAY_ENV})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{extra}: exit {done.returncode}: {done.stderr.strip()}")
    return wall, float(re.search(r"t_vrf=([0-9.]+)", done.stdout).group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(ray_bin: str, port: int, env: dict) -> subprocess.Popen:
    """A Ray head on the loopback address, in its own process group (stopped
    by signalling that group, not by `ray stop`, which stops every Ray
    instance of the user); returns once it accepts connections."""
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--node-ip-address",
                             "127.0.0.1", "--port", str(port), "--num-cpus", "2",
                             "--include-dashboard", "false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                time.sleep(2)  # the raylet registers after the GCS listens
                return head
        time.sleep(0.5)
    os.killpg(head.pid, signal.SIGTERM)
    raise SystemExit("the Ray head did not start in 120 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, **RAY_ENV}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        single, parallel = generate(Path(tmp))
        port = free_port()
        cases = [("process pool", []), ("ray, local instance", ["--executor", "ray"]),
                 ("ray, running cluster", ["--executor", "ray", "--ray-address", f"127.0.0.1:{port}"])]
        head = start_head(ray_bin, port, env)
        try:
            for name, extra in cases:
                runs = [verify(single, parallel, extra, Path(tmp) / "stats")
                        for _ in range(args.repeat)]
                wall = statistics.median(r[0] for r in runs)
                vrf = statistics.median(r[1] for r in runs)
                print(f"{name:22s} wall {wall:6.2f} s   t_vrf {vrf:6.2f} s   "
                      f"(runs: {', '.join(f'{w:.2f}' for w, _ in runs)})")
                rows.append({"case": name, "repeat": args.repeat, "wall_s": round(wall, 3),
                             "t_vrf_s": round(vrf, 3), "load": os.getloadavg()[0]})
        finally:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(60)
    append_rows(ROOT / "data" / "stats" / "bench_ray.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
