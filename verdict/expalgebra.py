"""Exact algebra of exp and log on Z3 terms: what the merge of partial
attentions by their log-sum-exps needs (docs/soundness.md, "Exponentials
and logarithms: the exact merge").

exp and log stay uninterpreted functions (``exp``, ``log``: Real -> Real),
and two facts of real analysis are applied where they hold exactly:

* L1. exp(a + b) = exp(a) exp(b), for all reals a, b;
* L2. exp(log P) = P, for P > 0 (so exp(c log P) = P^c for an integer c).

A term is *positive* when its syntax makes it so for every value of its
variables: a positive rational, an application of exp, and sums (of
non-negative terms, one positive), products, quotients and integer powers
of positive terms. A sum of exponentials, the log-sum-exp's argument, is
positive: log is applied to it where it is defined.

``exp_factored`` writes exp(x), with x = sum_k c_k log(P_k) + r (P_k
positive, c_k integers), as prod_k P_k^c_k * exp(r); terms with no such
log are left as exp(x), exactly as before. ``equal`` decides a == b for
terms the algebra covers: the difference a - b = sum_k c_k log(P_k) + r
is zero when r is zero as a rational function and prod_k P_k^c_k is 1
(exp is injective), each checked by clearing positive denominators and
expanding to a polynomial that must be identically 0 (every remaining
application, variable or If-term an independent atom). It answers True
only on such a proof; anything else is left to the solver.
"""

from __future__ import annotations

from fractions import Fraction

import z3

EXP, LOG = "exp", "log"
#: a cleared numerator larger than this (in Z3 AST nodes, before expansion)
#: is left to the solver
LIMIT = 200_000


def _is_fn(t: z3.ExprRef, name: str) -> bool:
    return (z3.is_app(t) and t.num_args() == 1 and t.decl().name() == name
            and t.decl().kind() == z3.Z3_OP_UNINTERPRETED)


def _value(t: z3.ExprRef) -> Fraction | None:
    if z3.is_rational_value(t):
        return Fraction(t.as_fraction())
    return None


def _integer_power(t: z3.ExprRef) -> int | None:
    if not z3.is_app_of(t, z3.Z3_OP_POWER):
        return None
    e = _value(t.arg(1))
    return int(e) if e is not None and e.denominator == 1 else None


def sign(t: z3.ExprRef, memo: dict[int, int] | None = None) -> int:
    """2: positive, 1: non-negative, 0: unknown, by syntax alone."""
    memo = {} if memo is None else memo
    key = t.get_id()
    if key in memo:
        return memo[key]
    v = _value(t)
    if v is not None:
        out = 2 if v > 0 else 1 if v == 0 else 0
    elif _is_fn(t, EXP):
        out = 2
    elif z3.is_app_of(t, z3.Z3_OP_ADD):
        signs = [sign(c, memo) for c in t.children()]
        out = 0 if 0 in signs else 2 if 2 in signs else 1
    elif z3.is_app_of(t, z3.Z3_OP_MUL) or z3.is_app_of(t, z3.Z3_OP_DIV):
        signs = [sign(c, memo) for c in t.children()]
        out = 0 if 0 in signs else 2 if all(s == 2 for s in signs) else 1
        if z3.is_app_of(t, z3.Z3_OP_DIV) and signs[-1] != 2:
            out = 0
    elif _integer_power(t) is not None:
        out = 2 if sign(t.arg(0), memo) == 2 else 0
    else:
        out = 0
    memo[key] = out
    return out


def positive(t: z3.ExprRef) -> bool:
    return z3.is_expr(t) and sign(t) == 2


def _terms(t: z3.ExprRef) -> list[z3.ExprRef]:
    return list(t.children()) if z3.is_app_of(t, z3.Z3_OP_ADD) else [t]


def _split(term: z3.ExprRef) -> tuple[Fraction, z3.ExprRef | None]:
    """A term of a sum in Z3's sum-of-monomials form as (coefficient, the
    rest of the product; None for a constant)."""
    v = _value(term)
    if v is not None:
        return v, None
    if z3.is_app_of(term, z3.Z3_OP_MUL):
        kids = term.children()
        c = _value(kids[0])
        if c is not None:
            rest = kids[1:]
            return c, rest[0] if len(rest) == 1 else z3.Product(*rest)
    return Fraction(1), term


def log_parts(x: z3.ExprRef) -> tuple[list[tuple[z3.ExprRef, int]], list[z3.ExprRef]]:
    """x = sum_k c_k log(P_k) + sum(rest): the logs of positive terms with
    integer coefficients, and the other terms of x's sum-of-monomials form."""
    s = z3.simplify(x, som=True)
    logs: list[tuple[z3.ExprRef, int]] = []
    rest: list[z3.ExprRef] = []
    for term in _terms(s):
        c, mono = _split(term)
        if mono is not None and c.denominator == 1 and _is_fn(mono, LOG) \
                and positive(mono.arg(0)):
            logs.append((mono.arg(0), int(c)))
        else:
            rest.append(term)
    return logs, rest


def _power(base: z3.ExprRef, n: int) -> z3.ExprRef:
    out = base
    for _ in range(n - 1):
        out = out * base
    return out


def exp_factored(x: z3.ExprRef, exp_fn: z3.FuncDeclRef) -> z3.ExprRef:
    """exp(x) with the logs of positive terms taken out of the exponent
    (L1, L2): prod P_k^c_k * exp(r); exp(x) itself when x has none."""
    logs, rest = log_parts(x)
    if not logs:
        return exp_fn(x)
    up = [_power(p, c) for p, c in logs if c > 0]
    down = [_power(p, -c) for p, c in logs if c < 0]
    out = exp_fn(z3.Sum(*rest)) if rest else None
    for f in up:
        out = f if out is None else out * f
    if out is None:
        out = z3.RealVal(1)
    for f in down:
        out = out / f
    return out


def has_factorable_log(x: z3.ExprRef) -> bool:
    return bool(log_parts(x)[0])


class _Fractions:
    """Terms as (numerator, denominator) with positive denominators; None:
    a division by a term not known positive."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[z3.ExprRef, z3.ExprRef | None] | None] = {}

    def of(self, t: z3.ExprRef) -> tuple[z3.ExprRef, z3.ExprRef | None] | None:
        key = t.get_id()
        if key not in self.memo:
            self.memo[key] = self._of(t)
        return self.memo[key]

    def _of(self, t: z3.ExprRef):
        kids = t.children() if z3.is_app(t) else []
        if z3.is_app_of(t, z3.Z3_OP_ADD) or z3.is_app_of(t, z3.Z3_OP_SUB):
            parts = [self.of(c) for c in kids]
            if any(p is None for p in parts):
                return None
            n, d = parts[0]
            for n2, d2 in parts[1:]:
                if z3.is_app_of(t, z3.Z3_OP_SUB):
                    n2 = -n2
                if (d is None and d2 is None) or (d is not None and d2 is not None and d.eq(d2)):
                    n = n + n2
                else:
                    n = (n if d2 is None else n * d2) + (n2 if d is None else n2 * d)
                    d = _mul(d, d2)
            return n, d
        if z3.is_app_of(t, z3.Z3_OP_UMINUS):
            p = self.of(kids[0])
            return None if p is None else (-p[0], p[1])
        if z3.is_app_of(t, z3.Z3_OP_MUL):
            parts = [self.of(c) for c in kids]
            if any(p is None for p in parts):
                return None
            n, d = parts[0]
            for n2, d2 in parts[1:]:
                n, d = n * n2, _mul(d, d2)
            return n, d
        if z3.is_app_of(t, z3.Z3_OP_DIV):
            a, b = self.of(kids[0]), self.of(kids[1])
            if a is None or b is None or not positive(kids[1]):
                return None
            return (a[0] if b[1] is None else a[0] * b[1]), _mul(a[1], b[0])
        e = _integer_power(t)
        if e is not None:
            p = self.of(kids[0])
            if p is None:
                return None
            if e >= 0:
                return (_power(p[0], e) if e else z3.RealVal(1)), (
                    None if p[1] is None or e == 0 else _power(p[1], e))
            if not positive(kids[0]):
                return None
            return (z3.RealVal(1) if p[1] is None else _power(p[1], -e)), _power(p[0], -e)
        return t, None


def _mul(a: z3.ExprRef | None, b: z3.ExprRef | None) -> z3.ExprRef | None:
    if a is None:
        return b
    if b is None:
        return a
    return a * b


def _size(t: z3.ExprRef, limit: int) -> int:
    seen: set[int] = set()
    stack = [t]
    while stack and len(seen) <= limit:
        e = stack.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        stack.extend(e.children())
    return len(seen)


def _zero(t: z3.ExprRef) -> bool:
    if _size(t, LIMIT) > LIMIT:
        return False
    s = z3.simplify(t, som=True)
    v = _value(s)
    return v is not None and v == 0


def _rational_zero(terms: list[z3.ExprRef], fr: _Fractions) -> bool:
    if not terms:
        return True
    p = fr.of(z3.Sum(*terms) if len(terms) > 1 else terms[0])
    return p is not None and _zero(p[0])


def _ratio_one(logs: list[tuple[z3.ExprRef, int]], fr: _Fractions) -> bool:
    up = [_power(p, c) for p, c in logs if c > 0]
    down = [_power(p, -c) for p, c in logs if c < 0]
    top = fr.of(z3.Product(*up) if len(up) > 1 else up[0] if up else z3.RealVal(1))
    bottom = fr.of(z3.Product(*down) if len(down) > 1 else down[0] if down else z3.RealVal(1))
    if top is None or bottom is None:
        return False
    (n1, d1), (n2, d2) = top, bottom
    return _zero((n1 if d2 is None else n1 * d2) - (n2 if d1 is None else n2 * d1))


def _touches(t: z3.ExprRef) -> bool:
    """Whether t holds a division or a log: where the algebra can add to
    Z3's own normal form."""
    seen: set[int] = set()
    stack = [t]
    while stack:
        e = stack.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if z3.is_app_of(e, z3.Z3_OP_DIV) or _is_fn(e, LOG):
            return True
        stack.extend(e.children())
    return False


def equal(a: z3.ExprRef, b: z3.ExprRef) -> bool:
    """True only if a == b is proved by the algebra (module docstring)."""
    a, b = (v if z3.is_expr(v) else z3.RealVal(v) for v in (a, b))
    if not (_touches(a) or _touches(b)):
        return False
    logs, rest = log_parts(a - b)
    fr = _Fractions()
    if not logs:  # the terms as built: Z3's simplifier may guard its divisions
        return _rational_zero([a - b], fr)
    return _rational_zero(rest, fr) and _ratio_one(logs, fr)
