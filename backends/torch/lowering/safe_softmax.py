"""``aten._safe_softmax`` (SDPA's math kernel with a mask: a softmax whose
fully masked rows are zero instead of NaN), lowered as ``softmax``.

Lowered only when its input is the output of a whole ``causal_mask`` (no
chunk offsets): that rule writes -inf above the diagonal only, so every row
keeps its first entry finite and no row is fully masked, and there the two
functions are equal. Any other input (a chunk of a causal mask, which may
mask whole rows) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.registry import refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]


@refines("aten._safe_softmax.default", base="aten._softmax.default")
def safe_softmax(softmax: Handler) -> Handler:
    """``_safe_softmax(x, dim)`` through the table's ``_softmax`` (which
    also records it for the backward kernel, ``_softmax_backward_data``)."""

    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.val(args[0])
        producer = next((n for n in reversed(lw.nodes) if x in n.outs), None)
        last = len(lw.shapes[x]) - 1
        if producer is None or producer.op != "causal_mask" or producer.dir != "fw" \
                or any(producer.kwargs.get(k) for k in ("row_chunk", "col_chunk")) \
                or int(args[1]) % (last + 1) != last:
            raise LoweringError(f"{lw.name}: _safe_softmax of other than a whole causal mask's "
                                f"output along its last dim")
        return softmax(lw, [args[0], args[1], False], {}, shapes, group)
    return lower
