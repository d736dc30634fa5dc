"""Numeric execution of a plan in float64: the ground truth the symbolic
verifier is tested against, and the differential check of two plans.

Inputs (data, tokens, parameters, buffers) are drawn from a generator seeded
by (seed, logical tensor name), so every plan of the same model gets the same
full values and each rank reads its slice of them.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np

from verdict.ops import get_op
from verdict.ops.nn import route_numeric
from verdict.plan import INPUT_KINDS, Logical, Node, Plan, Tensor


class NumericXP:
    """The ``xp`` backend of the rule table for float64 numpy arrays."""

    @staticmethod
    def exp(x):
        return np.exp(x)

    @staticmethod
    def log(x):
        return np.log(x)

    @staticmethod
    def rsqrt(x):
        return 1.0 / np.sqrt(x)

    @staticmethod
    def adam_ratio(m, v, eps):
        return m / (np.sqrt(v) + eps)

    @staticmethod
    def maximum(a, b):
        return np.maximum(a, b)

    @staticmethod
    def equal(a, b):
        return np.asarray(np.asarray(a) == np.asarray(b), dtype=float)

    @staticmethod
    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    @staticmethod
    def tanh(x):
        return np.tanh(x)

    @staticmethod
    def erf(x):
        return np.vectorize(math.erf, otypes=[float])(x)

    @staticmethod
    def step(x):
        """1 where x > 0, else 0 (the derivative of relu, 0 at 0 as torch's)."""
        return np.asarray(np.asarray(x) > 0, dtype=float)

    @staticmethod
    def softmax(x, dim):
        top = np.max(x, axis=dim, keepdims=True)
        e = np.exp(x - np.where(np.isfinite(top), top, 0.0))
        return e / np.sum(e, axis=dim, keepdims=True)

    @staticmethod
    def power(x, exponent):
        return np.power(x, exponent)

    @staticmethod
    def zeros(shape):
        return np.zeros(shape)

    @staticmethod
    def ones(shape):
        return np.ones(shape)

    @staticmethod
    def copy(x):
        return np.array(x, copy=True)

    @staticmethod
    def asarray(x):
        return np.asarray(x, dtype=float)

    @staticmethod
    def route(scores, topk, capacity):
        return route_numeric(scores, topk, capacity)


class ExecutionError(RuntimeError):
    """A node whose inputs or outputs do not match the plan."""


def input_value(t: Logical, seed: int) -> np.ndarray:
    """The full value of an input logical tensor, the same in every plan."""
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    if t.kind == "tokens":
        ids = rng.integers(0, t.shape[-1], size=t.shape[:-1])
        return np.eye(t.shape[-1])[ids]
    if t.kind == "param":
        if len(t.shape) == 1:
            return 1.0 + 0.1 * rng.uniform(-1.0, 1.0, t.shape)
        return rng.uniform(-1.0, 1.0, t.shape) / math.sqrt(t.shape[-1])
    if t.kind == "buffer" and t.name.endswith(".exp_avg_sq"):
        return rng.uniform(0.0, 1.0, t.shape)  # Adam's second moment is never negative
    if t.kind == "buffer":
        return rng.uniform(-1.0, 1.0, t.shape)
    return rng.standard_normal(t.shape)


def _slice(t: Tensor) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in t.slices)


def run_node(xp, node: Node, args: Sequence, shapes: Sequence) -> list:
    """Run one node; ``args`` are its input values (None at absent slots) and
    ``shapes`` the shapes of its outputs (None at absent slots).

    A bw node runs its operator's backward rule; operators without one
    (constants, collectives) run forward in either direction.
    """
    rule = get_op(node.op)
    if node.dir != "bw" or rule.backward is None:
        return list(rule.forward(xp, tuple(args), **node.kwargs))
    n = len(node.outputs)
    saved, grads = tuple(args[:n]), tuple(args[n:])
    in_shapes = tuple(
        shape if shape is not None else (None if x is None else x.shape)
        for shape, x in zip(shapes, saved)
    )
    return list(rule.backward(xp, saved, grads, in_shapes, **node.kwargs))


def execute(plan: Plan, seed: int = 0) -> list[np.ndarray | None]:
    """Values of every plan tensor after running all nodes in order (None for
    a tensor no node writes that is not an input)."""
    values: list[np.ndarray | None] = [None] * len(plan.tensors)
    full: dict[int, np.ndarray] = {}
    for i, prod in enumerate(plan.producers()):
        t = plan.tensors[i]
        logical = plan.logical[t.tid]
        if prod >= 0 or logical.kind not in INPUT_KINDS:
            continue
        if not t.is_whole():
            raise ExecutionError(f"input {logical.name} on rank {t.rank} claims parts {t.parts}; "
                                 "inputs are loaded whole")
        if t.tid not in full:
            full[t.tid] = input_value(logical, seed)
        values[i] = full[t.tid][_slice(t)]
    xp = NumericXP()
    for node in plan.nodes:
        args = []
        collective = get_op(node.op).group
        for i in node.inputs:
            if i >= 0 and values[i] is None:
                t = plan.tensors[i]
                raise ExecutionError(
                    f"{describe(plan, node)} reads {plan.logical[t.tid].name} (rank {t.rank} "
                    f"mb {t.mb} v{t.version}), which no earlier node writes"
                )
            if i >= 0 and not collective and plan.tensors[i].rank != node.rank:
                t = plan.tensors[i]
                raise ExecutionError(
                    f"{describe(plan, node)} reads {plan.logical[t.tid].name} of rank {t.rank} "
                    f"without communication"
                )
            args.append(values[i] if i >= 0 else None)
        shapes = [plan.tensors[o].shape if o >= 0 else None for o in node.outputs]
        outs = run_node(xp, node, args, shapes)
        for o, value in zip(node.outputs, outs):
            if o < 0:
                continue
            if plan.tensors[o].rank != node.rank:
                raise ExecutionError(f"{describe(plan, node)} writes a tensor of rank "
                                     f"{plan.tensors[o].rank}")
            if value is None or tuple(np.shape(value)) != plan.tensors[o].shape:
                got = None if value is None else tuple(np.shape(value))
                raise ExecutionError(
                    f"{describe(plan, node)} wrote shape {got}, plan says {plan.tensors[o].shape}"
                )
            values[o] = np.asarray(value, dtype=float)
    return values


def describe(plan: Plan, node: Node) -> str:
    return f"node {node.op} ({node.dir}, {node.name}) on rank {node.rank} mb {node.mb}"


def final_values(plan: Plan, values: list) -> dict[int, np.ndarray]:
    """Loss and final gradient buffers of a single-device plan, by logical tid."""
    last: dict[int, tuple[int, int]] = {}
    for i, t in enumerate(plan.tensors):
        if t.tid not in last or t.version > last[t.tid][0]:
            last[t.tid] = (t.version, i)
    wanted = [plan.loss, *plan.grads.values()]
    return {tid: values[last[tid][1]] for tid in wanted}
