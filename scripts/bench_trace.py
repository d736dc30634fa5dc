"""How the torch backend's tracing scales with the mesh: wall seconds to
trace every rank (one process per rank, backends/torch/tracer/ranks.py), to lower
and build the plans, and to verify them, for meshes of 4 and 8 ranks of the
same model and recipe, and the CPU seconds of the ranks' processes (which,
unlike wall seconds, hold under load).

    .venv/bin/python scripts/bench_trace.py [-k SUBSTRING ...]

Prints one markdown table row per case (paste into docs/benchmarks.md) and
a header line with the commit, the date and the load average, which these
figures depend on (the ranks' processes share the machine's cores).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.torch.__main__ import model_kwargs, resolve  # noqa: E402
from backends.torch.__main__ import parser as backend_parser  # noqa: E402
from backends.torch.lowering import LoweringError, lower_ranks, lower_trace  # noqa: E402
from backends.torch.tracer.build import build_plans  # noqa: E402
from backends.torch.tracer.rank import run  # noqa: E402
from backends.torch.tracer.ranks import trace_ranks  # noqa: E402
from main import verify  # noqa: E402

TITAN = ("--model backends.torch.titan:llama3_debugmodel --recipe backends.torch.titan:parallelize "
         "--vocab 2048")
DIST_OPT = ("--model backends.torch.megatron:gpt --recipe backends.torch.megatron:dist_opt "
            "--batch 8 --hidden 24")
CLIP = "--clipper backends.torch.megatron:clip_grad_norm"
#: (case, arguments of ``python -m backends.torch``)
CASES: list[tuple[str, str]] = [
    ("llama fsdp_tp 4 ranks", "--recipe fsdp_tp --dp 2 --tp 2"),
    ("llama fsdp_tp 8 ranks", "--recipe fsdp_tp --dp 4 --tp 2 --batch 8"),
    ("llama pp_gpipe 4 ranks", "--recipe pp_gpipe --pp 2 --dp 2 --tp 1 --layers 2"),
    ("llama pp_gpipe 8 ranks", "--recipe pp_gpipe --pp 2 --dp 4 --tp 1 --layers 2 --batch 8"),
    ("hf llama 4 ranks", "--hf llama --dp 2 --tp 2"),
    ("hf llama 8 ranks", "--hf llama --dp 4 --tp 2 --batch 8"),
    ("titan debugmodel 4 ranks", f"{TITAN} --dp 2 --tp 2"),
    ("titan debugmodel 8 ranks", f"{TITAN} --dp 4 --tp 2 --batch 8"),
    ("titan debugmodel tp2 pp2 4 ranks", f"{TITAN} --dp 1 --tp 2 --pp 2 --batch 4"),
    ("titan debugmodel dp2 tp2 pp2 8 ranks", f"{TITAN} --dp 2 --tp 2 --pp 2 --batch 8"),
    # the production-mesh targets of docs/benchmarks.md ("Tracing a 64-rank step")
    # (pp 2: backends/torch/zoo/titan.py runs torchtitan's 1F1B with 2 microbatches,
    # which refuses more stages than microbatches)
    ("titan debugmodel dp4 tp2 pp2 16 ranks", f"{TITAN} --dp 4 --tp 2 --pp 2 --batch 16"),
    ("titan debugmodel dp8 tp4 pp2 64 ranks", f"{TITAN} --dp 8 --tp 4 --pp 2 --batch 32"),
    ("titan debugmodel 8 layers dp4 tp4 pp4 64 ranks",
     f"{TITAN} --dp 4 --tp 4 --pp 4 --layers 8 --batch 16"),
    ("titan debugmodel 8 layers dp16 tp4 pp4 256 ranks",
     f"{TITAN} --dp 16 --tp 4 --pp 4 --layers 8 --batch 64"),
    # Megatron-Core's distributed optimizer (docs/soundness.md, 56-59), with its clipping
    # over the shards (79-81): `-k "megatron dist_opt"`
    ("megatron dist_opt dp2", f"{DIST_OPT} --dp 2 --tp 1"),
    ("megatron dist_opt dp2 tp2", f"{DIST_OPT} --dp 2 --tp 2"),
    ("megatron dist_opt dp2 clip", f"{DIST_OPT} --dp 2 --tp 1 --clip 0.5 {CLIP}"),
    ("megatron dist_opt dp2 tp2 clip", f"{DIST_OPT} --dp 2 --tp 2 --clip 0.1 {CLIP}"),
]


def spec_of(args: argparse.Namespace) -> dict:
    kw = model_kwargs(args)
    return {"model": args.model, "model_kwargs": kw, "recipe": args.recipe, "dp": args.dp,
            "tp": args.tp, "pp": args.pp, "batch": args.batch, "seqlen": args.seqlen,
            "vocab": args.vocab, "seed": args.seed, "optimizer": args.optimizer,
            "clip": args.clip, "clipper": args.clipper}


def measure(argv: str) -> dict:
    """Seconds of each phase of one case, and the verdict."""
    args = resolve(backend_parser().parse_args(shlex.split(argv)))
    spec = spec_of(args)
    world_size = args.pp * args.dp * args.tp
    t0 = time.perf_counter()
    single = run({**spec, "parallel": False}, 0)
    t1 = time.perf_counter()
    try:
        traces = trace_ranks({**spec, "parallel": True}, world_size, single["imports"])
    except LoweringError as e:
        return {"ranks": world_size, "single": t1 - t0, "ranks_s": time.perf_counter() - t1,
                "ranks_cpu": float("nan"), "build": 0.0, "verify": 0.0, "verdict": f"refused: {e}"}
    t2 = time.perf_counter()
    world = {"model": args.model, "variant": "torch", "gbs": args.batch, "dp": args.dp,
             "tp": args.tp, "pp": args.pp, "ep": 1, "nm": traces[0]["microbatches"],
             "recipe": args.recipe, **spec["model_kwargs"]}
    times = {"ranks": world_size, "single": t1 - t0, "ranks_s": t2 - t1,
             "ranks_cpu": traces[0]["processes_cpu"], "build": 0.0, "verify": 0.0}
    try:
        plan_s, plan_p = build_plans(lower_trace(single, args.vocab),
                                     lower_ranks(traces, args.vocab), world)
    except LoweringError as e:
        return {**times, "build": time.perf_counter() - t2, "verdict": f"refused: {e}"}
    t3 = time.perf_counter()
    verdict = verify(plan_s, plan_p)
    t4 = time.perf_counter()
    return {**times, "build": t3 - t2, "verify": t4 - t3,
            "verdict": "SUCCESS" if verdict.success else "FAIL"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", action="append", default=[], help="run the cases whose name contains this")
    opts = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    print("| case | ranks | single-device trace | rank traces | their CPU | lower + build | verify "
          "| verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for name, argv_case in CASES:
        if opts.k and not any(k in name for k in opts.k):
            continue
        m = measure(argv_case)
        print(f"| {name} | {m['ranks']} | {m['single']:.1f} s | {m['ranks_s']:.1f} s | "
              f"{m['ranks_cpu']:.1f} s | {m['build']:.1f} s | {m['verify']:.1f} s | "
              f"{m['verdict']} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
