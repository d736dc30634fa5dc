"""Exact algebra of exp and log on Z3 terms: the normal form that proves the
merge of attention blocks by their log-sum-exps (docs/soundness.md,
"Exponentials and logarithms: the exact merge of attention blocks").

exp and log stay uninterpreted functions in the terms the rules build. To
compare two terms, both are reduced to a quotient N / D of *exponential
polynomials*:

* N is a sum of monomials ``c * a_1^k_1 ... a_r^k_r * exp(E)``: c rational,
  the a's atoms (variables, If-terms, other functions' applications, and
  logarithms of normalised positive polynomials), E a polynomial of the
  same kind (an interned id; 0 is the zero polynomial, exp(0) = 1).
  Monomials multiply by exp(E) exp(F) = exp(E + F) (L1).
* D is a multiset of factors, each a normalised polynomial known to be
  positive (so never zero).
* exp(x) takes the terms ``k log P`` (k an integer) out of x's exponent as
  P^k (L2); log(x), for x positive by its syntax, is
  ``log c + mean exponent + log P'`` with P' the normalised positive
  (L2, and the mean makes every common shift cancel: L3); sigmoid(x) is
  1 / (1 + exp(-x)), its definition (PyTorch's ring merges with sigmoid
  and logsigmoid).

Every rewrite is an identity of real arithmetic whose side condition
(positivity) is read off the term's syntax; atoms are independent. So equal
normal forms prove equality for every value of the atoms; anything else is
left to the solver. ``equal`` answers True only on such a proof.
"""

from __future__ import annotations

import sys
import time
from fractions import Fraction

import z3

EXP, LOG, SIGMOID = "exp", "log", "sigmoid"
#: a polynomial with more monomials than this is left to the solver
LIMIT = 20_000

Mono = tuple[tuple[tuple[int, int], ...], int]  # (atom powers, exponent id)
Poly = dict[Mono, Fraction]
Frac = tuple[Poly, tuple[int, ...]]  # numerator, denominator factors (poly ids)
ONE: Mono = ((), 0)


class TooBig(Exception):
    """A polynomial past LIMIT, or the time budget spent: no answer."""


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
    """2: positive, 1: non-negative, 0: unknown, by syntax alone (real exp
    is positive)."""
    memo = {} if memo is None else memo
    key = t.get_id()
    if key in memo:
        return memo[key]
    v = _value(t)
    if v is not None:
        out = 2 if v > 0 else 1 if v == 0 else 0
    elif _is_fn(t, EXP) or _is_fn(t, SIGMOID):
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


class Algebra:
    """Normal forms of Z3 terms; one instance shares its atoms and memo
    between the terms it compares (those of one stage)."""

    def __init__(self, budget: float = 20.0) -> None:
        #: seconds of this thread's CPU time this instance may spend; past
        #: them every answer is "not proved" and the claims go to the solver.
        #: CPU time, not wall time: on a loaded machine a stage's normal form
        #: took 37 s of wall time for 20 s of budget, fell to the solver, and
        #: a correct plan FAILed there (docs/soundness.md, "Plans traced from
        #: PyTorch", 132 (c)); the answer must not depend on other processes
        self.deadline = time.thread_time() + budget
        self.ids: dict[tuple, int] = {(): 0}  # frozen polynomial -> id
        self.polys: list[Poly] = [{}]
        self.atoms: dict[tuple, int] = {}
        self.log_atoms: dict[int, int] = {}  # atom -> id of the positive it is the log of
        self.const_logs: dict[int, Fraction] = {}  # atom -> c of log c
        self.memo: dict[int, Frac] = {}
        self.signs: dict[int, int] = {}
        self.sums: dict[tuple[int, int], int] = {}

    # polynomials

    def intern(self, p: Poly) -> int:
        frozen = tuple(sorted((m, c) for m, c in p.items() if c))
        got = self.ids.get(frozen)
        if got is None:
            got = self.ids[frozen] = len(self.polys)
            self.polys.append(dict(frozen))
        return got

    def add_ids(self, a: int, b: int) -> int:
        if not a or not b:
            return a or b
        key = (a, b) if a < b else (b, a)
        got = self.sums.get(key)
        if got is None:
            got = self.sums[key] = self.intern(self.add(self.polys[a], self.polys[b]))
        return got

    def mono_mul(self, m: Mono, n: Mono) -> Mono:
        if not m[0] and not n[0]:
            return (), self.add_ids(m[1], n[1])
        powers = dict(m[0])
        for a, k in n[0]:
            powers[a] = powers.get(a, 0) + k
        return (tuple(sorted((a, k) for a, k in powers.items() if k)),
                self.add_ids(m[1], n[1]))

    @staticmethod
    def add(p: Poly, q: Poly, sign_q: int = 1) -> Poly:
        out = dict(p)
        for m, c in q.items():
            v = out.get(m, 0) + sign_q * c
            if v:
                out[m] = v
            else:
                out.pop(m, None)
        return out

    def mul(self, p: Poly, q: Poly) -> Poly:
        if len(p) * len(q) > LIMIT or time.thread_time() > self.deadline:
            raise TooBig
        out: Poly = {}
        for m, c in p.items():
            for n, d in q.items():
                k = self.mono_mul(m, n)
                v = out.get(k, 0) + c * d
                if v:
                    out[k] = v
                else:
                    out.pop(k, None)
        return out

    def expand(self, factors: tuple[int, ...]) -> Poly:
        out: Poly = {ONE: Fraction(1)}
        for f in factors:
            out = self.mul(out, self.polys[f])
        return out

    def unit(self, p: Poly) -> tuple[Fraction, Poly, int]:
        """p = c exp(E) p' with E the mean of p's exponents and c the first
        coefficient of p' when positive: (c, E as a polynomial, id of p')."""
        mean: Poly = {}
        for m in p:
            mean = self.add(mean, self.polys[m[1]])
        mean = {m: c / len(p) for m, c in mean.items()}
        shift = self.intern({m: -c for m, c in mean.items()})
        rest = {self.mono_mul(m, ((), shift)): c for m, c in p.items()}
        first = rest[min(rest)]
        c = first if first > 0 else Fraction(1)
        return c, mean, self.intern({m: v / c for m, v in rest.items()})

    # quotients

    def frac_add(self, a: Frac, b: Frac, sign_b: int = 1) -> Frac:
        (n1, d1), (n2, d2) = a, b
        if d1 == d2:
            return self.add(n1, n2, sign_b), d1
        lcm = _union(d1, d2)
        return (self.add(self.mul(n1, self.expand(_minus(lcm, d1))),
                         self.mul(n2, self.expand(_minus(lcm, d2))), sign_b), lcm)

    def cancel(self, n: Poly, d: tuple[int, ...]) -> tuple[Poly, tuple[int, ...]]:
        """n / d with n = c exp(E) f for a factor f of d: c exp(E) / (d - f)."""
        if not n or not d:
            return n, d
        c, mean, rest = self.unit(n)
        if rest in d:
            return {((), self.intern(mean)): c}, _minus(d, (rest,))
        return n, d

    def frac_mul(self, a: Frac, b: Frac) -> Frac:
        (n1, d1), (n2, d2) = a, b
        n1, d2 = self.cancel(n1, d2)
        n2, d1 = self.cancel(n2, d1)
        return self.mul(n1, n2), tuple(sorted(d1 + d2))

    def frac_div(self, a: Frac, b: Frac) -> Frac:
        """a / b for b positive."""
        (n1, d1), (n2, d2) = a, b
        c, mean, rest = self.unit(n2)
        inverse = {((), self.intern({m: -v for m, v in mean.items()})): 1 / c}
        common = _common(d1, d2)
        top = self.mul(self.mul(n1, inverse), self.expand(_minus(d2, common)))
        one = self.intern({ONE: Fraction(1)})
        return self.cancel(top, tuple(sorted(_minus(d1, common) + ((rest,) if rest != one
                                                                    else ()))))

    # atoms

    def atom(self, key: tuple) -> Poly:
        a = self.atoms.get(key)
        if a is None:
            a = self.atoms[key] = len(self.atoms) + 1
        return {(((a, 1),), 0): Fraction(1)}

    def log_of(self, p: Poly) -> Poly:
        """log p for p positive (L2, L3)."""
        c, mean, rest = self.unit(p)
        out = dict(mean)
        if rest != self.intern({ONE: Fraction(1)}):
            atom = self.atom(("log", rest))
            self.log_atoms[next(iter(atom))[0][0][0]] = rest
            out = self.add(out, atom)
        if c != 1:
            atom = self.atom(("logc", c))
            self.const_logs[next(iter(atom))[0][0][0]] = c
            out = self.add(out, atom)
        return out

    def exp_of(self, x: Frac) -> Frac:
        n, d = x
        if d:
            return self.atom(("exp", self.intern(n), d)), ()
        rest: Poly = {}
        up: list[int] = []
        down: list[int] = []
        scale = Fraction(1)
        for m, c in n.items():
            atoms, e = m
            if (e == 0 and len(atoms) == 1 and atoms[0][1] == 1 and c.denominator == 1
                    and (atoms[0][0] in self.log_atoms or atoms[0][0] in self.const_logs)):
                a, k = atoms[0][0], int(c)
                if a in self.const_logs:
                    scale *= self.const_logs[a] ** k
                else:
                    (up if k > 0 else down).extend([self.log_atoms[a]] * abs(k))
                continue
            rest[m] = c
        top = self.mul({((), self.intern(rest)): scale}, self.expand(tuple(up)))
        return self.cancel(top, tuple(sorted(down)))

    # terms

    def of(self, t) -> Frac:
        if not z3.is_expr(t):
            return ({ONE: Fraction(t)} if t else {}), ()
        key = t.get_id()
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = self._of(t)
        return got

    def _positive(self, t: z3.ExprRef) -> bool:
        return sign(t, self.signs) == 2

    def _of(self, t: z3.ExprRef) -> Frac:
        v = _value(t)
        if v is not None:
            return ({ONE: v} if v else {}), ()
        kids = t.children() if z3.is_app(t) else []
        if z3.is_app_of(t, z3.Z3_OP_ADD):
            out = self.of(kids[0])
            for k in kids[1:]:
                out = self.frac_add(out, self.of(k))
            return out
        if z3.is_app_of(t, z3.Z3_OP_SUB):
            out = self.of(kids[0])
            for k in kids[1:]:
                out = self.frac_add(out, self.of(k), -1)
            return out
        if z3.is_app_of(t, z3.Z3_OP_UMINUS):
            n, d = self.of(kids[0])
            return {m: -c for m, c in n.items()}, d
        if z3.is_app_of(t, z3.Z3_OP_MUL):
            out = self.of(kids[0])
            for k in kids[1:]:
                out = self.frac_mul(out, self.of(k))
            return out
        if z3.is_app_of(t, z3.Z3_OP_DIV) and self._positive(kids[1]):
            return self.frac_div(self.of(kids[0]), self.of(kids[1]))
        power = _integer_power(t)
        if power is not None and (power >= 0 or self._positive(kids[0])):
            base = self.of(kids[0])
            out: Frac = ({ONE: Fraction(1)}, ())
            for _ in range(abs(power)):
                out = self.frac_mul(out, base)
            return out if power >= 0 else self.frac_div(({ONE: Fraction(1)}, ()), out)
        if _is_fn(t, EXP):
            return self.exp_of(self.of(kids[0]))
        if _is_fn(t, SIGMOID):  # 1 / (1 + exp(-x)), its definition
            n, d = self.of(kids[0])
            denominator = self.frac_add(({ONE: Fraction(1)}, ()),
                                        self.exp_of(({m: -c for m, c in n.items()}, d)))
            return self.frac_div(({ONE: Fraction(1)}, ()), denominator)
        if _is_fn(t, LOG) and self._positive(kids[0]):
            n, d = self.of(kids[0])
            out = self.log_of(n)
            for f in d:
                out = self.add(out, self.log_of(self.polys[f]), -1)
            return out, ()
        if z3.is_app(t) and t.decl().kind() == z3.Z3_OP_UNINTERPRETED:
            args = tuple((self.intern(n), d) for n, d in (self.of(k) for k in kids))
            return self.atom(("fn", t.decl().name(), args)), ()
        return self.atom(("term", t.get_id())), ()

    def equal(self, a, b) -> bool:
        """True only if a == b is proved by the normal form."""
        if time.thread_time() > self.deadline:
            return False
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))
        try:
            n, _ = self.frac_add(self.of(a), self.of(b), -1)
            return not n
        except (TooBig, RecursionError, ZeroDivisionError):
            return False
        finally:
            sys.setrecursionlimit(limit)


def _union(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    out = list(a)
    rest = list(a)
    for f in b:
        if f in rest:
            rest.remove(f)
        else:
            out.append(f)
    return tuple(sorted(out))


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    rest, out = list(b), []
    for f in a:
        if f in rest:
            rest.remove(f)
            out.append(f)
    return tuple(sorted(out))


def _minus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    out = list(a)
    for f in b:
        out.remove(f)
    return tuple(out)


def touches(t) -> bool:
    """Whether a term holds an exp or a log: where the normal form can add
    to Z3's polynomial normalisation."""
    if not z3.is_expr(t):
        return False
    seen: set[int] = set()
    stack = [t]
    while stack:
        e = stack.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if _is_fn(e, LOG) or _is_fn(e, EXP):
            return True
        stack.extend(e.children())
    return False


def equal(a, b) -> bool:
    """True only if a == b is proved by the normal form (module docstring)."""
    return Algebra().equal(a, b)
