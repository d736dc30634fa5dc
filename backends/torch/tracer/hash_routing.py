"""A table of integers looked up at the batch's ids, as recorded routing
data (docs/soundness.md, "Plans traced from PyTorch", 128 (b)).

A hash router (DeepSeek-V4's first MoE layers) chooses each token's experts
by a lookup ``tid2eid[input_ids]``: a constant table (a module's buffer) at
the token ids. Only a table a module holds is taken so; an integer table
made in the forward and looked up at the ids keeps its exact lowering as
the ids' one-hot rows times the table (item 18). The chosen experts decide the shapes of the dispatch (each
expert's rows), so, like top-k's indices (item 36), the lookup's result is
recorded as data of the step: a constant with its value kept, from which
every mask, ``nonzero`` and ``where`` of the dispatch is a constant by the
recorder's own rule. Every rank computes its own lookup from its own ids
and its own table (nothing is replayed); the build claims a rank's
constant a piece of the single-device one only where it equals the
single-device lookup's rows at the rank's coordinates, so a rank that
routed a token otherwise has an input of its own and the stage reading it
fails.

``FromIds`` follows which recorded values are integers computed from the
ids alone (``input_ids.reshape(-1)``, a column of them), so that only a
lookup at the ids, or at constants, is taken as routing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: the ops that look a table up at integer indices: (op, the table's
#: argument position, the index arguments' positions)
LOOKUPS = {
    "aten.index.Tensor": (0, (1,)),
    "aten.index_select.default": (0, (2,)),
}


def _integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


class FromIds:
    """The values computed from the batch's ids (and constants) alone,
    every one of them an integer tensor."""

    def __init__(self) -> None:
        self.values: set[int] = set()

    def seed(self, v: int) -> None:
        """``v`` is the batch's ids."""
        self.values.add(v)

    def note(self, name: str, tensors: list[torch.Tensor], outs: list[torch.Tensor],
             ids: list[int], value: Callable[[torch.Tensor], int | None],
             constants: set[int]) -> None:
        """Outputs of an op all of whose tensors are integer, read only ids
        or constants and at least one id value, and communicate nothing."""
        if name.startswith(("c10d", "_c10d_functional", "fsdp")) or not outs:
            return
        ins = [value(t) for t in tensors]
        if not any(v in self.values for v in ins):
            return
        if not all(v in self.values or v in constants for v in ins):
            return
        if not all(_integer(t) for t in (*tensors, *outs)):
            return
        self.values.update(ids)

    def is_lookup(self, name: str, args: tuple, outs: list[torch.Tensor],
                  value: Callable[[torch.Tensor], int | None], constants: set[int],
                  buffers: set[int]) -> bool:
        """``table[idx]`` (or ``index_select``) of a constant integer table
        held by a module (a buffer, or computed from one: ``buffers``) at
        indices computed from the ids, its result integers: a hash router's
        choice of experts. A table made in the forward (``targets[ids]`` of
        a literal) keeps the ids' exact lowering (item 18)."""
        where = LOOKUPS.get(name)
        if where is None or len(outs) != 1 or not _integer(outs[0]):
            return False
        table_at, index_at = where
        table = args[table_at] if len(args) > table_at else None
        if not isinstance(table, torch.Tensor) or not _integer(table) \
                or value(table) not in constants or value(table) not in buffers:
            return False
        index = [a for i in index_at if len(args) > i
                 for a in (args[i] if isinstance(args[i], (list, tuple)) else [args[i]])
                 if a is not None]
        if not index or not all(isinstance(a, torch.Tensor) and _integer(a) for a in index):
            return False
        found = [value(a) for a in index]
        return any(v in self.values for v in found) and \
            all(v in self.values or v in constants for v in found)
