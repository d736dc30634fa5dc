"""Graph plumbing and training-step operators: fan-out (multiref), constant
tensors, and local gradient accumulation."""

from __future__ import annotations

from verdict.ops.rule import Op, expect


def _multiref_shape(in_shapes, times):
    expect(len(in_shapes) == 1 and times >= 2, "multiref takes one input and >= 2 copies")
    return [tuple(in_shapes[0])] * times


def _multiref_backward(xp, s, g, shapes, times):
    total = g[0]
    for grad in g[1:]:
        total = total + grad
    return (total,)


MULTIREF = Op(
    "multiref",
    shape=_multiref_shape,
    forward=lambda xp, x, times: tuple(xp.copy(x[0]) for _ in range(times)),
    backward=_multiref_backward,
    doc="one tensor read by several consumers; its backward sums their gradients",
)


def _const_shape(in_shapes, shape):
    expect(not in_shapes, "takes no input")
    return [tuple(shape)]


def _resize_const(kw, ins, outs):
    kw["shape"] = list(outs[0])
    return kw


ZEROS = Op(
    "zeros",
    resize=_resize_const,
    shape=_const_shape,
    forward=lambda xp, x, shape: (xp.zeros(tuple(shape)),),
    doc="a tensor of zeros (gradient buffer before the first accumulation)",
)

ONES = Op(
    "ones",
    resize=_resize_const,
    shape=_const_shape,
    forward=lambda xp, x, shape: (xp.ones(tuple(shape)),),
    doc="a tensor of ones (the gradient of the loss with respect to itself)",
)


def _accumulate_shape(in_shapes):
    expect(len(in_shapes) == 2 and tuple(in_shapes[0]) == tuple(in_shapes[1]),
           f"accumulate: buffer and gradient differ {in_shapes}")
    return [tuple(in_shapes[0])]


ACCUMULATE = Op(
    "local_grad_accumulation",
    shape=_accumulate_shape,
    forward=lambda xp, x: (x[0] + x[1],),
    doc="grad buffer (version v) + a microbatch's gradient -> version v+1",
)

DETACH = Op(
    "detach",
    shape=lambda in_shapes: [tuple(in_shapes[0])],
    forward=lambda xp, x: (xp.copy(x[0]),),
    doc="the same values, with no gradient flowing back (torch's detach)",
)

def _update_shape(n_out: int):
    def shape(in_shapes, **_kw):
        first = tuple(in_shapes[0])
        expect(all(tuple(s) == first for s in in_shapes),
               f"optimizer step: parameter, gradient and states differ {in_shapes}")
        return [first] * n_out
    return shape


SGD_STEP = Op(
    "sgd_step",
    shape=_update_shape(1),
    forward=lambda xp, x, lr, weight_decay: (x[0] - lr * (x[1] + weight_decay * x[0]),),
    doc="SGD with weight decay: p - lr * (g + weight_decay * p)",
)


def _adam_forward(xp, x, lr, beta1, beta2, eps, weight_decay, decoupled, step):
    p, g, m, v = x
    if weight_decay and not decoupled:
        g = g + weight_decay * p  # Adam: L2 through the gradient
    m2 = beta1 * m + (1.0 - beta1) * g
    v2 = beta2 * v + (1.0 - beta2) * (g * g)
    ratio = xp.adam_ratio(m2 / (1.0 - beta1 ** step), v2 / (1.0 - beta2 ** step), eps)
    if weight_decay and decoupled:
        p = p - (lr * weight_decay) * p  # AdamW: decay the weight itself
    return (p - lr * ratio, m2, v2)


ADAM_STEP = Op(
    "adam_step",
    shape=_update_shape(3),
    forward=_adam_forward,
    doc="Adam (decoupled=False) or AdamW step of parameter, gradient, exp_avg, exp_avg_sq; "
        "m / (sqrt(v) + eps) is uninterpreted in the symbolic backend",
)

OPTIMIZERS = ("sgd_step", "adam_step")

OPS = (MULTIREF, ZEROS, ONES, ACCUMULATE, DETACH, SGD_STEP, ADAM_STEP)
