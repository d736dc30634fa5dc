"""Mutation testing on traced PyTorch plans: no wrong SUCCESS, no false alarm.

    .venv/bin/python scripts/mutate_torch.py --sm S.pkl --pm P.pkl [--per-operator N]

applies every operator of harness/mutations.py (and every rewrite) to a
parallel plan written by ``python -m backends.torch``, judges each mutant
with the oracle (harness/oracle.py: runs it in float64 and trusts no
claim of a computed tensor) and verifies it, exactly as scripts/mutate.py
does for the generator's plans. Exit 1 on any wrong SUCCESS, false alarm or
run without a verdict.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutate import mutate_base, table  # noqa: E402

from backends.planfile import load_plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", required=True, type=Path)
    ap.add_argument("--pm", required=True, type=Path)
    ap.add_argument("--per-operator", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    single, plan = load_plan(args.sm), load_plan(args.pm)
    start = time.perf_counter()
    rows = mutate_base(single, plan, args.pm.stem, args.per_operator, args.seed)
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
