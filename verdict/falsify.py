"""A counterexample by evaluation, tried before the solver on claims the
exponential normal form did not prove (verdict/expalgebra.py).

Random rational inputs are substituted for a stage's free symbols and both
sides of every open claim evaluated in 60-digit decimal arithmetic, with
exp, log and the other uninterpreted functions given their real meanings.
A claim whose sides differ by more than 1e-30 of their size, at precision
1e-60, differs in real arithmetic at that input: a counterexample for the
real functions, which the plans compute, and so for every interpretation
the solver would consider too. Nothing is concluded otherwise: a claim
that this search does not refute goes to the solver as before. It never
proves anything, so it cannot make a wrong plan pass.

It is not tried when the stage assumes equalities between symbols (a
random input might break them) or when a term holds a function it cannot
evaluate. A comparison (a maximum's If-term, an equality test) or a step
whose two sides are within the margin is a near tie that rounding could
decide: that try is given up, so no branch is taken on rounding error.
Two cases are decided by syntax instead, exactly: a term compared with
itself (``a >= a`` holds, ``a > a`` does not), and an If whose two branches
are one term (its value is that term's whichever branch is taken). A merge
of a block with its own log-sum-exp takes the maximum of a term and itself.
"""

from __future__ import annotations

import decimal
import random
import zlib
from collections.abc import Callable

import numpy as np
import z3

PRECISION = 60
#: relative difference taken as certain at PRECISION digits
MARGIN = decimal.Decimal("1e-30")
#: random inputs tried per claim set (odd tries draw positive numbers only)
TRIES = 8


class Unknown(Exception):
    """A term this evaluator cannot give a real value."""


def _decided(x: decimal.Decimal) -> decimal.Decimal:
    """x, when its sign cannot be rounding's."""
    if not differs(x, decimal.Decimal(0)):
        raise Unknown("a near tie: rounding could decide it")
    return x


def _sigmoid(x: decimal.Decimal) -> decimal.Decimal:
    return 1 / (1 + (-x).exp())


def _tanh(x: decimal.Decimal) -> decimal.Decimal:
    e = (2 * x).exp()
    return (e - 1) / (e + 1)


def _positive(fn: Callable[[decimal.Decimal], decimal.Decimal]):
    def run(x: decimal.Decimal) -> decimal.Decimal:
        if x <= 0:
            raise Unknown("outside the domain")
        return fn(x)
    return run


FUNCTIONS: dict[str, Callable[[decimal.Decimal], decimal.Decimal]] = {
    "exp": lambda x: x.exp(),
    "log": _positive(lambda x: x.ln()),
    "rsqrt": _positive(lambda x: 1 / x.sqrt()),
    "sigmoid": _sigmoid,
    "tanh": _tanh,
    "step": lambda x: decimal.Decimal(1 if _decided(x) > 0 else 0),
}


#: A comparison of a term with itself, by kind: its value whatever the term's.
_SELF = {z3.Z3_OP_GE: True, z3.Z3_OP_LE: True, z3.Z3_OP_EQ: True, z3.Z3_OP_GT: False,
         z3.Z3_OP_LT: False}


class _Values:
    def __init__(self, seed: int):
        self.seed = seed
        self.memo: dict[int, object] = {}

    def symbol(self, name: str) -> decimal.Decimal:
        """A rational in [-2, 2], the same for a name and seed; for odd seeds
        in (0, 2] (a stage's input read by a log or an rsqrt, a sum of
        exponentials or a variance made by an earlier stage, is outside
        their domain at half the signed draws)."""
        rng = random.Random(zlib.adler32(f"{self.seed}/{name}".encode()))
        if self.seed % 2:
            return decimal.Decimal(rng.randint(1, 2000)) / 1000
        return decimal.Decimal(rng.randint(-2000, 2000)) / 1000

    def of(self, t):
        if not z3.is_expr(t):
            return decimal.Decimal(t) if isinstance(t, int) else decimal.Decimal(repr(float(t)))
        key = t.get_id()
        if key not in self.memo:
            self.memo[key] = self._of(t)
        return self.memo[key]

    def _of(self, t):
        if z3.is_rational_value(t):
            return decimal.Decimal(t.numerator_as_long()) / t.denominator_as_long()
        if z3.is_true(t) or z3.is_false(t):
            return z3.is_true(t)
        kind = t.decl().kind()
        if kind == z3.Z3_OP_ITE:
            if t.arg(1).eq(t.arg(2)):  # both branches one term: no choice to make
                return self.of(t.arg(1))
            return self.of(t.arg(1)) if self.of(t.arg(0)) else self.of(t.arg(2))
        if kind in _SELF and t.num_args() == 2 and t.arg(0).eq(t.arg(1)):
            return _SELF[kind]  # a term compared with itself: decided by its syntax
        args = [self.of(a) for a in t.children()]
        if kind == z3.Z3_OP_UNINTERPRETED:
            name = t.decl().name()
            if not args:
                return self.symbol(name)
            if name in FUNCTIONS and len(args) == 1:
                return FUNCTIONS[name](args[0])
            raise Unknown(name)
        if kind == z3.Z3_OP_ADD:
            return sum(args[1:], args[0])
        if kind == z3.Z3_OP_SUB:
            return args[0] - sum(args[1:], decimal.Decimal(0))
        if kind == z3.Z3_OP_MUL:
            out = args[0]
            for a in args[1:]:
                out *= a
            return out
        if kind == z3.Z3_OP_UMINUS:
            return -args[0]
        if kind == z3.Z3_OP_DIV:
            if args[1] == 0:
                raise Unknown("division by zero")
            return args[0] / args[1]
        if kind == z3.Z3_OP_POWER and args[1] == args[1].to_integral_value():
            return args[0] ** int(args[1])
        compare = {z3.Z3_OP_GE: lambda a, b: a >= b, z3.Z3_OP_LE: lambda a, b: a <= b,
                   z3.Z3_OP_GT: lambda a, b: a > b, z3.Z3_OP_LT: lambda a, b: a < b,
                   z3.Z3_OP_EQ: lambda a, b: a == b}
        if kind in compare:
            if isinstance(args[0], decimal.Decimal) and not differs(*args):
                raise Unknown("a near tie: rounding could decide it")
            return compare[kind](*args)
        if kind == z3.Z3_OP_AND:
            return all(args)
        if kind == z3.Z3_OP_OR:
            return any(args)
        if kind == z3.Z3_OP_NOT:
            return not args[0]
        raise Unknown(str(t.decl()))

    def array(self, arr) -> np.ndarray:
        a = np.asarray(arr, dtype=object)
        out = np.empty(a.shape, dtype=float)
        for idx, v in np.ndenumerate(a):
            if isinstance(v, float) and not np.isfinite(v):
                out[idx] = v
                continue
            out[idx] = float(self.of(v))
        return out


class _ModelValues(_Values):
    """The solver's input (its model's values of the free symbols), the
    functions given their real meanings, whatever the model made of them.
    A symbol the model leaves free may take any value: with ``seed`` None
    it is read as 0, else as ``_Values``' random number of that seed (0
    meets near ties where a maximum compares such symbols)."""

    def __init__(self, model: z3.ModelRef, seed: int | None = None):
        super().__init__(0 if seed is None else seed)
        self.free_random = seed is not None
        self.given = {d.name(): model[d] for d in model.decls() if d.arity() == 0}

    def symbol(self, name: str) -> decimal.Decimal:
        v = self.given.get(name)
        if v is None:  # a symbol the model leaves free: any value does
            return super().symbol(name) if self.free_random else decimal.Decimal(0)
        if z3.is_rational_value(v):
            return decimal.Decimal(v.numerator_as_long()) / v.denominator_as_long()
        if z3.is_algebraic_value(v):
            return decimal.Decimal(v.as_decimal(PRECISION).rstrip("?"))
        raise Unknown(f"the model's value of {name}")


def real_at_model(claims: list[tuple[int, int, object, object]], model: z3.ModelRef
                  ) -> bool | None:
    """Whether the solver's counterexample is one for the real functions:
    True when some claim (claim, group, left, right) differs at the model's
    input with exp, log and the others evaluated as themselves, the
    symbols the model leaves free read as 0 or, on later tries, at random
    (any value of theirs completes the model); False when no try finds
    one and every claim holds at some try (the model needs an exp or a log
    that is not the real one, so it is no counterexample); None when every
    try meets a term it cannot evaluate or a near tie."""
    context = decimal.Context(prec=PRECISION, Emax=10 ** 6, Emin=-10 ** 6)
    answers = []
    with decimal.localcontext(context):
        for seed in (None, *range(TRIES)):  # the model's free symbols at 0, then at random
            values = _ModelValues(model, seed)
            try:
                if any(differs(values.of(a), values.of(b)) for _, _, a, b in claims):
                    return True
                answers.append(False)
            except (Unknown, decimal.InvalidOperation, decimal.DivisionByZero,
                    decimal.Overflow):
                answers.append(None)
    return False if False in answers else None


def differs(a: decimal.Decimal, b: decimal.Decimal) -> bool:
    return abs(a - b) > MARGIN * max(decimal.Decimal(1), abs(a), abs(b))


def falsify(claims: list[tuple[int, int, object, object]], seed: int = 0
            ) -> tuple[_Values, list[tuple[int, int]]] | None:
    """An input at which some claims (claim, group, left, right) differ, and
    which: the evaluator holding that input, and the (claim, group) pairs
    refuted. None when no try refutes one."""
    context = decimal.Context(prec=PRECISION, Emax=10 ** 6, Emin=-10 ** 6)
    with decimal.localcontext(context):
        for k in range(TRIES):
            values = _Values(seed * TRIES + k)
            bad: list[tuple[int, int]] = []
            try:
                for c, g, a, b in claims:
                    if (c, g) not in bad and differs(values.of(a), values.of(b)):
                        bad.append((c, g))
            except (Unknown, decimal.InvalidOperation, decimal.DivisionByZero,
                    decimal.Overflow):
                continue
            if bad:
                return values, bad
    return None


def evaluate(values: _Values, arr) -> np.ndarray:
    """An array of terms at the falsifying input, as floats."""
    context = decimal.Context(prec=PRECISION, Emax=10 ** 6, Emin=-10 ** 6)
    with decimal.localcontext(context):
        return values.array(arr)
