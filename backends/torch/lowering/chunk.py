"""Lowering of ``torch.chunk`` when it reaches the dispatcher (DTensor's
redistribution of a replicated gradient to a ``Shard`` takes the rank's
chunk): the same pieces as ``split`` by ``ceil(size / chunks)``, which is
how ``torch.chunk`` cuts (the pieces' shapes are the recorded ones)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.torch.errors import LoweringError
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@refines("aten.chunk.default", base="aten.split.Tensor")
def chunk(split: Handler) -> Handler:
    """``chunk(x, chunks, dim)`` as ``split(x, size of the first piece, dim)``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", 0))
        if not shapes:
            raise LoweringError(f"{lw.name}: a chunk into no pieces")
        size = int(shapes[0][dim])
        return split(lw, [args[0], size, dim], {}, shapes, group)
    return lower
