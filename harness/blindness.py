"""Does the mutation harness still see? Checks on its own outcomes.

"0 wrong SUCCESS" proves nothing when the oracle has gone blind: a wrong
mutant it judges right is counted "equivalent", never "WRONG SUCCESS". So
a run of scripts/mutate.py is also held to

* floors: in the ``--quick`` run (seeded, so its mutants are the same every
  time) each (base, operator) must catch at least as many mutants as
  ``harness/quick_floors.json`` records; a blinder oracle or a weaker
  operator catches fewer;
* ceilings, in every run: operators meant to change values may end
  "equivalent" (the oracle sees no difference) on at most a quarter of
  their mutants (at least 3 allowed), and all operators together on at most
  a fifth of all mutants. A scale or a drop can legitimately change nothing
  (a tensor times 2 that only shifts the cross-entropy's maximum), so the
  ceiling is a share, not zero. ``OFTEN_EQUIVALENT`` operators are harmless by
  design on some targets (docs/mutation.md) and take only the total.

The canaries (harness/canaries.py) are checked apart, in scripts/mutate.py.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

FLOORS = Path(__file__).with_name("quick_floors.json")

#: Operators some of whose targets change nothing by design: a reorder of a
#: sum's members, a swap of equal operands or of a fan-out's copies, a max
#: all-reduce as a sum (the cross-entropy's shift cancels), a tensor equal
#: across microbatches, a constant changed everywhere whose change cancels,
#: an exchange whose pieces hold equal values, a pipeline peer (another
#: tensor-parallel rank of the sending stage) that holds the same replica.
OFTEN_EQUIVALENT = frozenset({"permute_group", "swap_inputs", "swap_outputs",
                              "replace_collective", "other_microbatch",
                              "change_constant_everywhere", "drop_exchange", "wrong_peer"})
SHARE = 0.25
TOTAL_SHARE = 0.2
EQUIVALENT = ("equivalent, proved", "equivalent, failed")


def _counts(rows: Iterable) -> Counter:
    return Counter((r.base, r.operator, r.outcome) for r in rows if r.kind == "mutation")


def floors_of(rows: Iterable) -> dict[str, int]:
    """Caught mutants per "base/operator" of a run: the floors it sets."""
    counts = _counts(rows)
    keys = sorted({(b, o) for b, o, _ in counts})
    return {f"{b}/{o}": counts[(b, o, "caught")] for b, o in keys}


def below_floors(rows: list, floors: dict[str, int],
                 bases: Iterable[str] | None = None) -> list[str]:
    """The (base, operator) pairs under their floor; with ``bases``, the
    floors of those bases only (a run of part of the ``--quick`` bases)."""
    got = floors_of(rows)
    if bases is not None:
        kept = set(bases)
        floors = {key: want for key, want in floors.items() if key.split("/")[0] in kept}
    return [f"{key}: {got.get(key, 0)} caught, the floor is {want}"
            for key, want in sorted(floors.items()) if got.get(key, 0) < want]


def above_ceilings(rows: list) -> list[str]:
    mutants = [r for r in rows if r.kind == "mutation" and r.outcome != "invalid plan"]
    problems = []
    made = Counter(r.operator for r in mutants)
    equivalent = Counter(r.operator for r in mutants if r.outcome in EQUIVALENT)
    for op, n in sorted(equivalent.items()):
        limit = max(3, math.floor(SHARE * made[op]))
        if op not in OFTEN_EQUIVALENT and n > limit:
            problems.append(f"{op}: {n} of {made[op]} mutants equivalent, at most {limit}")
    total, limit = sum(equivalent.values()), max(3, math.floor(TOTAL_SHARE * len(mutants)))
    if total > limit:
        problems.append(f"{total} of {len(mutants)} mutants equivalent, at most {limit}")
    return problems


def blind_spots(rows: list, quick: bool, bases: Iterable[str] | None = None) -> list[str]:
    """Why the run looks blind, one line each; [] when it does not. With
    ``quick``, the floors of ``bases`` (all of them when None) are checked."""
    problems = above_ceilings(rows)
    if quick and FLOORS.exists():
        problems += below_floors(rows, json.loads(FLOORS.read_text()), bases)
    return problems


def write_floors(rows: list) -> None:
    FLOORS.write_text(json.dumps(floors_of(rows), indent=1, sort_keys=True) + "\n")
