"""Layout propagation on one mesh axis, one rule per operator.

On a mesh axis of size n, a tensor is laid out as

* ``"R"``: every rank holds all of it (replicated),
* ``d`` (an int): rank i holds chunk i of n along dim d (split),
* ``"P"``: every rank holds a full-shaped part; the n parts sum to it,
* ``"M"``: every rank holds a full-shaped part; the value is their
  elementwise maximum (a max over a split dim, before its max all-reduce).

A rule maps the layouts of an op's inputs to (the layouts it needs its inputs
in, the layouts of its outputs), or returns None when the op cannot run on
them; the parallelizer then replicates the op (all inputs converted to R).
Needing an input in another layout makes the parallelizer insert a
collective (all-reduce, all-gather, split, reduce-scatter, all-to-all).

The same rules serve every axis: the batch axes (microbatches, data
parallel, expert parallel) and the tensor-parallel axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from verdict.ops.linalg import parse_einsum

Layout = Any  # "R", "P" or a split dim (int)
Shape = tuple[int, ...]
Result = tuple[list[Layout], list[Layout]] | None
Rule = Callable[[dict, list, Sequence[Shape], int, Sequence[bool]], Result]


def is_split(layout: Layout) -> bool:
    return isinstance(layout, int) and not isinstance(layout, bool)


def grad_layout(layout: Layout) -> Layout:
    """Layout a gradient must have to flow into the backward of the op that
    produced a value of ``layout``: a split stays split, while both a
    replicated and a partial-sum value take a replicated gradient."""
    return layout if is_split(layout) else "R"


def natural_grad(layout: Layout, replicated: bool) -> Layout:
    """Layout of the gradient a backward produces for an input of ``layout``.

    In a replicated op every rank computes the same gradient. In a split op
    each rank covers a disjoint piece of the work, so the gradient of a
    replicated input is a partial sum, and that of a partial input is the
    same on every rank."""
    if replicated or is_split(layout):
        return layout
    return "P" if layout == "R" else "R"


def _norm(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _pass_through(kw, ins, shapes, n, params) -> Result:
    return list(ins), [ins[0]]


def _nonlinear(kw, ins, shapes, n, params) -> Result:
    return None if ins[0] == "P" else (list(ins), [ins[0]])


def _elementwise(allow_partial: Callable[[Layout, Layout], bool]) -> Rule:
    def rule(kw, ins, shapes, n, params) -> Result:
        a, b = ins
        if a == "P" or b == "P":
            return (list(ins), ["P"]) if allow_partial(a, b) else None
        nd = max(len(shapes[0]), len(shapes[1]))
        out_dims = [lay + nd - len(s) if is_split(lay) else None
                    for lay, s in zip(ins, shapes)]
        if is_split(a) and is_split(b):
            return (list(ins), [out_dims[0]]) if out_dims[0] == out_dims[1] else None
        k = 0 if is_split(a) else 1
        od, other = out_dims[k], shapes[1 - k]
        need = list(ins)
        pos = od - (nd - len(other))
        if pos >= 0 and other[pos] != 1:
            need[1 - k] = pos
        return need, [od]

    return rule


def _softmax(kw, ins, shapes, n, params) -> Result:
    x = ins[0]
    if x == "P" or _norm(kw["dim"], len(shapes[0])) == x:
        return None
    return [x], [x]


def _causal_mask(kw, ins, shapes, n, params) -> Result:
    """Not along the key dim; along the query rows (context parallelism) the
    parallelizer tells each rank's mask where its rows sit (``row_chunk``)."""
    x = ins[0]
    if x == "P" or x == len(shapes[0]) - 1:
        return None
    return [x], [x]


def _transpose(kw, ins, shapes, n, params) -> Result:
    x = ins[0]
    if not is_split(x):
        return [x], [x]
    nd = len(shapes[0])
    d0, d1 = _norm(kw["dim0"], nd), _norm(kw["dim1"], nd)
    return [x], [d1 if x == d0 else d0 if x == d1 else x]


def _unflatten(kw, ins, shapes, n, params) -> Result:
    x = ins[0]
    if not is_split(x):
        return [x], [x]
    d, sizes = _norm(kw["dim"], len(shapes[0])), kw["sizes"]
    if x < d:
        return [x], [x]
    if x > d:
        return [x], [x + len(sizes) - 1]
    return ([x], [d]) if sizes[0] % n == 0 else None


def _flatten(kw, ins, shapes, n, params) -> Result:
    x = ins[0]
    if not is_split(x):
        return [x], [x]
    nd = len(shapes[0])
    a, b = _norm(kw["start"], nd), _norm(kw["end"], nd)
    if x < a:
        return [x], [x]
    if x > b:
        return [x], [x - (b - a)]
    return ([x], [a]) if x == a else None


def _max(kw, ins, shapes, n, params) -> Result:
    x = ins[0]
    if x == "M":
        return [x], [x]
    result = _reduce(True)(kw, ins, shapes, n, params)
    return None if result is None else (result[0], ["M" if o == "P" else o for o in result[1]])


def _reduce(allow_split_reduced: bool) -> Rule:
    def rule(kw, ins, shapes, n, params) -> Result:
        x = ins[0]
        if not is_split(x):
            return [x], [x]
        nd = len(shapes[0])
        dim = kw.get("dim")
        dims = set(range(nd)) if dim is None else {
            _norm(d, nd) for d in (dim if isinstance(dim, (list, tuple)) else [dim])
        }
        if x in dims:
            return ([x], ["P"]) if allow_split_reduced else None
        return [x], [x if kw.get("keepdim") else x - sum(1 for d in dims if d < x)]

    return rule


def _linear(kw, ins, shapes, n, params) -> Result:
    x, w = ins
    last = len(shapes[0]) - 1
    if x == "P" and w == "R":
        return list(ins), ["P"]
    if is_split(x) and x < last and w == "R":
        return list(ins), [x]
    if x == "R" and w == 0:
        return list(ins), [last]
    if is_split(x) and x < last and w == 0:  # sequence parallel: gather x first
        return ["R", 0], [last]
    if w == 1 and x in ("R", last):
        return [last, 1], ["P"]
    return None


def _matmul(kw, ins, shapes, n, params) -> Result:
    a, b = ins
    nd = len(shapes[0])
    if "P" in ins:
        return (list(ins), ["P"]) if "R" in ins else None
    if is_split(a) and is_split(b):
        if a == b and a < nd - 2:
            return list(ins), [a]
        if a == nd - 2 and b in (nd - 2, nd - 1):  # query rows split: gather keys/values
            return [a, "R"], [a]
        return (list(ins), ["P"]) if (a, b) == (nd - 1, nd - 2) else None
    if is_split(a):
        if a == nd - 2:
            return list(ins), [a]
        if a < nd - 2:
            return [a, a], [a]
        return [a, nd - 2], ["P"]
    if b == nd - 1:
        return list(ins), [b]
    if b < nd - 2:
        return [b, b], [b]
    return [nd - 1, b], ["P"]


def _einsum(kw, ins, shapes, n, params) -> Result:
    subs, out = parse_einsum(kw["eq"])
    if "P" in ins:
        return (list(ins), ["P"]) if "R" in ins else None
    letters = [subs[i][lay] if is_split(lay) else None for i, lay in enumerate(ins)]
    need = list(ins)
    if letters[0] and letters[1] and letters[0] != letters[1]:
        k = 1 if params[0] or not params[1] else 0  # re-split an activation, not a weight
        letter = letters[1 - k]
        if letter not in subs[k]:
            return None
        need[k], letters[k] = subs[k].index(letter), letter
    letter = letters[0] or letters[1]
    for k in (0, 1):
        if letters[k] is None and letter in subs[k]:
            need[k] = subs[k].index(letter)
    return need, [out.index(letter) if letter in out else "P"]


def _embedding(kw, ins, shapes, n, params) -> Result:
    ids, w = ins
    last = len(shapes[0]) - 1
    if ids == "P" or w == 1:
        return None
    if w == 0:
        return ([last, 0], ["P"]) if ids in ("R", last) else None
    return (list(ins), [ids]) if ids != last else None


def _rotary(kw, ins, shapes, n, params) -> Result:
    q, k = ins[0], ins[1]
    if q != k or not is_split(q) or q == 3:
        return None
    if q == 1:
        return [1, 1, 0, 0], [1, 1]
    return [q, q, "R", "R"], [q, q]


def _route(kw, ins, shapes, n, params) -> Result:
    return ([0], [0]) if ins[0] == 0 else None


def _multiref(kw, ins, shapes, n, params) -> Result:
    return [ins[0]], [ins[0]] * kw["times"]


RULES: dict[str, Rule] = {
    "add": _elementwise(lambda a, b: a == b == "P"),
    "mul": _elementwise(lambda a, b: {a, b} == {"P", "R"}),
    "mul_scalar": _pass_through,
    "div": _pass_through,
    "sub": _elementwise(lambda a, b: a == b == "P"),
    "detach": _pass_through,
    "max": _max,
    "exp": _nonlinear,
    "log": _nonlinear,
    "add_scalar": _nonlinear,
    "pow": _nonlinear,
    "rsqrt": _nonlinear,
    "silu": _nonlinear,
    "softmax": _softmax,
    "causal_mask": _causal_mask,
    "transpose": _transpose,
    "unflatten": _unflatten,
    "flatten": _flatten,
    "repeat_interleave": _pass_through,
    "sum": _reduce(True),
    "mean": _reduce(False),
    "linear": _linear,
    "matmul": _matmul,
    "einsum": _einsum,
    "embedding": _embedding,
    "apply_rotary_emb": _rotary,
    "route": _route,
    "multiref": _multiref,
}


def propagate(op: str, kw: dict, ins: list[Layout], shapes: Sequence[Shape], n: int,
              params: Sequence[bool], n_out: int) -> tuple[list[Layout], list[Layout], bool]:
    """(needed input layouts, output layouts, replicated?) of a forward op.

    A partial maximum is only ever read by another max; any other op needs
    it whole (a max all-reduce first)."""
    if op != "max":
        ins = ["R" if layout == "M" else layout for layout in ins]
    if all(layout == "R" for layout in ins):
        return list(ins), ["R"] * n_out, True
    rule = RULES.get(op)
    result = rule(kw, list(ins), shapes, n, params) if rule else None
    if result is None:
        return ["R"] * len(ins), ["R"] * n_out, True
    need, out = result
    return need, out, all(layout == "R" for layout in need)
