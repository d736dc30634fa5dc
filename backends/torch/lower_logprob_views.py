"""Lowering of a log-softmax whose log-probabilities are reshaped before
``nll_loss`` reads them (``F.log_softmax`` of ``[B, S, V]`` logits,
``flatten(0, 1)``, ``F.nll_loss``).

The nll backward's gradient ``-labels * g`` is kept pending (lower.py's
``_NllGrad``) so that the log-softmax backward reading it fuses into
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

from backends.torch.lower import _NllGrad

VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


@dataclass(frozen=True)
class _ReadNllGrad:
    """The nll backward's gradient with the log-probabilities ``logp`` the
    nll read (its input), kept pending."""
    grad: _NllGrad
    logp: int

    def emit_into(self, lw) -> int:
        return lw.materialize(self.grad)


@dataclass(frozen=True)
class _ViewedNllGrad:
    """``_ReadNllGrad`` seen with ``shape`` (a reshape), kept pending."""
    read: _ReadNllGrad
    shape: tuple[int, ...]

    def emit_into(self, lw) -> int:
        return lw.reshape(lw.materialize(self.read), self.shape)


@dataclass(frozen=True)
class _NllGradPlus:
    """``_ReadNllGrad`` plus the gradient ``other`` another reader of the same
    log-probabilities sends back (label smoothing), seen with ``shape``
    (None: as the log-probabilities the nll read), kept pending."""
    read: _ReadNllGrad
    other: int
    shape: tuple[int, ...] | None = None

    def emit_into(self, lw) -> int:
        x = lw.materialize(self.read)
        total = lw.emit("add", [x, self.other], [lw.shapes[x]])[0]
        return total if self.shape is None else lw.reshape(total, self.shape)


def _producer(lw, v: int):
    for node in reversed(lw.nodes):
        if v in node.outs:
            return node
    return None


def logprob_view_handlers(base: dict) -> dict:
    base = dict(base)

    def nll_bw(lw, args, kwargs, shapes, group):
        out = base["aten.nll_loss_backward.default"](lw, args, kwargs, shapes, group)
        x = lw.env.get(args[1][1])
        if isinstance(out, _NllGrad) and out.whole and isinstance(x, int):
            return _ReadNllGrad(out, x)
        return out

    def view(op: str):
        plain = base[op]

        def lower(lw, args, kwargs, shapes, group):
            x = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
            if isinstance(x, _ReadNllGrad) and shapes[0][-1] == lw.shapes[x.logp][-1]:
                return _ViewedNllGrad(x, tuple(shapes[0]))
            if isinstance(x, _NllGradPlus) and x.shape is None \
                    and shapes[0][-1] == lw.shapes[x.read.logp][-1]:
                return _NllGradPlus(x.read, x.other, tuple(shapes[0]))
            return plain(lw, args, kwargs, shapes, group)
        return lower

    def add(op: str):
        plain = base[op]

        def lower(lw, args, kwargs, shapes, group):
            if len(args) >= 2 and kwargs.get("alpha", 1) == 1:
                a, b = (lw.env.get(x[1]) if isinstance(x, (list, tuple)) else None
                        for x in args[:2])
                for read, other in ((a, b), (b, a)):
                    if isinstance(read, _ReadNllGrad) and isinstance(other, int) \
                            and lw.shapes[other] == lw.shapes[read.logp] == tuple(shapes[0]):
                        return _NllGradPlus(read, other)
            return plain(lw, args, kwargs, shapes, group)
        return lower

    def log_softmax_bw(lw, args, kwargs, shapes, group):
        plain = base["aten._log_softmax_backward_data.default"]
        g = lw.env.get(args[0][1])
        if isinstance(g, _ReadNllGrad):  # no reshape between: lower.py's own fusion
            lw.env[args[0][1]] = g.grad
            return plain(lw, args, kwargs, shapes, group)
        if not isinstance(g, (_ViewedNllGrad, _NllGradPlus)):
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
        if isinstance(g, _NllGradPlus):
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

    out = {op: view(op) for op in VIEWS}
    out.update({op: add(op) for op in ("aten.add.Tensor", "aten.add_.Tensor")})
    out["aten.nll_loss_backward.default"] = nll_bw
    out["aten._log_softmax_backward_data.default"] = log_softmax_bw
    return out
