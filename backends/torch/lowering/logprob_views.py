"""Lowering of a log-softmax whose log-probabilities are reshaped before
``nll_loss`` reads them (``F.log_softmax`` of ``[B, S, V]`` logits,
``flatten(0, 1)``, ``F.nll_loss``).

The nll backward's gradient ``-labels * g`` is kept pending (``ir.NllGrad``)
so that the log-softmax backward reading it fuses into
``(exp(logp) - labels) * g``, the form DTensor's loss parallelism
computes. Through a reshape between them the same fusion holds: a reshape
moves entries, it does not change them, so the fused form is computed on
the log-probabilities the nll read (the reshaped ones) and reshaped back,
``reshape((exp(flat) - labels) * g)``; that equals the log-softmax
backward of the reshaped gradient when every label row is one-hot and the
softmax dim is the last one, kept by the reshape (docs/soundness.md,
"Plans traced from PyTorch", 2 and 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.torch.lowering.context import LNode
from backends.torch.lowering.ir import NllGrad, Pending
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


@dataclass(frozen=True)
class ReadNllGrad(Pending):
    """The nll backward's gradient with the log-probabilities ``logp`` the
    nll read (its input), kept pending."""
    grad: NllGrad
    logp: int

    def materialize(self, lw: Lowerer) -> int:
        return lw.materialize(self.grad)


@dataclass(frozen=True)
class ViewedNllGrad(Pending):
    """``ReadNllGrad`` seen with ``shape`` (a reshape), kept pending."""
    read: ReadNllGrad
    shape: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        return lw.reshape(lw.materialize(self.read), self.shape)


@dataclass(frozen=True)
class NllGradPlus(Pending):
    """``ReadNllGrad`` plus the gradient ``other`` another reader of the same
    log-probabilities sends back (label smoothing), seen with ``shape``
    (None: as the log-probabilities the nll read), kept pending."""
    read: ReadNllGrad
    other: int
    shape: tuple[int, ...] | None = None

    def materialize(self, lw: Lowerer) -> int:
        x = lw.materialize(self.read)
        total = lw.emit("add", [x, self.other], [lw.shapes[x]])[0]
        return total if self.shape is None else lw.reshape(total, self.shape)


def _producer(lw: Lowerer, v: int) -> LNode | None:
    for node in reversed(lw.nodes):
        if v in node.outs:
            return node
    return None


@refines("aten.nll_loss_backward.default")
def nll_bw(plain: Handler) -> Handler:
    """A whole nll gradient remembers the log-probabilities it was read from."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        out = plain(lw, args, kwargs, shapes, group)
        x = lw.env.get(args[1][1])
        if isinstance(out, NllGrad) and out.whole and isinstance(x, int):
            return ReadNllGrad(out, x)
        return out
    return lower


@refines(*VIEWS)
def view(plain: Handler) -> Handler:
    """A reshape keeping the last dim of the nll gradient keeps it pending."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        if isinstance(x, ReadNllGrad) and shapes[0][-1] == lw.shapes[x.logp][-1]:
            return ViewedNllGrad(x, tuple(shapes[0]))
        if isinstance(x, NllGradPlus) and x.shape is None \
                and shapes[0][-1] == lw.shapes[x.read.logp][-1]:
            return NllGradPlus(x.read, x.other, tuple(shapes[0]))
        return plain(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.add.Tensor", "aten.add_.Tensor")
def add(plain: Handler) -> Handler:
    """The nll gradient plus another reader's gradient of the same
    log-probabilities stays pending (``NllGradPlus``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if len(args) >= 2 and kwargs.get("alpha", 1) == 1:
            a, b = (lw.env.get(x[1]) if isinstance(x, (list, tuple)) else None
                    for x in args[:2])
            for read, other in ((a, b), (b, a)):
                if isinstance(read, ReadNllGrad) and isinstance(other, int) \
                        and lw.shapes[other] == lw.shapes[read.logp] == tuple(shapes[0]):
                    return NllGradPlus(read, other)
        return plain(lw, args, kwargs, shapes, group)
    return lower


@refines("aten._log_softmax_backward_data.default")
def log_softmax_bw(plain: Handler) -> Handler:
    """The log-softmax backward of a (reshaped) nll gradient: the fused form
    on the log-probabilities the nll read, reshaped back."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        g = lw.env.get(args[0][1])
        if isinstance(g, ReadNllGrad):  # no reshape between: the losses family's own fusion
            lw.env[args[0][1]] = g.grad
            return plain(lw, args, kwargs, shapes, group)
        if not isinstance(g, (ViewedNllGrad, NllGradPlus)):
            return plain(lw, args, kwargs, shapes, group)
        read = g.read
        out = lw.val(args[1])
        dim = int(args[2]) % len(lw.shapes[out])
        made = _producer(lw, read.logp)
        last = dim == len(lw.shapes[out]) - 1
        if not last or (read.logp != out and (made is None or made.ins[:1] != [out]
                                              or made.op not in ("flatten", "unflatten"))):
            return plain(lw, args, kwargs, shapes, group)
        total = read.grad.fused(lw, read.logp)
        if isinstance(g, NllGradPlus):
            # the backward is linear in its gradient: the nll's part fused, the
            # other reader's t as t - exp(logp) * sum(t), written t + (-(...))
            t, logp = g.other, read.logp
            shape = lw.shapes[t]
            row = [*shape[:-1], 1]
            rows = lw.emit("sum", [t], [row], {"dim": len(shape) - 1, "keepdim": True})[0]
            e = lw.emit("exp", [logp], [shape])[0]
            c = lw.emit("mul_scalar", [lw.emit("mul", [e, rows], [shape])[0]], [shape],
                        {"value": -1.0})[0]
            total = lw.emit("add", [lw.emit("add", [total, t], [shape])[0], c], [shape])[0]
        return lw.reshape(total, tuple(lw.shapes[out]))
    return lower
