"""Prove one stage: assume its input lineages, run both sides symbolically,
and show that every group of every output lineage equals its slice of Ts.

Input Tp's are not constrained but substituted: a replica is the slice of
its Ts; the last member of a partial-sum group is the slice minus the other
members, which are fresh. A scaled Tp (docs/soundness.md, "Scaled claims")
takes part through its norm, Tp / scale: the substitution sets Tp to scale
times the value a Tp of scale 1 would get, and every claim compares norms.
Cheap proofs come first: a claim whose difference simplifies to 0 is proved
without the solver, and so is one whose two sides have one exponential
normal form (verdict/expalgebra.py: exp(a + b) = exp(a) exp(b), exp(log x)
= x for x > 0; docs/soundness.md, "Exponentials and logarithms"). What is
left goes to Z3 as one query: is there an input for which some claim fails?

The symbolic arrays come from a backend passed in (:class:`Symbolic`; main.py
passes ``backends.z3backend.Z3``): verdict/ never imports backends/.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import numpy as np
import z3

from verdict.expalgebra import Algebra, touches
from verdict.falsify import evaluate as evaluate_at
from verdict.falsify import falsify, real_at_model
from verdict.numeric import run_node
from verdict.plan import Node
from verdict.problem import LineageFact, Problem


@dataclass
class Outcome:
    status: str  # proved | counterexample | unknown | error
    detail: str = ""
    seconds: float = 0.0
    solver: bool = False  # whether the solver was needed
    ts_values: dict[int, np.ndarray] = field(default_factory=dict)
    tp_values: dict[int, np.ndarray] = field(default_factory=dict)
    bad: list[tuple[int, int]] = field(default_factory=list)  # (claim, group) that differ

    @property
    def ok(self) -> bool:
        return self.status == "proved"


class Symbolic(Protocol):
    """What the prover needs of a symbolic backend: the rule table's ``xp``
    functions for object arrays of Z3 terms, and arrays of fresh variables."""

    def xp(self) -> Any: ...

    def variables(self, prefix: str, shape: tuple[int, ...]) -> np.ndarray: ...


@dataclass(frozen=True)
class Prover:
    """``solve`` bound to a symbolic backend: the ``solve_fn`` executors run.
    Plain data and a backend object, so it crosses process boundaries."""

    symbolic: Symbolic
    timeout_ms: int = 120_000

    def __call__(self, p: Problem, seed: int = 0) -> Outcome:
        return solve(p, seed, self.timeout_ms, symbolic=self.symbolic)


def _region(slices) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in slices)


def _total(arrays: list[np.ndarray]) -> np.ndarray:
    """Elementwise sum of object arrays (0-d arrays included)."""
    flat = [np.ravel(np.asarray(a, dtype=object)) for a in arrays]
    out = np.empty(len(flat[0]), dtype=object)
    for k in range(len(out)):
        acc = flat[0][k]
        for f in flat[1:]:
            acc = acc + f[k]
        out[k] = acc
    return out.reshape(np.shape(arrays[0]))


def _is_const(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _times(arr, factor: tuple[int, int]) -> np.ndarray:
    """An object array times an exact rational: constants stay Python
    numbers where the product is exact (0, infinities), terms get an exact
    Z3 rational."""
    num, den = factor
    if (num, den) == (1, 1):
        return arr
    q = z3.Q(num, den)
    a = np.asarray(arr, dtype=object)
    out = np.empty(a.shape, dtype=object)
    for idx, v in np.ndenumerate(a):
        if _is_const(v) and (v == 0 or not math.isfinite(v)):
            out[idx] = v * (1 if num > 0 else -1)
        else:
            out[idx] = _real(v) * q
    return out


class _Run:
    def __init__(self, p: Problem, symbolic: Symbolic):
        self.p = p
        self.symbolic = symbolic
        self.ts: dict[int, np.ndarray] = {}
        self.tp: dict[int, np.ndarray] = {}
        self.assume: list[z3.BoolRef] = []
        self.open_pairs: list[tuple[int, int, Any, Any]] = []  # (claim, group, left, right)
        #: open claims with a number on one side: checked with the others
        #: when a solver's model is evaluated with the real functions
        self.const_pairs: list[tuple[int, int, Any, Any]] = []

    def setup(self) -> None:
        p = self.p
        needed = {f.ts for f in p.given}
        if p.gs is not None:
            needed |= {i for i in p.gs[3] if i >= 0}
        else:  # an input stage: the input its pieces claim, even when none is loaded
            needed |= {f.ts for f in p.claims}
        for i in sorted(needed):
            if i in p.constants:
                op, direction, kw = p.constants[i]
                self.run_side([(op, direction, kw, [], [i])], self.ts, p.ts_shapes)
            else:
                self.ts[i] = self.symbolic.variables(f"Ts{i}", p.ts_shapes[i])
        for f in p.given:
            self.substitute(f)

    def scale(self, m: int) -> tuple[int, int]:
        return self.p.scales.get(m, (1, 1))

    def norm(self, m: int) -> np.ndarray:
        """Tp m divided by its factor: the piece its view names."""
        num, den = self.scale(m)
        return _times(self.tp[m], (den, num) if num > 0 else (-den, -num))

    def substitute(self, f: LineageFact) -> None:
        for slices, members in f.groups:
            piece = np.asarray(self.ts[f.ts][_region(slices)], dtype=object)  # 0-d stays an array
            free = [m for m in members if m not in self.tp]
            if not free:
                total = _total([self.norm(m) for m in members])
                self.assume += [a == b for a, b in zip(np.ravel(total), np.ravel(piece))]
                continue
            last = free[-1]
            for m in free[:-1]:
                self.tp[m] = self.symbolic.variables(f"Tp{m}", self.p.tp_shapes[m])
            others = [self.norm(m) for m in members if m != last]
            rest = piece - _total(others) if others else piece
            rest = np.array(rest, dtype=object).reshape(np.shape(piece))
            self.tp[last] = np.array(_times(rest, self.scale(last)),
                                     dtype=object).reshape(np.shape(piece))
        for m in f.loose:
            if m not in self.tp:
                self.tp[m] = self.symbolic.variables(f"Tp{m}", self.p.tp_shapes[m])
        for first, others in f.aliases:
            for o in others:
                ratio = Fraction(*self.scale(o)) / Fraction(*self.scale(first))
                self.tp[o] = _times(self.tp[first], (ratio.numerator, ratio.denominator))

    def run_side(self, nodes, values: dict, shapes: list) -> None:
        xp = self.symbolic.xp()
        for op, direction, kw, ins, outs in nodes:
            args = [values[i] if i >= 0 else None for i in ins]
            out_shapes = [shapes[o] if o >= 0 else None for o in outs]
            node = Node(0, 0, op, direction, tuple(ins), tuple(outs), kw)
            results = run_node(xp, node, args, out_shapes)
            for o, v in zip(outs, results):
                if o < 0:
                    continue
                v = np.asarray(v, dtype=object)
                if tuple(v.shape) != tuple(shapes[o]):
                    raise ValueError(f"{op} ({direction}) made shape {v.shape}, expected {shapes[o]}")
                values[o] = v

    def pairs(self):
        """(claim, check, left, right) for every equality to prove: each group
        sums to its slice of Ts (check = group index), each replica of a part
        equals its first (check = -1 - alias index)."""
        for c, f in enumerate(self.p.claims):
            for g, (slices, members) in enumerate(f.groups):
                yield c, g, _total([self.norm(m) for m in members]), self.ts[f.ts][_region(slices)]
            for k, (first, others) in enumerate(f.aliases):
                for o in others:
                    yield c, -1 - k, self.norm(o), self.norm(first)

    def obligations(self) -> tuple[list, list[tuple[int, int]], bool]:
        """Open claims (as Z3 inequalities), definitely failing groups, and
        whether every claim was settled without the solver."""
        open_, definite = [], []
        algebra = Algebra()  # one per stage: its atoms are shared by the claims
        for c, g, total, piece in self.pairs():
            for a, b in zip(np.ravel(total), np.ravel(piece)):
                if _is_const(a) or _is_const(b):
                    if _is_const(a) and _is_const(b) and a == b:
                        continue
                    if not (_is_const(a) and _is_const(b)) and math.isfinite(
                            a if _is_const(a) else b):
                        open_.append((c, g, _real(a) != _real(b)))
                        self.const_pairs.append((c, g, a, b))
                        continue
                    definite.append((c, g))
                    continue
                diff = z3.simplify(a - b, som=True)
                if z3.is_rational_value(diff) and diff.as_fraction() == 0:
                    continue
                if (touches(a) or touches(b)) and algebra.equal(a, b):
                    continue  # the exponential normal form (verdict/expalgebra.py)
                open_.append((c, g, a != b))
                self.open_pairs.append((c, g, a, b))
        return open_, definite, not open_


def _real(v):
    return v if z3.is_expr(v) else z3.RealVal(v)


def _divisions(terms) -> list[z3.BoolRef]:
    """For every division a/b inside ``terms``, (b == 0) -> (a/b == 0).

    Z3 leaves x/0 an arbitrary function of x, so (2a)/b / 2 and a/b differ
    at b = 0 although they are equal wherever the division is defined. A
    scaled claim meets exactly that, so its stages fix x/0 to 0: one
    interpretation of the undefined value, always consistent (it
    constrains no input), and the same on both sides."""
    out, seen = [], set()
    stack = [t for t in terms if z3.is_expr(t)]
    while stack:
        e = stack.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if z3.is_app_of(e, z3.Z3_OP_DIV):
            out.append(z3.Implies(e.arg(1) == 0, e == 0))
        stack.extend(e.children())
    return out


def _decimal(val: z3.ExprRef) -> float:
    """A huge rational's value, read from its leading digits (inf when it
    is beyond a float)."""
    num, den = val.numerator().as_string(), val.denominator().as_string()
    sign = -1.0 if num.startswith("-") else 1.0
    num = num.lstrip("-")

    def lead(digits: str) -> float:
        return float(digits[:17]) / 10.0 ** (min(len(digits), 17) - 1)

    try:
        return sign * lead(num) / lead(den) * 10.0 ** (len(num) - len(den))
    except OverflowError:
        return sign * math.inf


def _evaluate(model: z3.ModelRef, arr: np.ndarray) -> np.ndarray:
    out = np.empty(arr.shape, dtype=float)
    for idx, v in np.ndenumerate(arr):
        if _is_const(v):
            out[idx] = float(v)
            continue
        val = model.eval(v, model_completion=True)
        try:
            out[idx] = float(val.as_fraction()) if z3.is_rational_value(val) else float(
                val.as_decimal(12).rstrip("?"))
        except (ValueError, OverflowError):  # a rational past Python's digit limit
            out[idx] = _decimal(val)
    return out


def solve(p: Problem, seed: int = 0, timeout_ms: int = 120_000, *,
          symbolic: Symbolic) -> Outcome:
    start = time.perf_counter()
    run = _Run(p, symbolic)
    try:
        run.setup()
        if p.gs is not None:
            run.run_side([p.gs], run.ts, p.ts_shapes)
        run.run_side(p.gp, run.tp, p.tp_shapes)
        open_, definite, cheap = run.obligations()
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError) as e:
        return Outcome("error", f"{type(e).__name__}: {e}", time.perf_counter() - start)
    if cheap and not definite:
        return Outcome("proved", seconds=time.perf_counter() - start)
    if not definite and not run.assume and any(touches(a) or touches(b)
                                               for _, _, a, b in run.open_pairs):
        found = falsify(run.open_pairs, seed)  # verdict/falsify.py
        if found is not None:
            values, bad = found
            out = Outcome("counterexample", "evaluated", time.perf_counter() - start)
            out.ts_values = {i: evaluate_at(values, a) for i, a in run.ts.items()}
            out.tp_values = {i: evaluate_at(values, a) for i, a in run.tp.items()}
            out.bad = bad
            return out
    solver = z3.Solver()
    solver.set("random_seed", seed)
    solver.set("timeout", timeout_ms)
    solver.add(*run.assume)
    if not definite:
        solver.add(z3.Or([o for _, _, o in open_]))
    if p.scales:
        solver.add(*_divisions([o for _, _, o in open_]))
    result = solver.check()
    took = time.perf_counter() - start
    if result == z3.unsat:
        return Outcome("proved", seconds=took, solver=True)
    if result == z3.unknown:
        return Outcome("unknown", f"solver: {solver.reason_unknown()}", took, solver=True)
    model = solver.model()
    if not definite and any(touches(a) or touches(b) for _, _, a, b in run.open_pairs):
        # exp and log are uninterpreted for the solver: its model is a
        # counterexample only where the real functions differ too; one that
        # needs other functions, or that cannot be checked (a near tie, a
        # value outside log's domain), is no evidence (docs/soundness.md,
        # "Exponentials and logarithms", "Counterexamples by evaluation")
        real = real_at_model(run.open_pairs + run.const_pairs, model)
        if real is False:
            return Outcome("unknown", "the solver's counterexample needs an exp or a log that "
                                      "is not the real function (the normal form gave no "
                                      "answer within its budget)", took, solver=True)
        if real is None:
            return Outcome("unknown", "the solver's counterexample could not be checked with "
                                      "the real exp and log (a near tie or a value outside "
                                      "their domain at its input; the normal form gave no "
                                      "answer within its budget)", took, solver=True)
    out = Outcome("counterexample", seconds=took, solver=True)
    out.ts_values = {i: _evaluate(model, a) for i, a in run.ts.items()}
    out.tp_values = {i: _evaluate(model, a) for i, a in run.tp.items()}
    for c, g, total, piece in run.pairs():
        left, right = _evaluate(model, np.asarray(total, dtype=object)), _evaluate(
            model, np.asarray(piece, dtype=object))
        with np.errstate(invalid="ignore"):
            same = np.where(left == right, True, np.isclose(left, right, rtol=0, atol=1e-9))
        if not bool(np.all(same)) and (c, g) not in out.bad:
            out.bad.append((c, g))
    return out
