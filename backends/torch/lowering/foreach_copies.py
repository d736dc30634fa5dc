"""Lowering of ``torch._foreach_copy_(dsts, srcs)``: each destination,
written whole, then holds its source's value (docs/soundness.md, "Plans
traced from PyTorch", 118). FSDP2 with a ``MixedPrecisionPolicy`` whose
``param_dtype`` differs from the parameters' copies each shard into its
piece of one flat buffer this way (a cast, the identity in exact
arithmetic) before the all-gather; the buffer's pieces were never read,
so the destinations are not read either (``context.live_events``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.torch.errors import LoweringError
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@lowers("aten._foreach_copy_.default")
def foreach_copy_(lw: Lowerer, args, kwargs, shapes, group):
    """The new value of ``dsts[i]`` is ``srcs[i]``'s record as it is (a
    value, or a pending layout its readers know), when their shapes are
    equal; a broadcasting copy is refused."""
    dsts, srcs = list(args[0]), list(args[1])
    recorded = lw.trace["shapes"]
    out = []
    for dst, src in zip(dsts, srcs):
        if tuple(recorded[dst[1]]) != tuple(recorded[src[1]]):
            raise LoweringError(f"{lw.name or 'top level'}: torch._foreach_copy_ of shape "
                                f"{tuple(recorded[src[1]])} into shape {tuple(recorded[dst[1]])} "
                                f"(a broadcasting copy) is not lowered")
        value = lw.env.get(src[1])
        if value is None:
            raise LoweringError(f"{lw.name or 'top level'}: torch._foreach_copy_ reads a tensor "
                                f"that no recorded op produced")
        out.append(value)
    return out
