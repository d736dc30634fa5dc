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


def _linear_dims(ins, outs):
    x, w = ins[0], ins[1]
    out = outs[0]
    rel = []
    if x is not None and w is not None:
        rel += [("eq", ("i", 0, len(x) - 1), ("i", 1, 1)), ("min", ("i", 1, 1), 2)]
    if x is not None and out is not None:
        rel += [("eq", ("i", 0, k), ("o", 0, k)) for k in range(len(x) - 1)]
    if w is not None and out is not None:
        rel.append(("eq", ("i", 1, 0), ("o", 0, len(out) - 1)))
    return rel


LINEAR = Op(
    "linear",
    dims=_linear_dims,
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


def _matmul_dims(ins, outs):
    a, b, out = ins[0], ins[1], outs[0]
    nd = len(next(s for s in (a, b, out) if s is not None))
    rel = []
    refs = [("i", 0), ("i", 1), ("o", 0)]
    present = [s is not None for s in (a, b, out)]
    for k in range(nd - 2):
        have = [(*r, k) for r, p in zip(refs, present) if p]
        rel += [("eq", have[0], h) for h in have[1:]]
    pairs = [((0, nd - 1), (1, nd - 2)), ((0, nd - 2), (2, nd - 2)), ((1, nd - 1), (2, nd - 1))]
    for (p, dp), (q, dq) in pairs:
        if present[p] and present[q]:
            rel.append(("eq", (*refs[p], dp), (*refs[q], dq)))
    if present[0]:
        rel.append(("min", ("i", 0, nd - 1), 2))
    return rel


MATMUL = Op(
    "matmul",
    dims=_matmul_dims,
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


def _einsum_dims(ins, outs, eq):
    subs, out = parse_einsum(eq)
    where: dict[str, list[tuple]] = {}
    for i, sub in enumerate(subs):
        if ins[i] is not None:
            for k, ch in enumerate(sub):
                where.setdefault(ch, []).append(("i", i, k))
    if outs[0] is not None:
        for k, ch in enumerate(out):
            where.setdefault(ch, []).append(("o", 0, k))
    rel = []
    for ch, refs in where.items():
        rel += [("eq", refs[0], r) for r in refs[1:]]
        if ch not in out:
            rel.append(("min", refs[0], 2))
    return rel


EINSUM = Op(
    "einsum",
    dims=_einsum_dims,
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


def _embedding_dims(ins, outs):
    ids, w, out = ins[0], ins[1], outs[0]
    rel = []
    if ids is not None and w is not None:
        rel.append(("eq", ("i", 0, len(ids) - 1), ("i", 1, 0)))
    if ids is not None and out is not None:
        rel += [("eq", ("i", 0, k), ("o", 0, k)) for k in range(len(ids) - 1)]
    if w is not None and out is not None:
        rel.append(("eq", ("i", 1, 1), ("o", 0, len(out) - 1)))
    return rel


EMBEDDING = Op(
    "embedding",
    dims=_embedding_dims,
    shape=_embedding_shape,
    forward=lambda xp, x: (x[0] @ x[1],),
    backward=_embedding_backward,
    saves=(0,),
    diff=(1,),
    doc="row lookup as one_hot(ids) @ table, so a vocab-parallel split is a slice",
)

OPS = (LINEAR, MATMUL, EINSUM, EMBEDDING)
