"""The symbolic backend runs the same rules as the numeric one: evaluating
the Z3 terms of every rule on concrete inputs gives the numeric result."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import z3
from test_ops import CASES, Case

from backends.z3backend import SymbolicXP
from verdict.numeric import NumericXP
from verdict.ops import get_op
from verdict.ops.collectives import OPS as COLLECTIVE_OPS

FUNCTIONS = {
    "exp": np.exp,
    "log": math.log,
    "adam_ratio[1e-08]": lambda m, v: m / (math.sqrt(v) + 1e-8),
    "rsqrt": lambda v: 1.0 / math.sqrt(v),
    "sigmoid": lambda v: 1.0 / (1.0 + math.exp(-v)),
    "tanh": math.tanh,
    "erf": math.erf,
    "step": lambda v: float(v > 0),
}


def evaluate(term, memo: dict) -> float:
    """The float value of a Z3 term over numerals and our uninterpreted functions."""
    if not z3.is_expr(term):
        return float(term)
    key = term.get_id()
    if key in memo:
        return memo[key]
    if z3.is_rational_value(term):
        value = float(term.as_fraction())
    else:
        args = [evaluate(a, memo) for a in term.children()]
        kind = term.decl().kind()
        if kind == z3.Z3_OP_ADD:
            value = math.fsum(args)
        elif kind == z3.Z3_OP_MUL:
            value = math.prod(args)
        elif kind == z3.Z3_OP_SUB:
            value = args[0] - math.fsum(args[1:])
        elif kind == z3.Z3_OP_UMINUS:
            value = -args[0]
        elif kind == z3.Z3_OP_DIV:
            value = args[0] / args[1]
        elif kind == z3.Z3_OP_ITE:
            value = args[1] if args[0] else args[2]
        elif kind == z3.Z3_OP_GE:
            value = args[0] >= args[1]
        elif kind == z3.Z3_OP_LE:
            value = args[0] <= args[1]
        elif kind == z3.Z3_OP_EQ:
            value = args[0] == args[1]
        elif kind == z3.Z3_OP_UNINTERPRETED:
            value = float(FUNCTIONS[term.decl().name()](*args))
        else:
            raise AssertionError(f"unexpected term {term.decl()}")
    memo[key] = value
    return value


def symbolic(x):
    if x is None:
        return None
    arr = np.asarray(x)
    out = np.empty(arr.shape, dtype=object)
    for idx, v in np.ndenumerate(arr):
        out[idx] = z3.RealVal(Fraction(float(v))) if math.isfinite(v) else float(v)
    return out


def concrete(x) -> np.ndarray:
    memo: dict = {}
    arr = np.asarray(x, dtype=object)
    out = np.empty(arr.shape)
    for idx, v in np.ndenumerate(arr):
        out[idx] = evaluate(v, memo)
    return out


def close(sym, num) -> None:
    if num is None:
        assert sym is None
        return
    np.testing.assert_allclose(concrete(sym), np.asarray(num, dtype=float), rtol=1e-9, atol=1e-12)


SMALL = [c for c in CASES if c.op != "route" and sum(np.size(x) for x in c.inputs) <= 1200]


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.id)
def test_symbolic_rule_equals_numeric_rule(case: Case) -> None:
    rule = get_op(case.op)
    num_out = rule.forward(NumericXP(), tuple(case.inputs), **case.kw)
    sym_out = rule.forward(SymbolicXP(), tuple(symbolic(x) for x in case.inputs), **case.kw)
    for s, n in zip(sym_out, num_out):
        close(s, n)
    if rule.backward is None:
        return
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(np.shape(o)) for o in num_out]
    shapes = tuple(np.shape(x) for x in case.inputs)
    num_b = rule.backward(NumericXP(), rule.saved(case.inputs), tuple(grads), shapes,
                          **case.kw)
    sym_b = rule.backward(SymbolicXP(), rule.saved([symbolic(x) for x in case.inputs]),
                          tuple(symbolic(g) for g in grads), shapes, **case.kw)
    for s, n in zip(sym_b, num_b):
        close(s, n)


def test_some_case_of_every_small_op_is_checked() -> None:
    assert {c.op for c in SMALL} >= {"add", "mul", "softmax", "silu", "rsqrt", "linear",
                                     "matmul", "einsum", "apply_rotary_emb", "causal_mask",
                                     "multiref", "sum", "mean", "pow", "max", "sub", "exp",
                                     "log", "gelu", "tanh", "sigmoid", "relu", "cat", "narrow"}


@pytest.mark.parametrize("op", [o for o in COLLECTIVE_OPS if o.name not in ("split",)],
                         ids=lambda o: o.name)
def test_collectives_symbolic(op) -> None:
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((2, 4)) for _ in range(2)]
    kw = {"all_reduce": {"index": 1}, "all_reduce_max": {"index": 0}, "reducer": {"index": 0},
          "all_gather": {"index": 0, "dim": 1},
          "reduce_scatter": {"index": 1, "dim": 1},
          "all_reduce_avg": {"index": 1}, "reduce_scatter_avg": {"index": 1, "dim": 1},
          "all_to_all": {"index": 1, "split_dim": 1, "concat_dim": 0},
          "send_recv": {"src": 0, "dst": 1}, "broadcast": {"src": 0}}[op.name]
    if op.name in ("send_recv", "broadcast"):
        xs = xs[:1]
    num = op.forward(NumericXP(), tuple(xs), **kw)
    sym = op.forward(SymbolicXP(), tuple(symbolic(x) for x in xs), **kw)
    close(sym[0], num[0])


def test_route_is_a_function_of_the_sample_only() -> None:
    xp = SymbolicXP()
    a = np.array([[[z3.Real(f"s{t}{e}") for e in range(3)] for t in range(2)]] * 2, dtype=object)
    out = xp.route(a, 2, 2)
    assert out.shape == (2, 2, 3, 2)
    # equal samples route identically (congruence), and every slot is a term
    assert all(z3.eq(x, y) for x, y in zip(out[0].ravel(), out[1].ravel()))


def test_masked_scores_give_exact_zero_probability() -> None:
    x = np.array([[z3.Real("a"), -math.inf]], dtype=object)
    p = SymbolicXP.softmax(x, -1)
    assert p[0, 1] == 0 and not z3.is_expr(p[0, 1])


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_step_symbolic(decoupled) -> None:
    rng = np.random.default_rng(4)
    p, g, m = (rng.standard_normal((2, 3)) for _ in range(3))
    v = rng.uniform(0.0, 1.0, (2, 3))
    kw = {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1,
          "decoupled": decoupled, "step": 1}
    rule = get_op("adam_step")
    num = rule.forward(NumericXP(), (p, g, m, v), **kw)
    sym = rule.forward(SymbolicXP(), tuple(symbolic(x) for x in (p, g, m, v)), **kw)
    for s, n in zip(sym, num):
        close(s, n)
