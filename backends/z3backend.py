"""The symbolic backend: tensors as numpy object arrays of Z3 real terms.

The rule table's forward and backward rules run unchanged on these arrays;
this module supplies the ``xp`` functions they call. Non-linear elementwise
functions (exp, rsqrt, sigmoid, tanh, erf, relu's step) are uninterpreted functions: sound for
equivalence, since both plans must apply the same function to equal
arguments. Top-k routing is an uninterpreted function of a sample's whole
score matrix, one function per output element (static capacity).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import z3

NEG_INF = -math.inf


@cache
def _unary(name: str) -> z3.FuncDeclRef:
    return z3.Function(name, z3.RealSort(), z3.RealSort())


@cache
def _route_fn(name: str, arity: int) -> z3.FuncDeclRef:
    return z3.Function(name, *([z3.RealSort()] * arity), z3.RealSort())


def _map(fn, x) -> np.ndarray:
    x = np.asarray(x, dtype=object)
    out = np.empty(x.shape, dtype=object)
    for idx, v in np.ndenumerate(x):
        out[idx] = fn(v)
    return out


def _zip(a, b, fn) -> np.ndarray:
    a, b = np.broadcast_arrays(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
    out = np.empty(a.shape, dtype=object)
    for idx in np.ndindex(*a.shape):
        out[idx] = fn(a[idx], b[idx])
    return out


def _is_neg_inf(v) -> bool:
    return isinstance(v, float) and v == NEG_INF


def _real(v):
    return v if z3.is_expr(v) else z3.RealVal(v)


class SymbolicXP:
    """The ``xp`` backend of the rule table for object arrays of Z3 terms."""

    @staticmethod
    def exp(x):
        return _map(lambda v: 0 if _is_neg_inf(v) else _unary("exp")(_real(v)), x)

    @staticmethod
    def log(x):
        return _map(lambda v: _unary("log")(_real(v)), x)

    @staticmethod
    def rsqrt(x):
        return _map(lambda v: _unary("rsqrt")(_real(v)), x)

    @staticmethod
    def adam_ratio(m, v, eps):
        """m / (sqrt(v) + eps): one uninterpreted function of (m, v) per eps."""
        fn = _route_fn(f"adam_ratio[{eps!r}]", 2)
        return _zip(m, v, lambda a, b: fn(_real(a), _real(b)))

    @staticmethod
    def maximum(a, b):
        """If-terms; -inf (a Python float) loses to anything."""
        return _zip(a, b, lambda u, v: v if _is_neg_inf(u) else u if _is_neg_inf(v)
                    else z3.If(_real(u) >= _real(v), _real(u), _real(v)))

    @staticmethod
    def equal(a, b):
        """1 where a == b, else 0, as If-terms."""
        return _zip(a, b, lambda u, v: float(u == v) if not (z3.is_expr(u) or z3.is_expr(v))
                    else z3.If(_real(u) == _real(v), z3.RealVal(1), z3.RealVal(0)))

    @staticmethod
    def sigmoid(x):
        return _map(lambda v: _unary("sigmoid")(_real(v)), x)

    @staticmethod
    def tanh(x):
        return _map(lambda v: _unary("tanh")(_real(v)), x)

    @staticmethod
    def erf(x):
        return _map(lambda v: _unary("erf")(_real(v)), x)

    @staticmethod
    def step(x):
        """relu's derivative, uninterpreted like the other non-linear functions."""
        return _map(lambda v: _unary("step")(_real(v)), x)

    @staticmethod
    def softmax(x, dim):
        e = SymbolicXP.exp(x)
        total = np.broadcast_to(np.sum(e, axis=dim, keepdims=True), e.shape)
        out = np.empty(e.shape, dtype=object)
        for idx, v in np.ndenumerate(e):
            out[idx] = 0 if isinstance(v, int) and v == 0 else v / total[idx]
        return out

    @staticmethod
    def power(x, exponent):
        if float(exponent).is_integer() and 0 <= exponent <= 8:
            n = int(exponent)

            def pw(v):
                out = z3.RealVal(1)
                for _ in range(n):
                    out = out * v
                return out if n else out

            return _map(pw, x)
        fn = _unary(f"pow[{exponent!r}]")
        return _map(lambda v: fn(_real(v)), x)

    @staticmethod
    def zeros(shape):
        return np.full(tuple(shape), z3.RealVal(0), dtype=object)

    @staticmethod
    def ones(shape):
        return np.full(tuple(shape), z3.RealVal(1), dtype=object)

    @staticmethod
    def copy(x):
        return np.array(x, dtype=object, copy=True)

    @staticmethod
    def asarray(x):
        return np.asarray(x, dtype=object) if isinstance(x, np.ndarray) else np.array(
            x, dtype=object)

    @staticmethod
    def route(scores, topk, capacity):
        b, s, e = scores.shape
        out = np.empty((b, s, e, capacity), dtype=object)
        for i in range(b):
            args = [_real(v) for v in scores[i].reshape(-1)]
            for t in range(s):
                for ex in range(e):
                    for c in range(capacity):
                        fn = _route_fn(f"route[top{topk},{s}x{e}x{capacity}][{t},{ex},{c}]",
                                       len(args))
                        out[i, t, ex, c] = fn(*args)
        return out


def variables(prefix: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array of fresh real variables named prefix[i,j,...]."""
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        out[idx] = z3.Real(f"{prefix}[{','.join(map(str, idx))}]")
    return out


class Z3Symbolic:
    """The symbolic backend the prover is given (``verdict.solve.Symbolic``):
    stateless, so it crosses process boundaries by reference."""

    def xp(self) -> SymbolicXP:
        return SymbolicXP()

    def variables(self, prefix: str, shape: tuple[int, ...]) -> np.ndarray:
        return variables(prefix, shape)


Z3 = Z3Symbolic()
