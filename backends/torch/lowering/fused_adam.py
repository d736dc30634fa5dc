"""Lowering of torch's fused Adam and AdamW kernels, ``aten._fused_adam_`` and
``aten._fused_adamw_`` (``torch.optim.Adam(fused=True)``,
``torch.optim.AdamW(fused=True)``; docs/soundness.md, "Plans traced from
PyTorch", 135).

The kernel writes its lists in place and returns nothing; the tracer records
it as writing its schema's mutable arguments in order (item 129 d): the
parameters, the gradients, ``exp_avgs``, ``exp_avg_sqs`` and
``max_exp_avg_sqs``. For parameter i with gradient g, moments m and v and
step count n (``state_steps[i]``, incremented by the optimizer before the
call), the CPU kernel computes, in this order::

    g = -g                      if maximize
    g = g + weight_decay * p    (Adam)      p = p * keep   (AdamW)
    m = m + (1 - beta1) * (g - m)           (a lerp)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - step_size * m / (sqrt(v) / sqrt(1 - beta2 ** n) + eps)

with the double constants ``keep = 1 - lr * weight_decay`` and
``step_size = lr / (1 - beta1 ** n)``, the very numbers the for-loop
implementation computes in Python. In exact arithmetic this is the rule
table's ``adam_step`` of (p, g, m, v) (``decoupled`` for AdamW) with the
hyperparameters written as ``arithmetic``'s lowering of the for-loop step
writes them (its learning rate ``step_size * (1 - beta1 ** n)``, its weight
decay ``(1 - keep) / lr``): one node per parameter, its three outputs the
new parameter, ``exp_avg`` and ``exp_avg_sq``; the gradient keeps its
value. What the kernel does besides
is refused in one line: ``amsgrad`` (a maximum kept in a fourth state), a
``grad_scale`` (which divides the gradients in place) or a ``found_inf``
(which skips the step on a value the kernel reads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _step_count(lw: Lowerer, where: str, a: Any) -> int:
    """The step count a ``state_steps`` entry holds: a recorded constant
    whole number >= 1 (the optimizer's counter after its increment)."""
    n = lw.const(a)
    if n is None or n != int(n) or n < 1:
        raise LoweringError(f"{where}: a step count that is not a constant whole number >= 1 "
                            f"({n!r}) is not lowered")
    return int(n)


def _hyper(lr: float, beta1: float, beta2: float, eps: float, wd: float, decoupled: bool,
           step: int) -> dict:
    """``adam_step``'s keywords for the kernel's constants at step ``step``:
    the rate and decay recovered from ``step_size`` and ``keep`` as the
    for-loop's lowering recovers them, so that one computation is written
    with the same numbers whichever implementation ran it."""
    weight = 1 - beta1  # the lerp's weight
    b1 = 1.0 - weight
    rate = (lr / (1 - beta1 ** step)) * (1 - b1 ** step)
    if decoupled:
        wd = (1.0 - (1 - lr * wd)) / rate if wd else 0.0
    return {"lr": rate, "beta1": b1, "beta2": beta2, "eps": eps, "weight_decay": wd,
            "decoupled": decoupled, "step": step}


def _lower_fused(decoupled: bool, kernel: str):
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        where = f"{lw.name or 'top level'}: {kernel}"
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = (list(a) for a in args[:6])
        if kwargs.get("amsgrad") or max_sqs:
            raise LoweringError(f"{where} with amsgrad=True (a running maximum of exp_avg_sq) "
                                f"is not lowered")
        for key in ("grad_scale", "found_inf"):
            if kwargs.get(key) is not None:
                raise LoweringError(f"{where} with a {key} (gradient scaling) is not lowered")
        lr = lw.const(kwargs["lr"])
        if lr is None:
            raise LoweringError(f"{where}: a learning rate that is not a constant is not lowered")
        beta1, beta2, wd = (float(kwargs[k]) for k in ("beta1", "beta2", "weight_decay"))
        weight = 1 - beta1
        if 1.0 - (1.0 - weight) != weight:
            raise LoweringError(f"{where}: beta1 {beta1} whose lerp weight 1 - beta1 is not "
                                f"1 - (1 - (1 - beta1)) in floats is not lowered")
        if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps):
            raise LoweringError(f"{where}: lists of unequal lengths")
        new_p, new_m, new_v = [], [], []
        saved = lw.name
        for p, g, m, v, n in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            pv = lw.env.get(p[1])
            if pv not in lw.params:
                raise LoweringError(f"{where} steps a tensor that is not a parameter of the "
                                    f"step")
            lw.name = f"{lw.params[pv]}.optimizer"
            gv = lw.val(g)
            if kwargs.get("maximize"):
                gv = lw.emit("mul_scalar", [gv], [lw.shapes[gv]], {"value": -1.0})[0]
            kw = _hyper(lr, beta1, beta2, float(kwargs["eps"]), wd, decoupled,
                        _step_count(lw, where, n))
            outs = lw.emit("adam_step", [pv, gv, lw.val(m), lw.val(v)], [lw.shapes[pv]] * 3, kw,
                           direction="none")
            new_p.append(outs[0])
            new_m.append(outs[1])
            new_v.append(outs[2])
        lw.name = saved
        # the recorded outputs: parameters, gradients (unchanged), exp_avgs, exp_avg_sqs
        return new_p + [lw.env.get(g[1]) for g in grads] + new_m + new_v
    return lower


lowers("aten._fused_adamw_.default", "aten._fused_adamw_.tensor_lr")(
    _lower_fused(True, "torch._fused_adamw_"))
lowers("aten._fused_adam_.default", "aten._fused_adam_.tensor_lr")(
    _lower_fused(False, "torch._fused_adam_"))
