"""One measured point: generate a single-device and a parallel plan, verify.

    .venv/bin/python scripts/run_point.py --name llama3_8B --csv data/stats/large.csv \
        --model "--model llama3 --layers 32 ..." --par "--dp 512" [--gbs 512]

Each step runs in a fresh child process. The parallel plan's generation and
its verification are timed (wall seconds) and their peak resident memory
recorded (the largest process of the step, stage workers included: the
kernel's ``ru_maxrss`` of the children). A step that passes ``--timeout``
seconds or ``--mem_gb`` of resident memory (checked twice a second, PSS
summed over its processes) is killed and the row says so. Appends one row to the
CSV (name, factor and value for the trend plots, figures per phase, exit
code, what happened); main.py appends its own Stats row to
data/stats/stats.csv. Plans go to --plans (default data/plans/points),
deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.peak_pss import tree_pss_kib  # noqa: E402
from verdict.report import append_rows  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_step(cmd: list[str], timeout: float, mem_gb: float, log: Path) -> dict:
    """Run ``cmd``; its wall time, peak RSS (MiB), exit code and fate."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        fate, peak_sum = "", 0
        while True:
            try:
                done, status, usage = os.wait4(proc.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done == proc.pid:
                break
            peak_sum = max(peak_sum, tree_pss_kib(proc.pid))
            took = time.perf_counter() - start
            if took > timeout or peak_sum > mem_gb * 2**20:
                fate = (f"killed at {took:.0f} s (timeout)" if took > timeout
                        else f"killed at {peak_sum / 2**20:.1f} GiB resident (memory limit)")
                os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
    took = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code  # reaped here, not by Popen
    return {"seconds": round(took, 2), "peak_mib": round(max(usage.ru_maxrss, peak_sum) / 1024),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "exit": code, "fate": fate}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True)
    p.add_argument("--csv", type=Path, default=ROOT / "data/stats/points.csv")
    p.add_argument("--model", required=True, help="gen_model flags of the model")
    p.add_argument("--par", required=True, help="gen_model flags of the parallelism")
    p.add_argument("--gbs", type=int, required=True)
    p.add_argument("--factor", default="", help="the factor a trend varies (for draw.py)")
    p.add_argument("--value", default="", help="its value at this point")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--mem_gb", type=float, default=16)
    p.add_argument("--plans", type=Path, default=ROOT / "data/plans/points")
    p.add_argument("--keep", action="store_true", help="keep the plan files")
    p.add_argument("--npz", action="store_true",
                   help="generate the parallel plan as a columnar file (gen_model --format npz: "
                        "by array arithmetic where it can) and verify that")
    args = p.parse_args()

    out = args.plans / args.name
    out.mkdir(parents=True, exist_ok=True)
    logs = ROOT / "data/logs/points"
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    gen = [py, "-m", "gen_model", *shlex.split(args.model), "--gbs", str(args.gbs), "-o", str(out)]
    row = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "name": args.name,
           "factor": args.factor, "value": args.value, "model": args.model, "par": args.par,
           "gbs": args.gbs, "host": platform.node(), "load": os.getloadavg()[0]}
    single = run_step(gen, args.timeout, args.mem_gb, logs / f"{args.name}.gen_single.log")
    form = ["--format", "npz"] if args.npz else []
    parallel = run_step([*gen, *shlex.split(args.par), *form], args.timeout, args.mem_gb,
                        logs / f"{args.name}.gen.log")
    text = (logs / f"{args.name}.gen.log").read_text()
    nodes = re.search(r"\((\d+) nodes", text)
    row.update(nodes=nodes.group(1) if nodes else "", gen_s=parallel["seconds"],
               gen_cpu_s=parallel["cpu_s"], gen_mib=parallel["peak_mib"],
               gen_exit=parallel["exit"], gen_single_s=single["seconds"])
    fate = single["fate"] or parallel["fate"]
    pkls = {f.name: f for f in out.glob("*.pkl")}
    sm = next((f for n, f in pkls.items() if "_dp1_pp1_tp1_nm1_" in n), None)
    pm = next((f for n, f in pkls.items() if f != sm), None)
    verify = {"seconds": "", "peak_mib": "", "exit": "", "fate": ""}
    stats: dict = {}
    if args.npz:
        pm = next(iter(out.glob("*.npz")), None)
    if single["exit"] == 0 and parallel["exit"] == 0 and sm and pm:
        summary = out / "summary.json"
        verify = run_step([py, "main.py", "--sm", str(sm), "--pm", str(pm), "--no_cache_nodes",
                           "--no_cache_stages", "--stats_dir", str(ROOT / "data/stats"),
                           "--max_vrf_proc", str(args.workers),
                           "--json", str(summary)],
                          args.timeout, args.mem_gb, logs / f"{args.name}.verify.log")
        fate = verify["fate"]
        if summary.exists():
            stats = json.loads(summary.read_text()).get("stats", {})
    elif not fate:
        fate = "generation failed (see data/logs/points)"
    row.update(verify_s=verify["seconds"], verify_cpu_s=verify.get("cpu_s", ""),
               verify_mib=verify["peak_mib"], verify_exit=verify["exit"], fate=fate or "ok",
               **{k: stats.get(k, "") for k in ("t_graph", "t_lineage", "t_schedule", "t_vrf",
                                                "t_total", "stages", "unique_stages", "blocks")})
    append_rows(args.csv, [row])
    print(", ".join(f"{k}={v}" for k, v in row.items() if k not in ("model", "host")))
    if not args.keep:
        shutil.rmtree(out)
    return 0 if verify["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
