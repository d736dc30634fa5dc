"""Contractions: linear layers, batched matmul, einsum, embedding lookup."""

from __future__ import annotations

import numpy as np

from verdict.ops.rule import Op, expect


def _linear_shape(in_shapes):
    x, w = in_shapes
    expect(len(w) == 2, f"linear weight must be 2-d, got {w}")
    expect(len(x) >= 1 and x[-1] == w[1], f"linear: input {x} does not match weight {w}")
    return [tuple(x[:-1]) + (w[0],)]


def _linear_backward(xp, s, g, shapes):
    x, w = s
    dy = g[0]
    dx = dy @ w
    lead = dy.reshape(-1, dy.shape[-1])
    dw = lead.T @ x.reshape(-1, x.shape[-1])
    return (dx, dw)


LINEAR = Op(
    "linear",
    shape=_linear_shape,
    forward=lambda xp, x: (x[0] @ x[1].T,),
    backward=_linear_backward,
    saves=(0, 1),
    doc="x @ w.T, w of shape [out, in] as in torch.nn.Linear",
)


def _matmul_shape(in_shapes):
    a, b = in_shapes
    expect(len(a) >= 2 and len(a) == len(b), f"matmul: ranks differ {a} {b}")
    expect(a[:-2] == b[:-2], f"matmul: batch dims differ {a} {b}")
    expect(a[-1] == b[-2], f"matmul: contracted dims differ {a} {b}")
    return [tuple(a[:-1]) + (b[-1],)]


def _matmul_backward(xp, s, g, shapes):
    a, b = s
    return (g[0] @ np.swapaxes(b, -1, -2), np.swapaxes(a, -1, -2) @ g[0])


MATMUL = Op(
    "matmul",
    shape=_matmul_shape,
    forward=lambda xp, x: (x[0] @ x[1],),
    backward=_matmul_backward,
    saves=(0, 1),
    doc="batched a @ b with equal batch dims",
)


def parse_einsum(eq: str) -> tuple[list[str], str]:
    lhs, out = eq.replace(" ", "").split("->")
    return lhs.split(","), out


def _einsum_shape(in_shapes, eq):
    subs, out = parse_einsum(eq)
    expect(len(subs) == len(in_shapes), f"einsum {eq}: expects {len(subs)} inputs")
    sizes: dict[str, int] = {}
    for sub, shape in zip(subs, in_shapes):
        expect(len(sub) == len(shape), f"einsum {eq}: operand {shape} does not match '{sub}'")
        for ch, n in zip(sub, shape):
            expect(sizes.setdefault(ch, n) == n, f"einsum {eq}: index '{ch}' has sizes {sizes[ch]}, {n}")
    expect(all(ch in sizes for ch in out), f"einsum {eq}: output index without input")
    return [tuple(sizes[ch] for ch in out)]


def _einsum_backward(xp, s, g, shapes, eq):
    subs, out = parse_einsum(eq)
    grads = []
    for i, sub in enumerate(subs):
        others = [subs[j] for j in range(len(subs)) if j != i]
        known = set(out).union(*others)
        expect(set(sub) <= known, f"einsum {eq}: index of operand {i} summed alone")
        spec = ",".join([out, *others]) + "->" + sub
        grads.append(np.einsum(spec, g[0], *[s[j] for j in range(len(subs)) if j != i]))
    return tuple(grads)


EINSUM = Op(
    "einsum",
    shape=_einsum_shape,
    forward=lambda xp, x, eq: (np.einsum(eq, *x),),
    backward=_einsum_backward,
    saves=(0, 1),
    doc="np.einsum of two operands; each index appears at most once per operand",
)


def _embedding_shape(in_shapes):
    ids, w = in_shapes
    expect(len(w) == 2, f"embedding weight must be 2-d, got {w}")
    expect(len(ids) >= 1 and ids[-1] == w[0], f"embedding: one-hot {ids} does not match table {w}")
    return [tuple(ids[:-1]) + (w[1],)]


def _embedding_backward(xp, s, g, shapes):
    onehot = s[0]
    lead = onehot.reshape(-1, onehot.shape[-1])
    return (None, lead.T @ g[0].reshape(-1, g[0].shape[-1]))


EMBEDDING = Op(
    "embedding",
    shape=_embedding_shape,
    forward=lambda xp, x: (x[0] @ x[1],),
    backward=_embedding_backward,
    saves=(0,),
    diff=(1,),
    doc="row lookup as one_hot(ids) @ table, so a vocab-parallel split is a slice",
)

OPS = (LINEAR, MATMUL, EINSUM, EMBEDDING)
