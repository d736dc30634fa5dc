"""The logical graph: a model's training step on one device, before any
parallelization. Tensors are logical tensors; a value is (tid, version)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verdict.ops import get_op
from verdict.plan import Logical

Value = tuple[int, int]  # (logical tid, version); -1 marks an absent slot
ABSENT: Value = (-1, -1)


@dataclass
class LOp:
    """One operator of the logical graph.

    A backward op (``dir == 'bw'``) is laid out by primal position:
    ``inputs`` = the forward inputs it keeps (ABSENT where not kept) followed
    by one gradient per forward output; ``outputs`` = one gradient per forward
    input (ABSENT where none is needed). ``fw`` is its forward op's index.
    """

    op: str
    dir: str
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    kwargs: dict[str, Any]
    name: str
    fw: int = -1


@dataclass
class LogicalGraph:
    tensors: list[Logical] = field(default_factory=list)
    requires_grad: list[bool] = field(default_factory=list)
    ops: list[LOp] = field(default_factory=list)
    inputs: dict[str, int] = field(default_factory=dict)
    loss: int = -1
    grads: dict[int, int] = field(default_factory=dict)  # param tid -> final gradbuf tid

    def new_tensor(self, name: str, shape, kind: str, requires_grad: bool = False) -> int:
        self.tensors.append(Logical(name, tuple(int(n) for n in shape), kind))
        self.requires_grad.append(requires_grad)
        return len(self.tensors) - 1

    def add_op(self, op: str, dir: str, inputs, kwargs, name: str, kinds: str = "act") -> LOp:
        """Append an op whose outputs are new tensors (version 0) shaped by its rule."""
        rule = get_op(op)
        shapes = rule.shape([self.tensors[t].shape for t, _ in inputs], **kwargs)
        needs = any(self.requires_grad[inputs[i][0]] for i in rule.differentiable_inputs(len(inputs)))
        outs = tuple(
            (self.new_tensor(name if len(shapes) == 1 else f"{name}:{i}", s, kinds, needs), 0)
            for i, s in enumerate(shapes)
        )
        lop = LOp(op, dir, tuple(inputs), outs, dict(kwargs), name)
        self.ops.append(lop)
        return lop

    def shape(self, tid: int) -> tuple[int, ...]:
        return self.tensors[tid].shape
