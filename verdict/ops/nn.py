"""Model-specific operators traced as leaf functions: rotary embedding,
causal mask, MoE top-k routing in the static capacity formulation, and
attention with its log-sum-exp and its flash backward."""

from __future__ import annotations

import numpy as np

from verdict.ops.rule import Op, aligned_dims, expect


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotate_half_t(y):
    """Transpose of :func:`rotate_half` (used by the backward)."""
    half = y.shape[-1] // 2
    return np.concatenate([y[..., half:], -y[..., :half]], axis=-1)


def _rotary_shape(in_shapes):
    q, k, cos, sin = in_shapes
    expect(len(q) == 4 and len(k) == 4, f"rotary: q {q} and k {k} must be [B, S, heads, D]")
    expect(q[:2] == k[:2] and q[3] == k[3], f"rotary: q {q} and k {k} differ")
    expect(cos == sin == (q[1], q[3]), f"rotary: cos/sin {cos} must be [S, D] for {q}")
    expect(q[3] % 2 == 0, f"rotary: head dim {q[3]} must be even")
    return [tuple(q), tuple(k)]


def _rotary_forward(xp, x):
    q, k, cos, sin = x
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return (q * c + rotate_half(q) * s, k * c + rotate_half(k) * s)


def _rotary_backward(xp, saved, g, shapes):
    cos, sin = saved[2], saved[3]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return (g[0] * c + rotate_half_t(g[0] * s), g[1] * c + rotate_half_t(g[1] * s), None, None)


def _rotary_dims(ins, outs):
    refs = {("i", 0): ins[0], ("i", 1): ins[1], ("o", 0): outs[0], ("o", 1): outs[1]}
    rel = []
    for (a, b) in ((("i", 0), ("o", 0)), (("i", 1), ("o", 1))):
        if refs[a] is not None and refs[b] is not None:
            rel += [("eq", (*a, k), (*b, k)) for k in range(4)]
    qk = [r for r in refs if refs[r] is not None]
    for k in (0, 1, 3):
        rel += [("eq", (*qk[0], k), (*r, k)) for r in qk[1:]]
    for i in (2, 3):
        if ins[i] is not None and qk:
            rel += [("eq", ("i", i, 0), (*qk[0], 1)), ("eq", ("i", i, 1), (*qk[0], 3))]
    if qk:
        rel.append(("min", (*qk[0], 3), 2))
    return rel


ROTARY = Op(
    "apply_rotary_emb",
    dims=_rotary_dims,
    shape=_rotary_shape,
    forward=_rotary_forward,
    backward=_rotary_backward,
    saves=(2, 3),
    diff=(0, 1),
    doc="rotary position embedding of q and k, cos/sin given as [S, D] buffers",
)


def causal_positions(s_q: int, s_k: int, row_chunk: int = 0, col_chunk: int = 0,
                     order: tuple[int, ...] | None = None) -> np.ndarray:
    """True where a query position may not see a key position. The local
    rows are query positions ``row_chunk * s_q + i`` and the local columns
    key positions ``col_chunk * s_k + j`` of the whole sequence (chunks of a
    context-parallel split; 0 and 0 for the whole sequence). ``order``: the
    whole sequence laid out in ``len(order)`` equal chunks, slot m holding
    chunk ``order[m]`` (a load balancer's order, docs/soundness.md, "Plans
    traced from PyTorch", 64); rows and columns are then slots of that
    layout and compared by the positions they hold."""
    rows = row_chunk * s_q + np.arange(s_q)
    cols = col_chunk * s_k + np.arange(s_k)
    if order is not None:
        rows, cols = _placed(rows, s_q, order), _placed(cols, s_k, order)
    return cols[None, :] > rows[:, None]


def _placed(slots: np.ndarray, size: int, order: tuple[int, ...]) -> np.ndarray:
    """The positions the slots of a sequence of ``size`` laid out in the
    chunk order ``order`` hold."""
    m = len(order)
    expect(size % m == 0 and sorted(order) == list(range(m)),
           f"a chunk order {tuple(order)} of a sequence of {size}")
    n = size // m
    return np.asarray(order)[slots // n] * n + slots % n


def _mask_shape(in_shapes, row_chunk: int = 0, col_chunk: int = 0):
    (x,) = in_shapes
    expect(len(x) >= 2, f"causal mask needs [..., S, S], got {x}")
    return [tuple(x)]


def _mask_dims(ins, outs, row_chunk: int = 0, col_chunk: int = 0):
    """Elementwise, and both sequence dims at least 2 long: at 1 the mask
    hides nothing, and a plan that drops it would look right. A square mask
    ties its two sequence dims into one class: they index one sequence, so
    they must be reduced by one order-preserving map (docs/soundness.md,
    "The causal mask on a split sequence")."""
    rel = aligned_dims(ins, outs)
    x = ins[0] if ins[0] is not None else outs[0]
    side = "i" if ins[0] is not None else "o"
    rows, cols = (side, 0, len(x) - 2), (side, 0, len(x) - 1)
    rel += [("min", rows, 2), ("min", cols, 2)]
    return rel + [("eq", rows, cols)] if x[-2] == x[-1] else rel


CAUSAL_MASK = Op(
    "causal_mask",
    dims=_mask_dims,
    shape=_mask_shape,
    forward=lambda xp, x, row_chunk=0, col_chunk=0: (
        np.where(causal_positions(*x[0].shape[-2:], row_chunk, col_chunk), -np.inf, x[0]),
    ),
    backward=lambda xp, s, g, shapes, row_chunk=0, col_chunk=0: (
        np.where(causal_positions(*shapes[0][-2:], row_chunk, col_chunk), 0.0, g[0]),
    ),
    doc="scores of keys after the query set to -inf; row_chunk/col_chunk place a "
        "chunk of the sequence",
)


def route_numeric(scores: np.ndarray, topk: int, capacity: int) -> np.ndarray:
    """Dispatch mask [B, S, E, C] of top-k routing with a static capacity.

    Each sample is routed on its own: tokens in order, each token's experts in
    order of decreasing score; a token takes the next free slot of an expert
    and is dropped there when the expert's ``capacity`` slots are full.
    """
    b, s, e = scores.shape
    dispatch = np.zeros((b, s, e, capacity))
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :topk]
    for i in range(b):
        fill = np.zeros(e, dtype=int)
        for t in range(s):
            for ex in order[i, t]:
                if fill[ex] < capacity:
                    dispatch[i, t, ex, fill[ex]] = 1.0
                fill[ex] += 1
    return dispatch


def _route_dims(ins, outs, topk, capacity):
    if ins[0] is None:
        return []
    rel = [("min", ("i", 0, 2), topk)]  # top-k needs k experts at any size
    if outs[0] is None:
        return rel
    return rel + [("eq", ("i", 0, k), ("o", 0, k)) for k in range(3)]


def _resize_route(kw, ins, outs):
    kw["capacity"] = outs[0][3]
    return kw


def _route_shape(in_shapes, topk, capacity):
    (x,) = in_shapes
    expect(len(x) == 3, f"route: scores must be [B, S, E], got {x}")
    expect(1 <= topk <= x[2], f"route: top-{topk} of {x[2]} experts")
    return [tuple(x) + (capacity,)]


ROUTE = Op(
    "route",
    dims=_route_dims,
    resize=_resize_route,
    shape=_route_shape,
    forward=lambda xp, x, topk, capacity: (xp.route(x[0], topk, capacity),),
    doc="top-k dispatch mask per sample; no gradient; uninterpreted per row symbolically",
)

# Attention with its log-sum-exp: the per-block kernel of context-parallel
# rings and its flash backward (docs/soundness.md, "Exponentials and
# logarithms: the exact merge of attention blocks").


def _scores(q, k, scale, causal, row_chunk, col_chunk, order=None):
    """The scaled scores and where the causal mask hides them (the scores
    themselves are left finite: masked entries are dropped by position)."""
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    hidden = (causal_positions(q.shape[-2], k.shape[-2], row_chunk, col_chunk, order) if causal
              else np.zeros((q.shape[-2], k.shape[-2]), dtype=bool))
    return s, np.broadcast_to(hidden, s.shape)


def _row_max(xp, s, hidden):
    """The maximum of each row's visible scores, [..., R, 1]; 0 for a row
    with every key hidden."""
    m = np.full((*s.shape[:-1], 1), -np.inf)
    for j in range(s.shape[-1]):
        m = np.where(hidden[..., j:j + 1], m, xp.maximum(m, s[..., j:j + 1]))
    return np.where(hidden.all(-1, keepdims=True), 0.0, m)


def _attention_values(xp, q, k, v, scale, causal, row_chunk, col_chunk, order=None):
    s, hidden = _scores(q, k, scale, causal, row_chunk, col_chunk, order)
    m = _row_max(xp, s, hidden)
    e = np.where(hidden, 0.0, xp.exp(np.where(hidden, 0.0, s) - m))
    empty = hidden.all(-1, keepdims=True)
    total = np.where(empty, 1.0, e.sum(-1, keepdims=True))
    out = (e @ v) / total
    lse = np.where(empty, -np.inf, m + xp.log(total))[..., 0]
    return out, lse


def _attention_forward(xp, x, scale, causal=False, row_chunk=0, col_chunk=0, order=None):
    return _attention_values(xp, *x, scale, causal, row_chunk, col_chunk, order)


def _attention_grads(xp, dout, q, k, v, out, lse, scale, causal, row_chunk, col_chunk,
                     dlse=None, order=None):
    """The flash backward: probabilities from the forward's lse, the row term
    from its out. ``dlse``: a gradient of lse too (it adds p * dlse)."""
    s, hidden = _scores(q, k, scale, causal, row_chunk, col_chunk, order)
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.where(hidden, 0.0, xp.exp(np.where(hidden, 0.0, s) - lse[..., None]))
    dv = np.swapaxes(p, -1, -2) @ dout
    row = (dout * out).sum(-1, keepdims=True)
    ds = p * (dout @ np.swapaxes(v, -1, -2) - row)
    if dlse is not None:
        ds = ds + p * dlse[..., None]
    dq = (ds @ k) * scale
    dk = (np.swapaxes(ds, -1, -2) @ q) * scale
    return dq, dk, dv


def _attention_backward(xp, saved, g, shapes, scale, causal=False, row_chunk=0, col_chunk=0,
                        order=None):
    q, k, v = saved[:3]
    out, lse = _attention_values(xp, q, k, v, scale, causal, row_chunk, col_chunk, order)
    dout = g[0] if g[0] is not None else np.zeros(out.shape)
    return _attention_grads(xp, dout, q, k, v, out, lse, scale, causal, row_chunk, col_chunk,
                            g[1], order)


def _attention_grad_forward(xp, x, scale, causal=False, row_chunk=0, col_chunk=0, order=None):
    return _attention_grads(xp, *x, scale, causal, row_chunk, col_chunk, order=order)


def _check_qkv(q, k, v, what):
    expect(len(q) >= 2 and len(k) == len(q) and len(v) == len(q),
           f"{what}: q, k, v must have one rank >= 2, got {q}, {k}, {v}")
    expect(tuple(q[:-2]) == tuple(k[:-2]) == tuple(v[:-2]),
           f"{what}: batch dims differ: {q}, {k}, {v}")
    expect(q[-1] == k[-1], f"{what}: q {q} and k {k} differ in the head dim")
    expect(k[-2] == v[-2], f"{what}: k {k} and v {v} differ in the number of keys")


def _check_order(q, k, row_chunk, col_chunk, order, what):
    """A chunk order lays out one whole sequence: queries and keys of one
    length it divides, at chunk offsets 0."""
    if order is None:
        return
    m = len(order)
    expect(sorted(order) == list(range(m)) and m > 0 and q[-2] == k[-2] and q[-2] % m == 0
           and not row_chunk and not col_chunk,
           f"{what}: a chunk order {tuple(order)} needs queries and keys of one length it "
           f"divides, at chunk offsets 0; got {q}, {k}")


def _attention_shape(in_shapes, scale, causal=False, row_chunk=0, col_chunk=0, order=None):
    expect(len(in_shapes) == 3, "attention takes q, k, v")
    q, k, v = in_shapes
    _check_qkv(q, k, v, "attention")
    _check_order(q, k, row_chunk, col_chunk, order, "attention")
    return [(*q[:-1], v[-1]), tuple(q[:-1])]


def _attention_grad_shape(in_shapes, scale, causal=False, row_chunk=0, col_chunk=0,
                          order=None):
    expect(len(in_shapes) == 6, "attention_grad takes dout, q, k, v, out, lse")
    dout, q, k, v, out, lse = in_shapes
    _check_qkv(q, k, v, "attention_grad")
    _check_order(q, k, row_chunk, col_chunk, order, "attention_grad")
    want = (*q[:-1], v[-1])
    expect(tuple(dout) == want and tuple(out) == want,
           f"attention_grad: dout {dout} and out {out} must be {want}")
    expect(tuple(lse) == tuple(q[:-1]), f"attention_grad: lse {lse} must be {tuple(q[:-1])}")
    return [tuple(q), tuple(k), tuple(v)]


#: the dims of each tensor of attention after its batch dims
_LAYOUT = {"q": ("R", "D"), "k": ("C", "D"), "v": ("C", "Dv"), "out": ("R", "Dv"), "lse": ("R",)}


def _ties(slots: list[tuple[str, str, int, tuple | None]]) -> list[tuple]:
    """Dims relations of attention's tensors, given as (kind, side, position,
    shape): batch dims aligned; rows, keys, head and value dims tied by
    role; the head dim at least 2; the row and key dims kept whole (a
    block's mask places it by its chunk index: at full size every chunk
    boundary and the diagonal are kept as they are)."""
    named: dict[object, list[tuple]] = {}
    for kind, side, pos, shape in slots:
        if shape is None:
            continue
        roles = _LAYOUT[kind]
        batch = len(shape) - len(roles)
        for d in range(len(shape)):
            name = d if d < batch else roles[d - batch]
            named.setdefault(name, []).append(((side, pos, d), shape[d]))
    rel: list[tuple] = []
    for name, refs in named.items():
        rel += [("eq", refs[0][0], r) for r, _ in refs[1:]]
        if name == "D":
            rel.append(("min", refs[0][0], 2))
        if name in ("R", "C"):
            rel += [("min", r, n) for r, n in refs]
    return rel


def _attention_dims(ins, outs, **_kw):
    kinds = [("q", "i", 0), ("k", "i", 1), ("v", "i", 2), ("out", "o", 0), ("lse", "o", 1)]
    shapes = [*ins, *outs]
    return _ties([(k, s, p, shape) for (k, s, p), shape in zip(kinds, shapes)])


def _attention_grad_dims(ins, outs, **_kw):
    kinds = [("out", "i", 0), ("q", "i", 1), ("k", "i", 2), ("v", "i", 3), ("out", "i", 4),
             ("lse", "i", 5), ("q", "o", 0), ("k", "o", 1), ("v", "o", 2)]
    shapes = [*ins, *outs]
    return _ties([(k, s, p, shape) for (k, s, p), shape in zip(kinds, shapes)])


ATTENTION = Op(
    "attention",
    dims=_attention_dims,
    shape=_attention_shape,
    forward=_attention_forward,
    backward=_attention_backward,
    saves=(0, 1, 2),
    doc="softmax(scale q k^T, causally masked at row_chunk/col_chunk, or by the positions "
        "a chunk order places) v and the rows' "
        "log-sum-exp (a flash kernel's two outputs)",
)

ATTENTION_GRAD = Op(
    "attention_grad",
    dims=_attention_grad_dims,
    shape=_attention_grad_shape,
    forward=_attention_grad_forward,
    doc="the flash backward of attention: dq, dk, dv from dout, q, k, v and the "
        "forward's out and lse",
)


def _neg_inf(x) -> np.ndarray:
    """Where an array holds -inf (a Python or numpy float; never a term)."""
    return np.vectorize(lambda v: isinstance(v, float) and v == -np.inf, otypes=[bool])(x) \
        if np.size(x) else np.zeros(np.shape(x), dtype=bool)


def _lse_merge_forward(xp, x):
    """Two attentions over disjoint key sets merged by their log-sum-exps,
    with the maximum shift kernels use: m = max(la, lb), lse = m +
    log(exp(la - m) + exp(lb - m)), out = exp(la - lse) oa + exp(lb - lse) ob.
    A side whose lse is -inf (it saw no key) weighs 0; both: 0 and -inf."""
    oa, la, ob, lb = x
    ea, eb = _neg_inf(la), _neg_inf(lb)
    both = ea & eb
    la0, lb0 = np.where(ea, 0.0, la), np.where(eb, 0.0, lb)
    m = np.where(ea, lb0, np.where(eb, la0, xp.maximum(la0, lb0)))
    wa = np.where(ea, 0.0, xp.exp(la0 - m))
    wb = np.where(eb, 0.0, xp.exp(lb0 - m))
    total = np.where(both, 1.0, wa + wb)
    lse = m + xp.log(total)
    pa = np.where(ea, 0.0, xp.exp(la0 - lse))
    pb = np.where(eb, 0.0, xp.exp(lb0 - lse))
    out = pa[..., None] * oa + pb[..., None] * ob
    return np.where(both[..., None], 0.0, out), np.where(both, -np.inf, lse)


def _lse_merge_shape(in_shapes):
    expect(len(in_shapes) == 4, "lse_merge takes out_a, lse_a, out_b, lse_b")
    oa, la, ob, lb = (tuple(s) for s in in_shapes)
    expect(oa == ob and la == lb and len(oa) >= 1 and la == oa[:-1],
           f"lse_merge: outs {oa}, {ob} and lses {la}, {lb} do not fit")
    return [oa, la]


def _lse_merge_dims(ins, outs):
    shapes = [*ins, *outs]
    slots = [("i", 0), ("i", 1), ("i", 2), ("i", 3), ("o", 0), ("o", 1)]
    refs: dict[int, list[tuple]] = {}
    for (side, pos), shape in zip(slots, shapes):
        if shape is not None:
            for d in range(len(shape)):
                refs.setdefault(d, []).append((side, pos, d))
    return [("eq", r[0], o) for r in refs.values() for o in r[1:]]


LSE_MERGE = Op(
    "lse_merge",
    dims=_lse_merge_dims,
    shape=_lse_merge_shape,
    forward=_lse_merge_forward,
    doc="two attentions over disjoint keys merged by their log-sum-exps (max-shifted): "
        "(out, lse) of the union",
)


OPS = (ROTARY, CAUSAL_MASK, ROUTE, ATTENTION, ATTENTION_GRAD, LSE_MERGE)
