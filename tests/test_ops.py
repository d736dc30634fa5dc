"""The operator rule table against torch autograd (float64), op by op.

Every operator with a backward rule is checked forward AND backward against
torch on small seeded random inputs; the others forward only (collectives
against numpy expectations). Every case also checks that the shape rule agrees
with the shape the forward actually produced, and each op's shape rule is
made to raise ShapeError on inputs that do not fit.

``COVERED`` lists the operators this file tests; ``test_every_op_is_covered``
fails when verdict.ops.OPS gains an operator that is not in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gen_model import leaf
from gen_model.models.llama3 import rotary_tables
from verdict.numeric import NumericXP
from verdict.ops import OPS, ShapeError, get_op
from verdict.ops.nn import route_numeric

RTOL = 1e-12
ATOL = 1e-14  # entries that cancel to ~0 have no meaningful relative error

COVERED = {
    # elementwise
    "add", "sub", "mul", "add_scalar", "mul_scalar", "div", "pow", "rsqrt", "exp", "log",
    "silu", "softmax",
    # linalg
    "linear", "matmul", "einsum", "embedding",
    # layout
    "transpose", "unflatten", "flatten", "repeat_interleave", "sum", "mean", "max",
    # nn (model leaves)
    "apply_rotary_emb", "causal_mask", "route", "attention", "attention_grad",
    "lse_merge",
    # step
    "multiref", "zeros", "ones", "local_grad_accumulation", "detach", "sgd_step", "adam_step",
    # collectives
    "all_reduce", "all_reduce_max", "reducer", "all_gather", "reduce_scatter", "all_to_all", "split",
    "send_recv", "broadcast", "all_reduce_avg", "reduce_scatter_avg",
    # torch-side
    "expand", "gelu", "tanh", "sigmoid", "relu", "cat", "narrow", "clamp",
}

COLLECTIVES = {
    "all_reduce", "all_reduce_max", "reducer", "all_gather", "reduce_scatter", "all_to_all", "split",
    "send_recv", "broadcast", "all_reduce_avg", "reduce_scatter_avg",
}


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(*shape: int, seed: int = 0) -> np.ndarray:
    return rng(seed).standard_normal(shape)


def one_hot(ids: np.ndarray, n: int) -> np.ndarray:
    return np.eye(n)[ids]


# ---------------------------------------------------------------- autograd cases


@dataclass
class Case:
    """One op applied to ``inputs``; ``torch_fn`` is its torch equivalent.

    ``grad`` lists the input positions torch differentiates (default: the
    op's ``diff``); the numeric backward must give None at the others.
    """

    id: str
    op: str
    inputs: list[np.ndarray]
    torch_fn: Callable[..., Any]
    kw: dict[str, Any] = field(default_factory=dict)
    grad: tuple[int, ...] | None = None


def _torch_reduce(op: str, dim: Any, keep: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        if dim is None:
            return getattr(t, op)()
        return getattr(t, op)(dim=tuple(dim) if isinstance(dim, list) else dim, keepdim=keep)

    return fn


def _torch_attention(q, k, v, scale, causal=False, row_chunk=0, col_chunk=0):
    """softmax(scale q k^T masked) v and the rows' logsumexp, in torch."""
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q.shape[-2])[:, None] + row_chunk * q.shape[-2]
        cols = torch.arange(k.shape[-2])[None, :] + col_chunk * k.shape[-2]
        s = s.masked_fill(cols > rows, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _cases() -> list[Case]:
    c: list[Case] = []
    # -- elementwise, with and without broadcasting
    c.append(Case("add_same", "add", [randn(2, 3, 4, seed=1), randn(2, 3, 4, seed=2)],
                  lambda a, b: a + b))
    c.append(Case("add_bcast_last", "add", [randn(2, 3, 4, seed=1), randn(2, 3, 1, seed=2)],
                  lambda a, b: a + b))
    c.append(Case("add_bcast_rank", "add", [randn(2, 3, 4, seed=1), randn(4, seed=2)],
                  lambda a, b: a + b))
    c.append(Case("add_bcast_both", "add", [randn(3, 1, seed=1), randn(1, 4, seed=2)],
                  lambda a, b: a + b))
    c.append(Case("mul_same", "mul", [randn(2, 3, 4, seed=3), randn(2, 3, 4, seed=4)],
                  lambda a, b: a * b))
    c.append(Case("mul_bcast_last", "mul", [randn(2, 3, 4, seed=3), randn(2, 3, 1, seed=4)],
                  lambda a, b: a * b))
    c.append(Case("mul_bcast_rank", "mul", [randn(2, 3, 4, seed=3), randn(4, seed=4)],
                  lambda a, b: a * b))
    c.append(Case("mul_bcast_mid", "mul", [randn(2, 1, 4, seed=3), randn(3, 1, seed=4)],
                  lambda a, b: a * b))
    c.append(Case("sub_bcast_last", "sub", [randn(2, 3, 4, seed=1), randn(2, 3, 1, seed=2)],
                  lambda a, b: a - b))
    c.append(Case("sub_bcast_rank", "sub", [randn(2, 3, 4, seed=1), randn(4, seed=2)],
                  lambda a, b: a - b))
    c.append(Case("exp", "exp", [randn(2, 3, seed=5)], torch.exp))
    c.append(Case("log", "log", [rng(9).uniform(0.2, 3.0, (2, 3))], torch.log))
    c.append(Case("add_scalar", "add_scalar", [randn(2, 3, seed=5)], lambda x: x + 0.75,
                  {"value": 0.75}))
    c.append(Case("mul_scalar", "mul_scalar", [randn(2, 3, seed=6)], lambda x: x * -1.5,
                  {"value": -1.5}))
    c.append(Case("div", "div", [randn(2, 3, seed=7)], lambda x: x / 2.8284271247461903,
                  {"value": 2.8284271247461903}))
    for e in (2, 3):
        c.append(Case(f"pow{e}", "pow", [randn(2, 3, 4, seed=8)], lambda x, e=e: x.pow(e),
                      {"exponent": e}))
    c.append(Case("rsqrt", "rsqrt", [rng(9).uniform(0.2, 3.0, (2, 3, 4))], torch.rsqrt))
    c.append(Case("silu", "silu", [randn(2, 3, 4, seed=10) * 3], F.silu))
    for d in (-1, 1, 0):
        c.append(Case(f"softmax_dim{d}", "softmax", [randn(2, 3, 4, seed=11) * 2],
                      lambda x, d=d: torch.softmax(x, dim=d), {"dim": d}))
    with_inf = randn(2, 3, 4, seed=12)
    with_inf[0, 1, 2] = with_inf[1, 0, 0] = with_inf[1, 0, 3] = -np.inf
    c.append(Case("softmax_neg_inf", "softmax", [with_inf],
                  lambda x: torch.softmax(x, dim=-1), {"dim": -1}))

    # -- contractions
    c.append(Case("linear_3d", "linear", [randn(2, 3, 4, seed=13), randn(5, 4, seed=14)],
                  lambda x, w: x @ w.T))
    c.append(Case("linear_2d", "linear", [randn(3, 4, seed=13), randn(2, 4, seed=14)],
                  lambda x, w: F.linear(x, w)))
    c.append(Case("matmul_4d", "matmul", [randn(2, 3, 4, 5, seed=15), randn(2, 3, 5, 6, seed=16)],
                  torch.matmul))
    c.append(Case("matmul_2d", "matmul", [randn(3, 4, seed=15), randn(4, 2, seed=16)],
                  torch.matmul))
    b, s, e, cap, h, f = 2, 3, 4, 2, 5, 3
    dispatch = (rng(17).uniform(size=(b, s, e, cap)) < 0.4).astype(float)
    moe_eqs = {
        "bsec,bse->bsec": [dispatch, randn(b, s, e, seed=18)],
        "bsec,bsh->bech": [dispatch, randn(b, s, h, seed=19)],
        "bech,efh->becf": [randn(b, e, cap, h, seed=20), randn(e, f, h, seed=21)],
        "becf,ehf->bech": [randn(b, e, cap, f, seed=22), randn(e, h, f, seed=23)],
        "bsec,bech->bsh": [randn(b, s, e, cap, seed=24), randn(b, e, cap, h, seed=25)],
        "ij,jk->ik": [randn(3, 4, seed=26), randn(4, 2, seed=27)],
    }
    for eq, xs in moe_eqs.items():
        c.append(Case(f"einsum[{eq}]", "einsum", xs,
                      lambda x, y, eq=eq: torch.einsum(eq, x, y), {"eq": eq}))
    ids = rng(28).integers(0, 7, size=(2, 3))
    c.append(Case("embedding", "embedding", [one_hot(ids, 7), randn(7, 5, seed=29)],
                  lambda oh, w: oh @ w))
    c.append(Case("embedding_vs_F", "embedding", [one_hot(ids, 7), randn(7, 5, seed=29)],
                  lambda oh, w: F.embedding(oh.argmax(-1), w)))

    # -- layout and reductions
    x = randn(2, 3, 4, seed=30)
    for d0, d1 in ((1, 2), (0, -1), (2, 0)):
        c.append(Case(f"transpose_{d0}_{d1}", "transpose", [x],
                      lambda t, d0=d0, d1=d1: t.transpose(d0, d1), {"dim0": d0, "dim1": d1}))
    x6 = randn(2, 6, 4, seed=31)
    for dim, sizes in ((-1, [2, 2]), (1, [3, 2]), (0, [1, 2])):
        c.append(Case(f"unflatten_{dim}_{sizes}", "unflatten", [x6],
                      lambda t, dim=dim, sizes=sizes: t.unflatten(dim, sizes),
                      {"dim": dim, "sizes": sizes}))
    x4 = randn(2, 3, 4, 2, seed=32)
    for start, end in ((1, 2), (0, -1), (2, -1), (1, 1)):
        c.append(Case(f"flatten_{start}_{end}", "flatten", [x4],
                      lambda t, a=start, z=end: torch.flatten(t, a, z),
                      {"start": start, "end": end}))
    for reps, dim in ((2, 2), (3, -1), (2, 0)):
        c.append(Case(f"repeat_interleave_{reps}_{dim}", "repeat_interleave", [x4],
                      lambda t, r=reps, d=dim: t.repeat_interleave(r, dim=d),
                      {"repeats": reps, "dim": dim}))
    reductions: list[tuple[Any, bool]] = [
        (None, False), (-1, False), (-1, True), (1, False), (1, True), ([0, 2], False),
        ([0, 2], True), ([0, 1, 2], False),
    ]
    for op in ("sum", "mean"):
        for dim, keep in reductions:
            c.append(Case(f"{op}_dim{dim}_keep{keep}", op, [x], _torch_reduce(op, dim, keep),
                          {"dim": dim, "keepdim": keep}))

    # -- model leaves
    q, k = randn(2, 5, 4, 6, seed=33), randn(2, 5, 2, 6, seed=34)
    cos, sin = (t.numpy() for t in rotary_tables(5, 6, theta=10.0))
    c.append(Case("rotary_tables", "apply_rotary_emb", [q, k, cos, sin],
                  leaf.apply_rotary_emb, grad=(0, 1)))
    c.append(Case("rotary_random_cos_sin", "apply_rotary_emb",
                  [q, k, randn(5, 6, seed=35), randn(5, 6, seed=36)],
                  leaf.apply_rotary_emb, grad=(0, 1)))
    c.append(Case("causal_mask_square", "causal_mask", [randn(2, 3, 4, 4, seed=37)],
                  leaf.causal_mask))
    c.append(Case("causal_mask_rect", "causal_mask", [randn(3, 5, seed=38)], leaf.causal_mask))
    qkv = [randn(2, 3, 3, 2, seed=61), randn(2, 3, 5, 2, seed=62), randn(2, 3, 5, 3, seed=63)]
    for chunks in ((0, 0), (1, 1), (2, 0)):
        kw = {"scale": 0.7, "causal": True, "row_chunk": chunks[0], "col_chunk": chunks[1]}
        c.append(Case(f"attention_causal_{chunks[0]}_{chunks[1]}", "attention",
                      [x[..., :3, :] if chunks[1] and i else x for i, x in enumerate(qkv)],
                      lambda q, k, v, kw=kw: _torch_attention(q, k, v, **kw), kw))
    c.append(Case("attention_full", "attention", qkv, lambda q, k, v: _torch_attention(q, k, v, 0.5),
                  {"scale": 0.5}))

    # -- max (torch.amax): ties share the gradient evenly
    ties = np.array([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [5.0, -1.0, 0.0, 4.0]],
                     [[0.5, 0.5, -2.0, 0.5], [1.0, 2.0, 3.0, 4.0], [7.0, 7.0, 6.0, 7.0]]])
    for dim, keep in ((-1, True), (-1, False), (1, False), ([0, 2], True), (None, False)):
        c.append(Case(f"max_ties_{dim}_{keep}", "max", [ties],
                      _torch_reduce("amax", dim if dim is not None else None, keep),
                      {"dim": dim, "keepdim": keep}))
    c.append(Case("max_random", "max", [randn(2, 3, 5, seed=41)],
                  _torch_reduce("amax", -1, True), {"dim": [-1], "keepdim": True}))

    # -- step
    c.append(Case("multiref3", "multiref", [randn(2, 3, seed=39)],
                  lambda t: (t.clone(), t * 1.0, t + 0.0), {"times": 3}))
    c.append(Case("multiref2", "multiref", [randn(4, seed=40)],
                  lambda t: (t.clone(), t.clone()), {"times": 2}))
    # -- torch-side
    c.append(Case("expand_lead_and_ones", "expand", [randn(3, 1, 4, seed=41)],
                  lambda t: t.expand(2, 3, 5, 4), {"shape": [2, 3, 5, 4]}))
    c.append(Case("expand_scalar", "expand", [randn(seed=42)],
                  lambda t: t.expand(2, 3), {"shape": [2, 3]}))
    wide = randn(2, 3, 4, seed=43) * 3
    c.append(Case("gelu_erf", "gelu", [wide], F.gelu, {"approximate": "none"}))
    c.append(Case("gelu_tanh", "gelu", [wide], lambda t: F.gelu(t, approximate="tanh"),
                  {"approximate": "tanh"}))
    c.append(Case("tanh", "tanh", [wide], torch.tanh))
    c.append(Case("sigmoid", "sigmoid", [wide], torch.sigmoid))
    c.append(Case("relu", "relu", [wide], torch.relu))
    pieces = [randn(2, 3, 4, seed=44), randn(2, 3, 4, seed=45), randn(2, 3, 4, seed=46)]
    c.append(Case("cat_equal", "cat", pieces, lambda *t: torch.cat(t, dim=-1), {"dim": -1}))
    c.append(Case("cat_uneven", "cat", [randn(2, 1, 4, seed=47), randn(2, 3, 4, seed=48)],
                  lambda *t: torch.cat(t, dim=1), {"dim": 1}))
    c.append(Case("narrow", "narrow", [randn(2, 7, 3, seed=49)],
                  lambda t: t.narrow(1, 2, 4), {"dim": 1, "start": 2, "length": 4}))
    return c


CASES = _cases()


def _as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _torch_run(case: Case, positions: tuple[int, ...], upstream_seed: int):
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=i in positions)
          for i, x in enumerate(case.inputs)]
    outs = _as_tuple(case.torch_fn(*ts))
    r = rng(upstream_seed)
    ups = [r.standard_normal(tuple(o.shape)) for o in outs]
    grads = torch.autograd.grad(
        outs, [ts[i] for i in positions],
        grad_outputs=[torch.tensor(u) for u in ups], allow_unused=True,
    )
    return [o.detach().numpy() for o in outs], ups, dict(zip(positions, grads, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_forward_backward_match_torch(case: Case) -> None:
    rule = get_op(case.op)
    xp = NumericXP()
    diff = case.grad if case.grad is not None else rule.differentiable_inputs(len(case.inputs))
    assert rule.backward is not None
    t_out, ups, t_grads = _torch_run(case, tuple(diff), upstream_seed=100 + len(case.id))

    n_out = rule.forward(xp, tuple(case.inputs), **case.kw)
    assert isinstance(n_out, tuple) and len(n_out) == len(t_out)
    shapes = rule.shape([x.shape for x in case.inputs], **case.kw)
    assert [tuple(s) for s in shapes] == [tuple(np.shape(o)) for o in n_out]
    for got, want in zip(n_out, t_out, strict=True):
        assert np.shape(got) == want.shape
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

    in_shapes = tuple(x.shape for x in case.inputs)
    n_grads = rule.backward(xp, rule.saved(case.inputs), tuple(ups), in_shapes, **case.kw)
    assert len(n_grads) == len(case.inputs)
    for i, g in enumerate(n_grads):
        if i not in diff:
            assert g is None, f"input {i} of {case.op} takes no gradient"
            continue
        want = t_grads[i]
        want = np.zeros(case.inputs[i].shape) if want is None else want.numpy()
        assert np.shape(g) == case.inputs[i].shape
        np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL)


def test_backward_sees_only_saved_inputs() -> None:
    """A backward must not read inputs its op does not save (bw nodes get None there)."""
    xp = NumericXP()
    for case in CASES:
        rule = get_op(case.op)
        saved = rule.saved(case.inputs)
        assert all((s is None) == (i not in rule.saves) for i, s in enumerate(saved))
        ups = [np.ones(s) for s in rule.shape([x.shape for x in case.inputs], **case.kw)]
        rule.backward(xp, saved, tuple(ups), tuple(x.shape for x in case.inputs), **case.kw)


def test_add_backward_skips_unwanted_grad() -> None:
    """A bw node of a broadcasting add whose second input needs no gradient
    passes shape None there; the rule must give None for it."""
    rule = get_op("add")
    g = randn(2, 3, 4, seed=41)
    ga, gb = rule.backward(NumericXP(), (None, None), (g,), ((2, 3, 4), None))
    assert gb is None
    np.testing.assert_array_equal(ga, g)


def test_causal_mask_then_softmax_matches_torch() -> None:
    """The causal mask's -inf entries go through softmax (forward and backward)."""
    x = randn(2, 2, 5, 5, seed=42)
    up = randn(2, 2, 5, 5, seed=43)
    t = torch.tensor(x, requires_grad=True)
    y = torch.softmax(leaf.causal_mask(t), dim=-1)
    (tg,) = torch.autograd.grad(y, [t], grad_outputs=[torch.tensor(up)])

    xp = NumericXP()
    mask, soft = get_op("causal_mask"), get_op("softmax")
    (masked,) = mask.forward(xp, (x,))
    assert np.isneginf(masked).sum() == 2 * 2 * 10
    (probs,) = soft.forward(xp, (masked,), dim=-1)
    np.testing.assert_allclose(probs, y.detach().numpy(), rtol=RTOL, atol=ATOL)
    assert np.all(probs[..., np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] == 0.0)
    (g_masked,) = soft.backward(xp, soft.saved((masked,)), (up,), (masked.shape,), dim=-1)
    assert np.all(np.isfinite(g_masked))
    (g,) = mask.backward(xp, mask.saved((x,)), (g_masked,), (x.shape,))
    np.testing.assert_allclose(g, tg.numpy(), rtol=RTOL, atol=ATOL)


def test_einsum_backward_refuses_index_summed_alone() -> None:
    """An index that only one operand carries and the output drops cannot be
    differentiated by the rule; it must say so rather than return garbage."""
    rule = get_op("einsum")
    x, y = randn(3, 4, seed=44), randn(4, 2, seed=45)
    (out,) = rule.forward(NumericXP(), (x, y), eq="ij,jk->k")
    with pytest.raises(ShapeError):
        rule.backward(NumericXP(), (x, y), (np.ones_like(out),), (x.shape, y.shape), eq="ij,jk->k")


# ---------------------------------------------------------------- forward-only ops


def test_zeros_ones() -> None:
    xp = NumericXP()
    for name, fill in (("zeros", torch.zeros), ("ones", torch.ones)):
        rule = get_op(name)
        assert rule.backward is None
        for shape in ([], [3], [2, 3, 4]):
            (out,) = rule.forward(xp, (), shape=shape)
            np.testing.assert_array_equal(out, fill(tuple(shape), dtype=torch.float64).numpy())
            assert rule.shape([], shape=shape) == [tuple(shape)]
        with pytest.raises(ShapeError):
            rule.shape([(2,)], shape=[2])


def test_local_grad_accumulation() -> None:
    rule = get_op("local_grad_accumulation")
    assert rule.backward is None
    a, b = randn(3, 4, seed=46), randn(3, 4, seed=47)
    (out,) = rule.forward(NumericXP(), (a, b))
    np.testing.assert_array_equal(out, (torch.tensor(a) + torch.tensor(b)).numpy())
    assert rule.shape([(3, 4), (3, 4)]) == [(3, 4)]
    with pytest.raises(ShapeError):
        rule.shape([(3, 4), (4, 3)])
    with pytest.raises(ShapeError):
        rule.shape([(3, 4)])


# ---------------------------------------------------------------- routing


def _expected_dispatch(scores: np.ndarray, topk: int, capacity: int) -> np.ndarray:
    """Independent statement of the routing contract: per sample and expert,
    the first ``capacity`` tokens (in token order) that rank the expert in
    their top-k take slots 0, 1, ...; later ones are dropped."""
    b, s, e = scores.shape
    out = np.zeros((b, s, e, capacity))
    for i in range(b):
        for ex in range(e):
            takers = [t for t in range(s)
                      if ex in sorted(range(e), key=lambda j, t=t: (-scores[i, t, j], j))[:topk]]
            for slot, t in enumerate(takers[:capacity]):
                out[i, t, ex, slot] = 1.0
    return out


def _check_dispatch_invariants(d: np.ndarray, topk: int) -> None:
    assert set(np.unique(d)) <= {0.0, 1.0}
    assert np.all(d.sum(axis=(2, 3)) <= topk)  # a token takes at most topk slots
    assert np.all(d.sum(axis=3) <= 1)  # at most one slot per (token, expert)
    assert np.all(d.sum(axis=1) <= 1)  # an expert slot holds at most one token
    # slots of an expert fill in order: no used slot after an empty one
    used = d.sum(axis=1)  # [B, E, C]
    assert np.all(np.diff(used, axis=-1) <= 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_route_matches_leaf(seed: int) -> None:
    b, s, e, topk, cap = 2, 6, 4, 2, 3
    scores = randn(b, s, e, seed=seed)
    got = route_numeric(scores, topk, cap)
    want = leaf.route(torch.tensor(scores), topk, cap).numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, _expected_dispatch(scores, topk, cap))
    _check_dispatch_invariants(got, topk)
    rule = get_op("route")
    assert rule.backward is None
    (via_rule,) = rule.forward(NumericXP(), (scores,), topk=topk, capacity=cap)
    np.testing.assert_array_equal(via_rule, got)
    assert rule.shape([scores.shape], topk=topk, capacity=cap) == [via_rule.shape]


def test_route_drops_tokens_beyond_capacity() -> None:
    b, s, e, topk, cap = 2, 6, 4, 2, 3
    scores = randn(b, s, e, seed=5)
    scores[..., 0] += 10.0  # every token's first choice is expert 0
    d = route_numeric(scores, topk, cap)
    np.testing.assert_array_equal(d, leaf.route(torch.tensor(scores), topk, cap).numpy())
    _check_dispatch_invariants(d, topk)
    # expert 0 keeps exactly the first `cap` tokens, the rest are dropped there
    for i in range(b):
        np.testing.assert_array_equal(d[i, :, 0, :].sum(-1), [1, 1, 1, 0, 0, 0])
        np.testing.assert_array_equal(d[i, :cap, 0, :], np.eye(cap))
    assert d.sum() < b * s * topk
    np.testing.assert_array_equal(d, _expected_dispatch(scores, topk, cap))


def test_route_ties_and_capacity_one() -> None:
    """Equal scores: experts taken in index order (stable), as in torch."""
    scores = np.zeros((1, 4, 3))
    d = route_numeric(scores, 2, 1)
    np.testing.assert_array_equal(d, leaf.route(torch.tensor(scores), 2, 1).numpy())
    assert d[0, 0, 0, 0] == d[0, 0, 1, 0] == 1.0
    assert d[0, 1:].sum() == 0.0  # experts 0 and 1 are full after token 0


# ---------------------------------------------------------------- collectives


def test_collectives_have_no_backward() -> None:
    for name in COLLECTIVES:
        rule = get_op(name)
        assert rule.backward is None, name
        assert rule.group == (name != "split"), name


def _group(n: int, shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    return [randn(*shape, seed=seed + i) for i in range(n)]


@pytest.mark.parametrize("name", ["all_reduce", "reducer"])
def test_all_reduce(name: str) -> None:
    rule = get_op(name)
    xs = _group(3, (2, 4), seed=50)
    for index in range(3):
        (out,) = rule.forward(NumericXP(), tuple(xs), index=index)
        np.testing.assert_allclose(out, xs[0] + xs[1] + xs[2], rtol=RTOL)
        assert rule.shape([x.shape for x in xs], index=index) == [out.shape]
    with pytest.raises(ShapeError, match="group shapes differ"):
        rule.shape([(2, 4), (2, 4), (4, 2)], index=0)
    with pytest.raises(ShapeError):
        rule.shape([], index=0)


def test_averaging_collectives_are_torch_means() -> None:
    """ReduceOp.AVG: the group's mean (torch's mean over the stacked group),
    and a reduce-scatter's chunk of it; a group of one is the identity."""
    xs = _group(3, (6, 2), seed=55)
    mean = torch.stack([torch.tensor(x) for x in xs]).mean(0).numpy()
    for index in range(3):
        (out,) = get_op("all_reduce_avg").forward(NumericXP(), tuple(xs), index=index)
        np.testing.assert_allclose(out, mean, rtol=RTOL)
        (out,) = get_op("reduce_scatter_avg").forward(NumericXP(), tuple(xs), index=index, dim=0)
        np.testing.assert_allclose(out, np.split(mean, 3, axis=0)[index], rtol=RTOL)
        assert get_op("reduce_scatter_avg").shape([x.shape for x in xs], index=index,
                                                  dim=0) == [(2, 2)]
    (out,) = get_op("all_reduce_avg").forward(NumericXP(), (xs[0],), index=0)
    np.testing.assert_array_equal(out, xs[0])
    with pytest.raises(ShapeError, match="does not split"):
        get_op("reduce_scatter_avg").shape([(6, 2)] * 3, index=0, dim=1)


def test_all_reduce_max() -> None:
    rule = get_op("all_reduce_max")
    xs = _group(3, (2, 4), seed=50)
    xs[1][0, 0] = xs[2][0, 0] = 9.0  # a tie across ranks
    for index in range(3):
        (out,) = rule.forward(NumericXP(), tuple(xs), index=index)
        np.testing.assert_array_equal(out, np.maximum(np.maximum(xs[0], xs[1]), xs[2]))
        assert rule.shape([x.shape for x in xs], index=index) == [out.shape]
    with pytest.raises(ShapeError, match="group shapes differ"):
        rule.shape([(2, 4), (4, 2)], index=0)


def test_detach_is_the_identity_without_gradient() -> None:
    rule = get_op("detach")
    x = randn(2, 3, seed=51)
    (out,) = rule.forward(NumericXP(), (x,))
    np.testing.assert_array_equal(out, x)
    assert rule.backward is None and rule.differentiable_inputs(1) == ()


def test_cross_entropy_is_torch_cross_entropy() -> None:
    """The zoo's loss on one-hot labels equals F.cross_entropy on integer labels,
    value and gradient, also with a tied maximum."""
    from gen_model.models.loss import cross_entropy

    logits = torch.tensor(randn(3, 4, 6, seed=52), requires_grad=True)
    with torch.no_grad():
        logits[0, 0, 1] = logits[0, 0, 4] = logits[0, 0].max() + 1.0
    labels = torch.tensor(rng(53).integers(0, 6, (3, 4)))
    ours = cross_entropy(logits, leaf.one_hot(labels, logits))
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.reshape(-1, 6), labels.reshape(-1))
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-14)


def test_all_gather() -> None:
    rule = get_op("all_gather")
    xs = _group(2, (2, 3), seed=60)
    for dim in (0, 1, -1):
        (out,) = rule.forward(NumericXP(), tuple(xs), index=1, dim=dim)
        np.testing.assert_array_equal(out, np.concatenate(xs, axis=dim))
        assert rule.shape([x.shape for x in xs], index=1, dim=dim) == [out.shape]
    with pytest.raises(ShapeError, match="group shapes differ"):
        rule.shape([(2, 3), (2, 4)], index=0, dim=1)
    with pytest.raises(ShapeError):
        rule.shape([(2, 3), (2, 3)], index=0, dim=2)


def test_reduce_scatter() -> None:
    rule = get_op("reduce_scatter")
    xs = _group(3, (6, 2), seed=70)
    total = xs[0] + xs[1] + xs[2]
    for index in range(3):
        (out,) = rule.forward(NumericXP(), tuple(xs), index=index, dim=0)
        np.testing.assert_allclose(out, np.split(total, 3, axis=0)[index], rtol=RTOL)
        assert rule.shape([x.shape for x in xs], index=index, dim=0) == [(2, 2)]
    (out,) = rule.forward(NumericXP(), tuple(xs[:2]), index=1, dim=-1)
    np.testing.assert_allclose(out, (xs[0] + xs[1])[:, 1:2], rtol=RTOL)
    with pytest.raises(ShapeError, match="does not split"):
        rule.shape([(6, 2)] * 3, index=0, dim=1)
    with pytest.raises(ShapeError, match="group shapes differ"):
        rule.shape([(6, 2), (6, 3)], index=0, dim=0)


def test_all_to_all() -> None:
    rule = get_op("all_to_all")
    n = 2
    xs = _group(n, (4, 2, 6), seed=80)
    for split_dim, concat_dim in ((0, 2), (2, 0), (-1, 1)):
        shapes = []
        outs = []
        for index in range(n):
            (out,) = rule.forward(NumericXP(), tuple(xs), index=index,
                                  split_dim=split_dim, concat_dim=concat_dim)
            want = np.concatenate([np.split(x, n, axis=split_dim)[index] for x in xs],
                                  axis=concat_dim)
            np.testing.assert_array_equal(out, want)
            shapes.append(rule.shape([x.shape for x in xs], index=index,
                                     split_dim=split_dim, concat_dim=concat_dim))
            outs.append(out)
            assert shapes[-1] == [out.shape]
        # no element is lost or duplicated across the group
        assert sum(o.size for o in outs) == sum(x.size for x in xs)
        np.testing.assert_allclose(sum(o.sum() for o in outs), sum(x.sum() for x in xs))
    with pytest.raises(ShapeError, match="does not split"):
        rule.shape([(3, 2)] * 2, index=0, split_dim=0, concat_dim=1)
    with pytest.raises(ShapeError, match="group shapes differ"):
        rule.shape([(4, 2), (4, 3)], index=0, split_dim=0, concat_dim=1)
    with pytest.raises(ShapeError):
        rule.shape([(4, 2)] * 2, index=0, split_dim=1, concat_dim=-1)


def test_split() -> None:
    rule = get_op("split")
    x = randn(4, 6, seed=90)
    for dim, parts in ((0, 2), (1, 3), (-1, 2)):
        for index in range(parts):
            (out,) = rule.forward(NumericXP(), (x,), dim=dim, parts=parts, index=index)
            np.testing.assert_array_equal(out, np.split(x, parts, axis=dim)[index])
            np.testing.assert_array_equal(out, torch.tensor(x).chunk(parts, dim)[index].numpy())
            assert rule.shape([x.shape], dim=dim, parts=parts, index=index) == [out.shape]
            assert not np.shares_memory(out, x)
    with pytest.raises(ShapeError):
        rule.shape([(4, 6)], dim=0, parts=3, index=0)
    with pytest.raises(ShapeError):
        rule.shape([(4, 6)], dim=0, parts=2, index=2)
    with pytest.raises(ShapeError):
        rule.shape([(4, 6), (4, 6)], dim=0, parts=2, index=0)


def test_send_recv_and_broadcast() -> None:
    x = randn(3, 2, seed=91)
    sr, bc = get_op("send_recv"), get_op("broadcast")
    (out,) = sr.forward(NumericXP(), (x,), src=0, dst=3)
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(out, x)
    assert sr.shape([x.shape], src=0, dst=3) == [x.shape]
    (out,) = bc.forward(NumericXP(), (x,), src=1)
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(out, x)
    assert bc.shape([x.shape], src=1) == [x.shape]
    with pytest.raises(ShapeError):
        sr.shape([(3, 2), (3, 2)], src=0, dst=1)
    with pytest.raises(ShapeError):
        bc.shape([(3, 2), (3, 2)], src=0)


# ---------------------------------------------------------------- shape errors


SHAPE_ERRORS: list[tuple[str, list[tuple[int, ...]], dict[str, Any]]] = [
    ("sub", [(2, 3), (2, 4)], {}),
    ("exp", [(2,), (2,)], {}),
    ("log", [(2,), (2,)], {}),
    ("max", [(2, 3)], {"dim": 2, "keepdim": False}),
    ("all_reduce_max", [(2, 3), (3, 2)], {"index": 0}),
    ("sgd_step", [(2, 3), (3, 2)], {"lr": 0.1, "weight_decay": 0.0}),
    ("adam_step", [(2, 3), (2, 3), (2, 3), (2, 2)],
     {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0,
      "decoupled": True, "step": 1}),
    ("expand", [(3, 2)], {"shape": [3, 4]}),
    ("expand", [(2, 3)], {"shape": [3]}),
    ("gelu", [(2, 3)], {"approximate": "fast"}),
    ("tanh", [(2,), (2,)], {}),
    ("sigmoid", [(2,), (2,)], {}),
    ("relu", [(2,), (2,)], {}),
    ("cat", [(2, 3), (3, 3)], {"dim": 1}),
    ("cat", [(2, 3), (2, 3, 1)], {"dim": 0}),
    ("narrow", [(2, 5)], {"dim": 1, "start": 3, "length": 3}),
    ("add", [(2, 3), (2, 4)], {}),
    ("add", [(2, 3)], {}),
    ("mul", [(2, 3, 4), (3, 3, 4)], {}),
    ("add_scalar", [(2,), (2,)], {"value": 1.0}),
    ("linear", [(2, 3, 4), (5, 3)], {}),  # wrong inner dim
    ("linear", [(2, 4), (5, 4, 1)], {}),  # weight not 2-d
    ("matmul", [(2, 3, 4, 5), (3, 3, 5, 6)], {}),  # batch mismatch
    ("matmul", [(3, 4, 5), (2, 3, 5, 6)], {}),  # rank mismatch
    ("matmul", [(2, 4, 5), (2, 4, 6)], {}),  # contracted dims
    ("einsum", [(2, 3), (4, 5)], {"eq": "ij,jk->ik"}),  # j clashes: 3 vs 4
    ("einsum", [(2, 3, 4), (3, 5)], {"eq": "ij,jk->ik"}),  # operand rank
    ("einsum", [(2, 3)], {"eq": "ij,jk->ik"}),  # operand count
    ("einsum", [(2, 3), (3, 5)], {"eq": "ij,jk->iz"}),  # output index without input
    ("embedding", [(2, 3, 7), (8, 5)], {}),
    ("embedding", [(2, 3, 7), (7,)], {}),
    ("transpose", [(2, 3)], {"dim0": 0, "dim1": 2}),
    ("unflatten", [(2, 6, 4)], {"dim": 1, "sizes": [4, 2]}),  # sizes do not multiply to 6
    ("unflatten", [(2, 6)], {"dim": 3, "sizes": [2, 3]}),
    ("flatten", [(2, 3, 4)], {"start": 2, "end": 1}),
    ("repeat_interleave", [(2, 3)], {"repeats": 2, "dim": 2}),
    ("sum", [(2, 3)], {"dim": 2, "keepdim": False}),
    ("mean", [(2, 3)], {"dim": [0, -3], "keepdim": True}),
    ("apply_rotary_emb", [(2, 5, 4, 6), (2, 5, 2, 6), (5, 6), (4, 6)], {}),  # sin wrong S
    ("apply_rotary_emb", [(2, 5, 4, 6), (2, 4, 2, 6), (5, 6), (5, 6)], {}),  # q/k seq
    ("apply_rotary_emb", [(2, 5, 4, 5), (2, 5, 2, 5), (5, 5), (5, 5)], {}),  # odd head dim
    ("apply_rotary_emb", [(5, 4, 6), (5, 2, 6), (5, 6), (5, 6)], {}),  # not 4-d
    ("causal_mask", [(5,)], {}),
    ("attention", [(2, 3, 4), (2, 5, 4), (2, 4, 3)], {"scale": 1.0}),  # keys of v
    ("attention", [(2, 3, 4), (2, 5, 3), (2, 5, 3)], {"scale": 1.0}),  # head dim
    ("attention_grad", [(2, 3, 3), (2, 3, 4), (2, 5, 4), (2, 5, 3), (2, 3, 3), (2, 4)],
     {"scale": 1.0}),  # lse rows
    ("lse_merge", [(2, 3, 4), (2, 3), (2, 3, 4), (3, 2)], {}),
    ("route", [(2, 6)], {"topk": 1, "capacity": 2}),
    ("route", [(2, 6, 4)], {"topk": 5, "capacity": 2}),
    ("route", [(2, 6, 4)], {"topk": 0, "capacity": 2}),
    ("multiref", [(2, 3)], {"times": 1}),
    ("multiref", [(2, 3), (2, 3)], {"times": 2}),
    ("zeros", [(2,)], {"shape": [2]}),
    ("ones", [(2,)], {"shape": [2]}),
    ("local_grad_accumulation", [(2, 3), (3, 2)], {}),
    ("all_reduce", [(2, 3), (2, 4)], {"index": 0}),
    ("reducer", [(2, 3), (3,)], {"index": 1}),
    ("all_gather", [(2, 3), (3, 3)], {"index": 0, "dim": 0}),
    ("reduce_scatter", [(3, 3), (3, 3)], {"index": 0, "dim": 0}),
    ("all_to_all", [(3, 4), (3, 4)], {"index": 0, "split_dim": 0, "concat_dim": 1}),
    ("all_to_all", [(4, 4), (4, 2)], {"index": 0, "split_dim": 0, "concat_dim": 1}),
    ("split", [(5, 2)], {"dim": 0, "parts": 2, "index": 0}),
    ("send_recv", [], {"src": 0, "dst": 1}),
    ("broadcast", [], {"src": 0}),
]


@pytest.mark.parametrize(
    "name,shapes,kw", SHAPE_ERRORS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(SHAPE_ERRORS)]
)
def test_shape_rule_rejects(name: str, shapes: list, kw: dict) -> None:
    with pytest.raises(ShapeError):
        get_op(name).shape(shapes, **kw)


def test_shape_errors_are_value_errors_with_a_message() -> None:
    with pytest.raises(ValueError, match=r"\(5, 3\)"):
        get_op("linear").shape([(2, 3, 4), (5, 3)])
    with pytest.raises(ShapeError, match="index 'j'"):
        get_op("einsum").shape([(2, 3), (4, 5)], eq="ij,jk->ik")
    with pytest.raises(ShapeError, match="unflatten"):
        get_op("unflatten").shape([(2, 6, 4)], dim=1, sizes=[4, 2])
    with pytest.raises(ShapeError, match="batch"):
        get_op("matmul").shape([(2, 3, 4, 5), (3, 3, 5, 6)])


# ---------------------------------------------------------------- coverage


def test_clamp_is_torch_clamp() -> None:
    """Numerically torch.clamp; symbolically exact if-terms."""
    import z3

    from backends.z3backend import SymbolicXP
    x = randn(3, 4, seed=50)
    for kw in ({"min": None, "max": 0.3}, {"min": -0.2, "max": None}, {"min": -0.2, "max": 0.3}):
        (got,) = get_op("clamp").forward(NumericXP, [x], **kw)
        want = torch.clamp(torch.from_numpy(x), min=kw["min"], max=kw["max"]).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=0)
    v = z3.Real("v")
    (sym,) = get_op("clamp").forward(SymbolicXP, [np.array([v], dtype=object)], min=None, max=1.0)
    solver = z3.Solver()
    solver.add(v == 3, sym[0] != 1)
    assert solver.check() == z3.unsat


def test_every_op_is_covered() -> None:
    missing = sorted(set(OPS) - COVERED)
    assert not missing, f"operators without a test in tests/test_ops.py: {missing}"
    stale = sorted(COVERED - set(OPS))
    assert not stale, f"tests/test_ops.py covers operators that no longer exist: {stale}"


def test_cases_cover_every_differentiable_op() -> None:
    """Each op with a backward rule has at least one autograd case above,
    every forward-only op that is not a collective is checked by name."""
    with_backward = {n for n, op in OPS.items() if op.backward is not None}
    assert with_backward <= {c.op for c in CASES}
    forward_only = {n for n, op in OPS.items() if op.backward is None} - COLLECTIVES
    assert forward_only == {"zeros", "ones", "local_grad_accumulation", "route", "detach",
                            "sgd_step", "adam_step",  # the steps: tests/test_optimizer.py
                            "clamp",  # test_clamp_is_torch_clamp
                            "attention_grad", "lse_merge"}  # tests/test_attention_merge.py
    assert all(n in OPS for n in COLLECTIVES)
