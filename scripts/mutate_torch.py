"""Mutation testing on traced PyTorch plans: no wrong SUCCESS, no false alarm.

    .venv/bin/python scripts/mutate_torch.py --sm S.pkl --pm P.pkl [--per-operator N]

applies every operator of gen_model/mutations.py (and every rewrite) to a
parallel plan written by ``python -m backends.torch``, judges each mutant
with the oracle (gen_model/oracle.py: runs it in float64 and trusts no
claim of a computed tensor) and verifies it, exactly as scripts/mutate.py
does for the generator's plans. Exit 1 on any wrong SUCCESS, false alarm or
run without a verdict.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutate import Row, run_one, table  # noqa: E402

from backends.planfile import load_plan  # noqa: E402
from gen_model.mutations import MUTATIONS, REWRITES  # noqa: E402
from gen_model.oracle import judge  # noqa: E402


def run(single, plan, base: str, per_operator: int, seed: int) -> list[Row]:
    memo: dict = {}
    if run_one(single, plan, memo) != "SUCCESS" or not judge(single, plan).right:
        raise SystemExit(f"base plan {base} does not verify: the harness needs a good base")
    rows = []
    operators = [("mutation", n, f) for n, f in MUTATIONS.items()]
    operators += [("rewrite", n, f) for n, f in REWRITES.items()]
    for kind, name, operator in operators:
        for k in range(per_operator):
            made = operator(plan, random.Random(f"{seed}/{base}/{name}/{k}"))
            if made is None:
                break
            mutant, target = made
            start = time.perf_counter()
            oracle = "right" if judge(single, mutant).right else "wrong"
            verdict = run_one(single, mutant, memo)
            row = Row(base, kind, name, target, oracle, verdict, time.perf_counter() - start)
            rows.append(row)
            if row.outcome in ("WRONG SUCCESS", "FALSE ALARM", "NO VERDICT"):
                print(f"  !! {row.outcome}: {name}: {target} ({verdict})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", required=True, type=Path)
    ap.add_argument("--pm", required=True, type=Path)
    ap.add_argument("--per-operator", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    single, plan = load_plan(args.sm), load_plan(args.pm)
    start = time.perf_counter()
    rows = run(single, plan, args.pm.stem, args.per_operator, args.seed)
    for line in table(rows):
        print(line)
    bad = [r for r in rows if r.outcome in ("WRONG SUCCESS", "FALSE ALARM", "NO VERDICT")]
    print(f"{sum(r.kind == 'mutation' for r in rows)} mutants, "
          f"{sum(r.kind == 'rewrite' for r in rows)} rewrites in "
          f"{time.perf_counter() - start:.0f} s: "
          f"{sum(r.outcome == 'WRONG SUCCESS' for r in rows)} wrong SUCCESS, "
          f"{sum(r.outcome == 'FALSE ALARM' for r in rows)} false alarms, "
          f"{sum(r.outcome == 'NO VERDICT' for r in rows)} without a verdict")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
