"""Ops that make tensors of no entries (a dim of size 0).

A recorded op whose every output has a dim of size 0 computes no value:
there is no entry of it to claim, so whatever it reads it is lowered to
``slices.Empty`` of its recorded shape, emitting no node. A reader of an
``Empty`` is lowered only where its meaning does not need an entry of it: a
``cat`` leaves it out, a slice's backward of it is zeros, a
``slice_scatter`` of it writes nothing, and an op that makes no entries
either is ``Empty`` again by this rule; any other reader is refused in one
line (``refusals``). DeepSeek-V4's heavily compressed attention over fewer
tokens than one window (``new_zeros((b, 0, d))``, unsqueezed, joined to the
keys by a ``cat``) is such a chain (docs/soundness.md, "Plans traced from
PyTorch", 110 (a)).

Collectives and the optimizer's ops on the empty shards of parameters keep
their own lowering (``Lowerer.on_empty``, the collectives' handlers): a
collective of an empty input may have members that send entries. So does
an op reading a pending value (``ir.Pending``: FSDP's reduce-scatter
buffer, an all-gather not emitted yet), whose reading may emit a
collective every member of its group must emit too (a rank's empty view of
a reduce-scatter's output): the rule reads only lowered values, constants
and tensors of no entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.torch.lowering.ir import Const
from backends.torch.lowering.slices import Empty

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: ops that communicate or move memory, whose outputs other ranks' entries
#: may fill: never lowered by this rule
COMMUNICATING = ("c10d", "_c10d_functional", "fsdp", "mem.")


def makes_nothing(lw: Lowerer, op: str, ins: list[int], out_shapes: list) -> bool:
    """The event (``op`` reading recorded values ``ins``, making outputs of
    ``out_shapes``) makes only tensors of no entries, communicates
    nothing and reads only lowered values, constants and tensors of no
    entries (no parameter's empty shard, no pending value)."""
    return (bool(out_shapes) and all(0 in tuple(s) for s in out_shapes)
            and not op.startswith(COMMUNICATING)
            and all(isinstance(lw.env.get(v), (int, Const, Empty)) for v in ins))
