"""Where a value that Python read came from: the words a refusal of
data-dependent control flow adds to name the choice it depends on
(``constants.check_no_value_reads``).

A step whose path Python chose by reading a computed tensor is refused
(the trace holds one path). Top-k routing is no such read: its indices
are recorded and replayed (docs/soundness.md, "Plans traced from
PyTorch", 36). A routing chosen otherwise (the index of a maximum, a
sort, a draw at random) stays a value read; this module finds, walking
back from the value read through the events that made it, the nearest op
that chose indices by value, and whether random draws fed it, so the
refusal names the op and its module (item 109).
"""

from __future__ import annotations

from typing import Any

#: ops whose output is an index chosen by the values of their input
CHOOSERS = frozenset({
    "aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default",
    "aten.sort.default", "aten.sort.stable", "aten.argsort.default", "aten.argsort.stable",
    "aten.topk.default", "aten.multinomial.default", "aten.kthvalue.default",
    "aten.mode.default",
})

#: ops that draw random numbers
RANDOM = frozenset({
    "aten.exponential_.default", "aten.uniform_.default", "aten.normal_.default",
    "aten.bernoulli_.float", "aten.bernoulli.default", "aten.bernoulli_.Tensor",
    "aten.rand_like.default", "aten.randn_like.default", "aten.rand.default",
    "aten.randn.default", "aten.multinomial.default", "aten.randint_like.default",
})


def _ids(args: Any) -> list[int]:
    """The tensor ids an event's arguments name (``("v", id)`` pairs)."""
    if isinstance(args, (list, tuple)):
        if len(args) == 2 and args[0] == "v" and isinstance(args[1], int):
            return [args[1]]
        return [v for a in args for v in _ids(a)]
    if isinstance(args, dict):
        return [v for a in args.values() for v in _ids(a)]
    return []


def _ancestors(events: list, upto: int, start: list[int]) -> list[int]:
    """The indices of the events before ``upto`` that made ``start`` or
    what they read, nearest first (an in-place op counts as a maker of
    the tensor it writes)."""
    wanted, found = set(start), []
    for i in range(upto - 1, -1, -1):
        op, (args, kwargs), outs, *_ = events[i]
        written = set(outs or ()) | ({_ids(args)[0]} if op.endswith("_.default") and _ids(args)
                                     else set())
        if written & wanted:
            found.append(i)
            wanted |= set(_ids([args, kwargs]))
    return found


def origin(events: list, at: int) -> str:
    """Words naming what the value read at event ``at`` was made from: the
    indices the nearest op that chose them by value chose, its module, and
    the random draws feeding it; "" when no such op made it."""
    op, (args, kwargs), *_ = events[at]
    made = _ancestors(events, at, _ids([args, kwargs]))
    chooser = next((i for i in made if events[i][0] in CHOOSERS), None)
    if chooser is None:
        return ""
    c_op, c_scope = events[chooser][0], events[chooser][4]
    drawn = sorted({events[i][0] for i in _ancestors(events, chooser + 1, list(events[chooser][2]))
                    if events[i][0] in RANDOM})
    words = f"indices chosen by {c_op} at {c_scope or 'top level'}"
    if drawn:
        words += f" of values drawn at random ({', '.join(drawn)})"
    return words
