"""Pending values replaced, for one call of a handler, by the values they
stand for.

Gathered rows (``routed_rowwise``), grouped rows (``grouped_rows``,
``grouped_columns``) act on a wider tensor than the recorded one: the op
is handed to the handler below with each such pending value read as that
tensor. The tensor is put in the environment under a key of its own for
the call and taken out after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@contextmanager
def standing_in(lw: Lowerer, pending: Iterable[Any], value: Callable[[Any], int],
                temp: int) -> Iterator[Callable[[Any], Any]]:
    """Put ``value(p)`` in the environment for each pending value ``p``
    (once per object), under keys from ``temp`` up; yield ``sub``, which
    rewrites recorded arguments so that a reference to such a ``p`` reads
    its stand-in. The keys are taken out when the block ends."""
    keys: dict[int, int] = {}
    for p in pending:
        if id(p) not in keys:
            key = temp + lw.next_id
            lw.next_id += 1
            lw.env[key] = value(p)
            keys[id(p)] = key

    def sub(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            if len(a) == 2 and a[0] == "v" and isinstance(a[1], int):
                p = lw.env.get(a[1])
                return ("v", keys[id(p)]) if id(p) in keys else a
            return type(a)(sub(x) for x in a)
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        return a

    try:
        yield sub
    finally:
        for key in keys.values():
            lw.env.pop(key, None)
