"""The batch's ids as inputs: embedding lookups and their backward, tests
and arithmetic on ids (the pieces of a vocabulary-parallel lookup), padding
and writes of ids."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value, one_hot_constant
from backends.torch.lowering.context import LNode
from backends.torch.lowering.ir import (
    Compare,
    Const,
    IdRows,
    Ids,
    IdsTest,
    MaskedLookup,
    Shifted,
    VocabMask,
    ZeroPadded,
)
from backends.torch.lowering.onehot import id_rows, ids_value, one_hot
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@lowers("aten.embedding.default")
def _embedding(lw: Lowerer, args, kwargs, shapes, group):
    """The lookup; its ``padding_idx`` changes only the backward (a separate
    recorded op, ``_embedding_bw``), not the rows looked up, so it is not
    read here (docs/soundness.md, "Plans traced from PyTorch", 25)."""
    ids = lw.env.get(args[1][1])
    if isinstance(ids, Const):
        rows = lw.shapes[lw.val(args[0])][0]
        onehot = one_hot_constant(lw, constant_value(lw, args[1]), rows)
        return lw.emit("embedding", [onehot, lw.val(args[0])], shapes)[0]
    if not isinstance(ids, Shifted):
        return lw.emit("embedding", [one_hot(lw, args[1]), lw.val(args[0])], shapes)[0]
    # a vocabulary-parallel lookup: the one-hot rows' slice [lo, hi) times the
    # local table, zero for ids outside it (which the masked lookup zeroes after)
    w = lw.val(args[0])
    mask = ids.mask
    rows = lw.shapes[w][0]
    if mask is None or mask.lo != ids.lo or mask.hi - mask.lo != rows or mask.lo % rows \
            or lw.vocab % rows:
        raise LoweringError(f"{lw.name}: an embedding of shifted ids that is not a "
                            f"vocabulary-parallel lookup of its table's rows")
    onehot = one_hot(lw, ("v", ids_value(lw, mask.ids)))
    shape = [*lw.shapes[onehot][:-1], rows]
    part = lw.emit("split", [onehot], [shape], {"dim": len(shape) - 1, "parts": lw.vocab // rows,
                                                 "index": mask.lo // rows})[0]
    out = lw.emit("embedding", [part, w], shapes)[0]
    return MaskedLookup(out, mask)


def _ids_test(op: str):
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        ids = lw.env.get(args[0][1])
        value = lw.const(args[1])
        if not isinstance(ids, Ids) and value is not None and op in ("lt", "ge", "gt", "le"):
            return Compare(lw.val(args[0]), op, value)
        if not isinstance(ids, Ids) or value is None:
            raise LoweringError(f"{lw.name}: a comparison other than of the batch's ids with "
                                f"a number is not lowered")
        # an integer id passes x < c (x >= c) as it passes x < ceil(c) (x >= ceil(c)),
        # x > c (x <= c) as x > floor(c) (x <= floor(c))
        bound = math.ceil(value) if op in ("lt", "ge") else math.floor(value)
        return IdsTest(ids, op, int(bound))
    return lower


@lowers("aten.__or__.Tensor", "aten.bitwise_or.Tensor")
def _or(lw: Lowerer, args, kwargs, shapes, group):
    a, b = lw.env.get(args[0][1]), lw.env.get(args[1][1])
    if isinstance(a, IdsTest) and isinstance(b, IdsTest) and a.ids == b.ids \
            and (a.op, b.op) == ("lt", "ge"):
        return VocabMask(a.ids, a.value, b.value)
    raise LoweringError(f"{lw.name}: an 'or' other than of ids < lo and ids >= hi is not lowered")


@lowers("aten.sub.Tensor", "aten.sub_.Tensor")
def _sub(lw: Lowerer, args, kwargs, shapes, group):
    a = lw.env.get(args[0][1])
    value = lw.const(args[1])
    if isinstance(a, Ids) and value is not None:
        return Shifted(a, int(value))
    if value is not None:
        return lw.emit("add_scalar", [lw.val(args[0])], shapes, {"value": -value})[0]
    return lw.emit("sub", [lw.val(args[0]), lw.val(args[1])], shapes)[0]


@lowers("aten.index_put_.default")
def _index_put(lw: Lowerer, args, kwargs, shapes, group):
    """``x[mask] = 0`` of a vocabulary-parallel lookup: on its shifted ids, or
    on its output (already zero there in the one-hot form)."""
    target = lw.env.get(args[0][1])
    masks = [lw.env.get(m[1]) for m in args[1]] if isinstance(args[1], (list, tuple)) else []
    accumulate = bool(args[3]) if len(args) > 3 else False
    if len(masks) == 1 and isinstance(masks[0], VocabMask) and lw.const(args[2]) == 0 \
            and not accumulate:
        mask = masks[0]
        if isinstance(target, Shifted) and target.ids == mask.ids and target.mask is None:
            return Shifted(target.ids, target.lo, mask)
        if isinstance(target, MaskedLookup) and target.mask == mask:
            return target.out
    raise LoweringError(f"{lw.name}: index_put_ other than the masking of a "
                        f"vocabulary-parallel lookup is not lowered")


@lowers("aten.embedding_dense_backward.default")
def _embedding_bw(lw: Lowerer, args, kwargs, shapes, group):
    """The one-hot rows' transpose times the gradient. With a ``padding_idx``
    p (the forward lookup is unchanged), the one-hot rows times the constant
    row that is 0 at p and 1 elsewhere: a row of id p becomes a zero row and
    adds nothing to the table's gradient, any other row is unchanged
    (docs/soundness.md, "Plans traced from PyTorch", 16)."""
    padding = args[3] if len(args) > 3 else kwargs.get("padding_idx", -1)
    rows = int(args[2])
    if len(args) > 4 and args[4]:
        raise LoweringError(f"{lw.name}: embedding backward with scale_grad_by_freq is not lowered")
    if isinstance(lw.env.get(args[1][1]), Const):
        tokens = one_hot_constant(lw, constant_value(lw, args[1]), rows)
    else:
        tokens = one_hot(lw, args[1])
    if padding is not None and 0 <= int(padding) < rows:
        keep = np.ones(rows)
        keep[int(padding)] = 0.0
        tokens = lw.emit("mul", [tokens, constant_input(lw, keep)], [lw.shapes[tokens]])[0]
    out = lw.new(shapes[0])
    lw.nodes.append(LNode("embedding", "bw", [tokens, -1, lw.val(args[0])], [-1, out], {},
                          lw.name, None, lw.mb))
    return out


@lowers("aten.constant_pad_nd.default")
def _pad_ids(lw: Lowerer, args, kwargs, shapes, group):
    """``F.pad`` of integer ids with a value outside the vocabulary (a label
    the loss ignores): zero one-hot rows concatenated on either side."""
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    src = lw.env.get(args[0][1])
    if not isinstance(src, (Ids, IdRows)):
        return _zero_padded(lw, args, value)
    if 0 <= int(value) < lw.vocab:
        raise LoweringError(f"{lw.name}: ids padded with {value}, a label of the vocabulary, "
                            f"are not lowered (pad with the loss's ignore_index)")
    rows = id_rows(lw, args[0])
    pads = list(args[1])
    x, ids = rows.x, rows.ids
    for k in range(len(pads) // 2):
        dim = ids.ndim - 1 - k
        before, after = int(pads[2 * k]), int(pads[2 * k + 1])
        if before < 0 or after < 0:
            raise LoweringError(f"{lw.name}: a negative pad of integer ids is not lowered")
        pieces = []
        for width, at_end in ((before, False), (after, True)):
            if width:
                zshape = list(lw.shapes[x])
                zshape[dim] = width
                pieces.append((at_end, lw.emit("zeros", [], [zshape], {"shape": zshape},
                                               direction="none")[0]))
        if pieces:
            parts = [p for end, p in pieces if not end] + [x] + [p for end, p in pieces if end]
            shape = list(lw.shapes[x])
            shape[dim] += before + after
            x = lw.emit("cat", parts, [shape], {"dim": dim})[0]
            width = [(0, 0)] * ids.ndim
            width[dim] = (before, after)
            ids = np.pad(ids, width, constant_values=int(value))
    return IdRows(x, ids)


def _zero_padded(lw: Lowerer, args, value) -> ZeroPadded:
    """A tensor padded with zeros at the end of one dim (DTensor's piece of
    an uneven shard, before its all-gather): pending, read only by it."""
    pads = [int(p) for p in args[1]]
    x = lw.val(args[0])
    widths = [(k, pads[2 * k], pads[2 * k + 1]) for k in range(len(pads) // 2)
              if pads[2 * k] or pads[2 * k + 1]]
    if float(value) != 0.0 or len(widths) != 1 or widths[0][1] != 0 or widths[0][2] < 0:
        raise LoweringError(f"{lw.name}: constant_pad_nd of other than integer ids is not "
                            f"lowered, except zeros at the end of one dim before an all-gather")
    k, _, width = widths[0]
    return ZeroPadded(x, len(lw.shapes[x]) - 1 - k, width)

lowers("aten.lt.Scalar")(_ids_test('lt'))
lowers("aten.ge.Scalar")(_ids_test('ge'))
lowers("aten.gt.Scalar")(_ids_test('gt'))
lowers("aten.le.Scalar")(_ids_test('le'))
