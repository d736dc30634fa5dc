"""Softmax, log-softmax and the negative log-likelihood (``nll_loss``,
``nll_loss2d``) with their backwards; labels are one-hot inputs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input
from backends.torch.lowering.ir import IdRows, NllGrad, Piece
from backends.torch.lowering.onehot import label_values, one_hot
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@lowers("aten._softmax.default")
def _softmax(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.val(args[0])
    out = lw.emit("softmax", [x], shapes, {"dim": int(args[1])})[0]
    lw.fw_in[out] = ("softmax", x)
    return out


@lowers("aten._softmax_backward_data.default")
def _softmax_bw(lw: Lowerer, args, kwargs, shapes, group):
    out = lw.val(args[1])
    producer, x = lw.fw_in.get(out, ("", -1))
    piece = lw.env.get(args[1][1])
    dim = int(args[2]) % len(lw.shapes[out])
    if producer != "softmax" and isinstance(piece, Piece) and isinstance(piece.of, int) \
            and piece.dim % len(lw.shapes[out]) != dim:
        # an equal piece of a softmax's output along another dim (DTensor
        # cuts the saved output to the gradient's shard): the softmax of the
        # same piece of its input, row by row the same rows
        producer, whole = lw.fw_in.get(piece.of, ("", -1))
        if producer == "softmax":
            x = Piece(whole, piece.dim, piece.index, piece.parts).materialize(lw)
    if producer != "softmax":
        raise LoweringError(f"{lw.name}: softmax backward of a value no softmax produced")
    return lw.emit("softmax", [x, lw.val(args[0])], shapes, {"dim": int(args[2])},
                   direction="bw")[0]


@lowers("aten._log_softmax.default")
def _log_softmax(lw: Lowerer, args, kwargs, shapes, group):
    """x - top - log(sum(exp(x - top))), top the row maximum."""
    x, dim = lw.val(args[0]), int(args[1])
    shape = list(lw.shapes[x])
    dim %= len(shape)
    row = [*shape[:dim], 1, *shape[dim + 1:]]
    top = lw.emit("max", [x], [row], {"dim": dim, "keepdim": True})[0]
    shifted = lw.emit("sub", [x, top], [shape])[0]
    e = lw.emit("exp", [shifted], [shape])[0]
    total = lw.emit("sum", [e], [row], {"dim": dim, "keepdim": True})[0]
    return lw.emit("sub", [shifted, lw.emit("log", [total], [row])[0]], [shape])[0]


@lowers("aten._log_softmax_backward_data.default")
def _log_softmax_bw(lw: Lowerer, args, kwargs, shapes, group):
    """g - exp(out) * sum(g) along the dim; of the nll backward's gradient,
    the fused form ``(exp(out) - labels) * g`` (``NllGrad``)."""
    pending = lw.env.get(args[0][1])
    out, dim = lw.val(args[1]), int(args[2])
    shape = list(lw.shapes[out])
    dim %= len(shape)
    if isinstance(pending, NllGrad) and pending.whole and dim == len(shape) - 1:
        return pending.fused(lw, out)
    g = lw.val(args[0])
    row = [*shape[:dim], 1, *shape[dim + 1:]]
    total = lw.emit("sum", [g], [row], {"dim": dim, "keepdim": True})[0]
    e = lw.emit("exp", [out], [shape])[0]
    return lw.emit("sub", [g, lw.emit("mul", [e, total], [shape])[0]], [shape])[0]


def _nll_target(lw: Lowerer, weight: Any, reduction: int, target: Any,
                ignore: Any) -> tuple[int, int]:
    """The one-hot labels the loss reads and the count a mean divides by.

    An ignore index outside ``[0, vocab)`` (the default, -100) ignores none
    of the batch's labels. One inside it zeroes that column of the one-hot
    labels (the rows of that label drop out, for every label matrix), and
    the mean divides by the count of the other labels *in the recorded
    batch*: a constant of the traced step (docs/soundness.md, "Plans traced
    from PyTorch", 10)."""
    if weight is not None or reduction not in (1, 2):
        raise LoweringError(f"{lw.name}: nll_loss with class weights or no reduction is not lowered")
    labels = one_hot(lw, target)
    count = math.prod(lw.shapes[labels][:-1])
    if isinstance(lw.env.get(target[1]), IdRows):
        # ids the model padded: the pads (out of the vocabulary) are zero rows
        ids = label_values(lw, target)
        outside = (ids < 0) | (ids >= lw.vocab)
        if ignore is None or np.any(outside & (ids != int(ignore))):
            raise LoweringError(f"{lw.name}: labels outside the vocabulary other than the "
                                f"ignore_index {ignore}")
        count = int(np.sum(ids != int(ignore)))
    if ignore is not None and 0 <= int(ignore) < lw.vocab:
        keep = np.ones(lw.vocab)
        keep[int(ignore)] = 0.0
        labels = lw.emit("mul", [labels, constant_input(lw, keep)], [lw.shapes[labels]])[0]
        count = int(np.sum(label_values(lw, target) != int(ignore)))
    if count == 0 and reduction == 1:
        raise LoweringError(f"{lw.name}: a mean cross-entropy over no kept label (every label "
                            f"is ignore_index {ignore})")
    return labels, count


def _to_classes(lw: Lowerer, labels: int, classes: int, target: Any) -> int:
    """One-hot labels over the vocabulary cut to the first ``classes``
    columns, for a loss over fewer classes than the vocabulary has ids
    (a classifier's labels ``labels[:, 0] % classes``): exact on the
    recorded labels, which all lie below ``classes`` (checked), so the
    columns cut off are zero in every row (docs/soundness.md, "Plans traced
    from PyTorch", 18)."""
    width = lw.shapes[labels][-1]
    if width == classes:
        return labels
    values = label_values(lw, target)
    inside = (values >= 0) & (values < lw.vocab)
    if width < classes or np.any(values[inside] >= classes):
        raise LoweringError(f"{lw.name}: nll_loss over {classes} classes against labels up to "
                            f"{int(values.max())}")
    shape = [*lw.shapes[labels][:-1], classes]
    return lw.emit("narrow", [labels], [shape], {"dim": len(shape) - 1, "start": 0,
                                                  "length": classes})[0]


def _class_last(lw: Lowerer, x: int) -> int:
    """``[N, C, d...]`` with the class dim moved last (nll_loss2d's layout to
    the one-hot labels' ``[N, d..., C]``), by adjacent transposes."""
    shape = list(lw.shapes[x])
    for d in range(1, len(shape) - 1):
        shape[d], shape[d + 1] = shape[d + 1], shape[d]
        x = lw.emit("transpose", [x], [tuple(shape)], {"dim0": d, "dim1": d + 1})[0]
    return x


def _class_second(lw: Lowerer, x: int) -> int:
    """The inverse of ``_class_last``."""
    shape = list(lw.shapes[x])
    for d in range(len(shape) - 2, 0, -1):
        shape[d], shape[d + 1] = shape[d + 1], shape[d]
        x = lw.emit("transpose", [x], [tuple(shape)], {"dim0": d, "dim1": d + 1})[0]
    return x


@lowers("aten.nll_loss_forward.default")
def _nll(lw: Lowerer, args, kwargs, shapes, group, classes_second: bool = False):
    """-sum(logp * one-hot labels), divided by the kept-label count for a
    mean: each row's picked log-probability (a row sum, as a loss-parallel
    run computes it), negated, summed. ``classes_second``: nll_loss2d's
    ``[N, C, d...]`` log-probabilities."""
    logp, reduction = lw.val(args[0]), int(args[3])
    if classes_second:
        logp = _class_last(lw, logp)
    labels, count = _nll_target(lw, args[2], reduction, args[1],
                                args[4] if len(args) > 4 else None)
    shape = lw.shapes[logp]
    labels = _to_classes(lw, labels, shape[-1], args[1])
    if lw.shapes[labels] != shape:
        raise LoweringError(f"{lw.name}: nll_loss of {list(shape)} log-probabilities "
                            f"against labels {list(lw.shapes[labels][:-1])}")
    rows = [*shape[:-1], 1]
    picked = lw.emit("sum", [lw.emit("mul", [logp, labels], [shape])[0]], [rows],
                     {"dim": len(shape) - 1, "keepdim": True})[0]
    picked = lw.reshape(picked, tuple(shape[:-1]))
    negated = lw.emit("mul_scalar", [picked], [shape[:-1]], {"value": -1.0})[0]
    out = lw.emit("sum", [negated], [()], {"dim": None, "keepdim": False})[0]
    if reduction == 1:
        out = lw.emit("div", [out], [()], {"value": float(count)})[0]
    return [out, "count"]


@lowers("aten.nll_loss_backward.default")
def _nll_bw(lw: Lowerer, args, kwargs, shapes, group, classes_second: bool = False):
    """-one-hot labels * g, divided by the kept-label count for a mean
    (pending: ``NllGrad``; nll_loss2d's gradient moved back to its layout)."""
    g, reduction = lw.val(args[0]), int(args[4])
    ignore = args[5] if len(args) > 5 else None
    labels, count = _nll_target(lw, args[3], reduction, args[2], ignore)
    width = lw.shapes[lw.val(args[1])][1 if classes_second else -1]
    labels = _to_classes(lw, labels, width, args[2])
    whole = count == math.prod(lw.shapes[labels][:-1]) \
        and not isinstance(lw.env.get(args[2][1]), IdRows) \
        and (ignore is None or not 0 <= int(ignore) < lw.vocab)
    grad = NllGrad(labels, g, count if reduction == 1 else None, whole)
    return _class_second(lw, grad.materialize(lw)) if classes_second else grad


@lowers("aten.nll_loss2d_forward.default")
def _nll2d(lw: Lowerer, args, kwargs, shapes, group):
    return _nll(lw, args, kwargs, shapes, group, classes_second=True)


@lowers("aten.nll_loss2d_backward.default")
def _nll2d_bw(lw: Lowerer, args, kwargs, shapes, group):
    return _nll_bw(lw, args, kwargs, shapes, group, classes_second=True)
