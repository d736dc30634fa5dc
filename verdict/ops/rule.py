"""The shape of one operator's rule table.

An operator is a name plus a few pure functions, in the manner of JAX's
primitives: a shape rule, a forward and a backward. Forward and backward are
written once against numpy's array API and an ``xp`` backend that supplies the
non-linear elementwise functions (exp, rsqrt, sigmoid, ...). The numeric
backend (numpy float64) and the symbolic backend (numpy object arrays of Z3
terms) both run the same rule, so the two can never drift apart.

Conventions a rule relies on:

* ``shape(in_shapes, **kw)`` returns the output shapes; it raises
  :class:`ShapeError` when the inputs do not fit together.
* ``forward(xp, inputs, **kw)`` returns a tuple of output arrays.
* ``backward(xp, saved, grads, grad_shapes, **kw)`` returns one gradient per
  forward input (``None`` for inputs that take none). ``saved`` is the tuple
  of forward inputs with ``None`` at positions not listed in ``saves``;
  ``grads`` holds one gradient per forward output; ``grad_shapes`` are the
  shapes of the forward inputs, which a backward such as ``sum`` needs.
* ``diff`` lists the input positions that can receive a gradient.
* ``group`` marks a collective: its inputs are the tensors of every rank of
  the group, in group order, and ``kw['index']`` is this rank's position.

Two more rules serve shape reduction (verdict/reduce.py):

* ``dims(in_shapes, out_shapes, **kw)`` lists how the dims of inputs and
  outputs are tied: ``("eq", a, b)``, ``("mul", target, [factors], k)``
  (target = product of factors times k) and ``("min", a, n)``, where a dim
  reference is ``("i" | "o", position, dim)``. The default ties every output
  dim to the aligned (broadcast) dims of every input.
* ``resize(kw, in_shapes, out_shapes)`` rewrites the kwargs that hold sizes
  (e.g. unflatten's sizes) for other shapes; the default keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Shape = tuple[int, ...]


class ShapeError(ValueError):
    """Inputs of an operator whose shapes do not fit its rule."""


@dataclass(frozen=True)
class Op:
    name: str
    shape: Callable[..., list[Shape]]
    forward: Callable[..., tuple[Any, ...]]
    backward: Callable[..., tuple[Any, ...]] | None = None
    saves: tuple[int, ...] = ()
    diff: tuple[int, ...] | None = None
    group: bool = False
    doc: str = ""
    dims: Callable[..., list[tuple]] | None = None
    resize: Callable[..., dict[str, Any]] | None = None

    def relations(self, in_shapes: Sequence[Shape | None], out_shapes: Sequence[Shape | None],
                  kw: dict[str, Any]) -> list[tuple]:
        rule = self.dims or aligned_dims
        return rule(in_shapes, out_shapes, **kw)

    def resized(self, kw: dict[str, Any], in_shapes: Sequence[Shape | None],
                out_shapes: Sequence[Shape | None]) -> dict[str, Any]:
        return dict(kw) if self.resize is None else self.resize(dict(kw), in_shapes, out_shapes)

    def differentiable_inputs(self, n_inputs: int) -> tuple[int, ...]:
        if self.backward is None:
            return ()
        return tuple(range(n_inputs)) if self.diff is None else self.diff

    def saved(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """The forward inputs a backward node keeps, ``None`` elsewhere."""
        return tuple(x if i in self.saves else None for i, x in enumerate(inputs))


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise ShapeError(message)


def norm_dim(dim: int, ndim: int) -> int:
    expect(-ndim <= dim < max(ndim, 1), f"dim {dim} out of range for rank {ndim}")
    return dim % ndim if ndim else 0


def broadcast_shape(a: Shape, b: Shape) -> Shape:
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        expect(x == y or x == 1 or y == 1, f"cannot broadcast {a} with {b}")
        out.append(max(x, y))
    return tuple(out)


def aligned_dims(in_shapes, out_shapes, **_kw) -> list[tuple]:
    """Elementwise ops: each output dim equals the right-aligned dim of every
    input that is not broadcast (size 1) along it."""
    rel = []
    for o, out in enumerate(out_shapes):
        if out is None:
            continue
        for i, shape in enumerate(in_shapes):
            if shape is None:
                continue
            for k in range(1, len(shape) + 1):
                if k <= len(out) and (shape[-k] == out[-k] or shape[-k] != 1):
                    rel.append(("eq", ("o", o, len(out) - k), ("i", i, len(shape) - k)))
    return rel
