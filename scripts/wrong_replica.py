"""A plan with one wrong replica: replica D loads replica D - 1's batch rows,
or (``--op``) runs another operator.

    .venv/bin/python scripts/wrong_replica.py IN.npz OUT.npz --replica D [--op]

For the benchmark of a materialized plan with one wrong replica
(scripts/run_symmetry_bench.sh). IN is a columnar plan file; OUT the same
plan with every data and tokens input of replica D given the slices of the
same input on the same rank of replica D - 1: replica D trains on replica
D - 1's rows, and some rows on none. With ``--op``, every ``div`` node of
replica D (every rank, microbatch and direction) multiplies by its value
instead: its rows load right, its program is wrong (a replica class of its
own, docs/soundness.md). Works on the columns (array operations), so a plan
of millions of nodes is rewritten in seconds.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.columnar import load_columns_file, save_columns  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("target", type=Path)
    p.add_argument("--replica", type=int, default=3)
    p.add_argument("--op", action="store_true",
                   help="replica D's div nodes multiply instead (rows unchanged)")
    args = p.parse_args()
    cols = load_columns_file(args.source)
    w = cols.world
    inner = int(w.get("tp", 1)) * int(w.get("cp", 1))
    dp = int(w.get("dp", 1))
    if not 1 <= args.replica < dp:
        print(f"error: --replica must be in 1..{dp - 1}", file=sys.stderr)
        return 2
    if args.op:
        return changed_op(cols, args.target, args.replica, inner, dp)
    t = cols.tensors
    written = np.zeros(len(t), dtype=bool)
    out = np.asarray(cols.nodes.outputs)
    written[out[out >= 0]] = True
    is_data = np.array([lg.kind in ("data", "tokens") for lg in cols.logical])[t.tid] & ~written
    replica = (np.asarray(t.rank) // inner) % dp
    off = t.slice_offsets(cols.logical)

    def keys(idx: np.ndarray, shift: int) -> list[tuple]:
        return list(zip((t.rank[idx] - shift).tolist(), t.mb[idx].tolist(), t.tid[idx].tolist(),
                        t.version[idx].tolist()))

    source = np.flatnonzero(is_data & (replica == args.replica - 1))
    where = dict(zip(keys(source, 0), source.tolist()))
    slices = np.array(t.slices)
    moved = 0
    for i, key in zip(np.flatnonzero(is_data & (replica == args.replica)).tolist(),
                      keys(np.flatnonzero(is_data & (replica == args.replica)), inner)):
        j = where.get(key)
        if j is not None:
            slices[off[i]:off[i + 1]] = slices[off[j]:off[j + 1]]
            moved += 1
    save_columns(replace(cols, tensors=replace(t, slices=slices)), args.target)
    print(f"wrote {args.target}: {moved} inputs of replica {args.replica} moved")
    return 0


def changed_op(cols, target: Path, replica: int, inner: int, dp: int) -> int:
    """Every div node of ``replica`` made a mul_scalar with the same value."""
    n = cols.nodes
    if "div" not in cols.ops:
        print("error: the plan has no div node", file=sys.stderr)
        return 2
    ops = cols.ops if "mul_scalar" in cols.ops else (*cols.ops, "mul_scalar")
    op = np.array(n.op)
    hit = (op == ops.index("div")) & ((np.asarray(n.rank) // inner) % dp == replica)
    op[hit] = ops.index("mul_scalar")
    save_columns(replace(cols, ops=ops, nodes=replace(n, op=op.astype(np.asarray(n.op).dtype))),
                 target)
    print(f"wrote {target}: {int(hit.sum())} div nodes of replica {replica} multiply instead")
    return 0


if __name__ == "__main__":
    sys.exit(main())
