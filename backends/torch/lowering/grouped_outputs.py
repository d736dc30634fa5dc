"""An activation's backward that reads the activation's output, on grouped
rows (docs/soundness.md, "Plans traced from PyTorch", 104 (c)). A helper
module: ``grouped`` registers it around its row-wise rules.

``sigmoid_backward(g, s)`` and ``tanh_backward(g, s)`` are lowered as the
backward node of the op that made s, on that op's input
(``nn.activation_backward_of_output``), so s must be the very value the
activation produced. When the forward ran on gathered rows (``Rows``: the
activation on every row of a base, the index beside it) and the gradient
is grouped rows of the same index (``Experts``, a grouped GEMM's input
gradient), spreading s over the groups would hide its maker; instead the
gradient is each row's own group's result gathered at the same index
(``grouped_rows.collapse``: ``sum_g M[g] * G[g]``, read at the index),
and the op runs on rows of one index, as on any gathered rows (36 c).
Entrywise, so equal to the op on the grouped rows read at each row's group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.lowering.grouped_rows import Experts, collapse
from backends.torch.lowering.routed_rows import Rows, value_of
from backends.torch.lowering.routed_rowwise import tensor_refs

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]

#: backward kernels lowered on the input of the op that made their output operand
BY_OUTPUT = frozenset({"aten.sigmoid_backward.default", "aten.tanh_backward.default"})


def backward_of_output(base: Handler) -> Handler:
    """The gradient's grouped rows gathered at the output's index when the
    output operand (``args[1]``) is gathered rows; the rest to ``base``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        out = value_of(lw, args[1]) if len(args) > 1 else None
        if not isinstance(out, Rows):
            return base(lw, args, kwargs, shapes, group)
        grouped = {r[1]: value_of(lw, r) for r in tensor_refs([args, kwargs])
                   if isinstance(value_of(lw, r), Experts)}
        if not grouped or any(not np.array_equal(e.index, out.index) for e in grouped.values()):
            return base(lw, args, kwargs, shapes, group)
        for v, e in grouped.items():
            lw.env[v] = Rows(collapse(lw, e), e.index)
        try:
            return base(lw, args, kwargs, shapes, group)
        finally:
            lw.env.update(grouped)
    return lower
