"""A plan with one wrong replica: replica D loads replica D - 1's batch rows.

    .venv/bin/python scripts/wrong_replica.py IN OUT --replica D

For the benchmark of a materialized plan with one wrong replica
(scripts/run_symmetry_bench.sh). IN is a plan file; OUT (.pkl or .npz) the
same plan with every data and tokens input of replica D given the slices of
the same input on the same rank of replica D - 1: replica D trains on
replica D - 1's rows, and some rows on none.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.planfile import load_plan, save_plan  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("target", type=Path)
    p.add_argument("--replica", type=int, default=3)
    args = p.parse_args()
    plan = load_plan(args.source)
    w = plan.world
    inner = int(w.get("tp", 1)) * int(w.get("cp", 1))
    dp = int(w.get("dp", 1))
    if not 1 <= args.replica < dp:
        print(f"error: --replica must be in 1..{dp - 1}", file=sys.stderr)
        return 2
    written = {o for n in plan.nodes for o in n.outputs}
    data = [i for i, t in enumerate(plan.tensors) if i not in written
            and plan.logical[t.tid].kind in ("data", "tokens")]
    source = {(t.rank, t.mb, t.tid, t.version): t.slices
              for t in (plan.tensors[i] for i in data)
              if (t.rank // inner) % dp == args.replica - 1}
    changed = 0
    for i in data:
        t = plan.tensors[i]
        key = (t.rank - inner, t.mb, t.tid, t.version)
        if (t.rank // inner) % dp == args.replica and key in source:
            plan.tensors[i] = t._replace(slices=source[key])
            changed += 1
    save_plan(plan, args.target)
    print(f"wrote {args.target}: {changed} inputs of replica {args.replica} moved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
