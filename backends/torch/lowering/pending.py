"""The protocol of the lowering's pending values (``ir``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.refusals import refusal

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


class Pending:
    """A value the lowering has not emitted yet. ``Lowerer.materialize``
    calls ``materialize`` when an op reads it as a tensor: it emits the
    value's nodes and returns the lowered value (or another pending value,
    materialized in turn), or refuses the read in one line."""

    def materialize(self, lw: Lowerer) -> Any:
        raise LoweringError(refusal(lw, self))
