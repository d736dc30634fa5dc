"""torch.fx model -> forward part of the logical graph.

The model is traced symbolically (torch.fx), then each fx node is lowered to
an operator of the rule table by a table of lowering rules keyed by the fx
target. Shapes come from the rule table's shape rules, not from running
torch, so a model on the meta device traces without memory.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from gen_model import leaf
from gen_model.graph import LogicalGraph, Value
from verdict.ops import ShapeError


class TraceError(ValueError):
    """A model construct the tracer has no operator for."""


def _is_value(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(i, int) for i in x)


class _Lowering:
    """Walks an fx graph, emitting logical ops into a LogicalGraph."""

    def __init__(self, model: nn.Module, graph: LogicalGraph, inputs: dict):
        self.model = model
        self.g = graph
        self.input_specs = inputs
        self.env: dict[str, Any] = {}
        self.attrs: dict[str, int] = {}
        self.params = {name for name, _ in model.named_parameters()}

    # -- values -------------------------------------------------------------
    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return self.env[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        return a

    def attr(self, target: str) -> Value:
        if target not in self.attrs:
            t = self.model.get_parameter(target) if target in self.params else None
            if t is None:
                t = self.model.get_buffer(target)
            kind = "param" if target in self.params else "buffer"
            self.attrs[target] = self.g.new_tensor(target, t.shape, kind, kind == "param")
        return (self.attrs[target], 0)

    def emit(self, op: str, inputs: list[Value], kwargs: dict, name: str):
        lop = self.g.add_op(op, "fw", inputs, kwargs, name)
        return lop.outputs[0] if len(lop.outputs) == 1 else lop.outputs

    # -- nodes --------------------------------------------------------------
    def run(self, gm: torch.fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.target not in self.input_specs and node.args:
                self.env[node.name] = node.args[0]  # an optional argument left at its default
            elif node.op == "placeholder":
                shape, kind = self.input_specs[node.target]
                tid = self.g.new_tensor(node.target, shape, kind)
                self.g.inputs[node.target] = tid
                self.env[node.name] = (tid, 0)
            elif node.op == "get_attr":
                self.env[node.name] = self.attr(node.target)
            elif node.op == "output":
                loss = self.arg(node.args[0])
                if not _is_value(loss) or self.g.shape(loss[0]) != ():
                    raise TraceError("the model must return a scalar loss")
                self.g.loss = loss[0]
                self.g.tensors[loss[0]] = self.g.tensors[loss[0]]._replace(kind="loss")
            else:
                self.env[node.name] = self.lower(node, gm)

    def scope(self, node: torch.fx.Node) -> str:
        stack = node.meta.get("nn_module_stack")
        if node.op == "call_module":
            return str(node.target)
        if stack:
            return f"{list(stack)[-1]}.{node.name}"
        return node.name

    def lower(self, node: torch.fx.Node, gm: torch.fx.GraphModule):
        name = self.scope(node)
        args = [self.arg(a) for a in node.args]
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        try:
            if node.op == "call_module":
                return self.lower_module(gm.get_submodule(node.target), node.target, args, name)
            key = node.target if node.op == "call_function" else f"method:{node.target}"
            rule = LOWERINGS.get(key)
            if rule is None:
                raise TraceError(f"no operator for {node.op} {node.target} at {name}")
            return rule(self, args, kwargs, name)
        except ShapeError as e:
            raise TraceError(f"{name}: {e}") from None

    def lower_module(self, mod: nn.Module, target: str, args, name: str):
        if isinstance(mod, nn.Linear):
            if mod.bias is not None:
                raise TraceError(f"{name}: linear layers with bias are not supported")
            return self.emit("linear", [args[0], self.attr(f"{target}.weight")], {}, name)
        if isinstance(mod, nn.Embedding):
            x = args[0]
            if self.g.tensors[x[0]].kind != "tokens":
                raise TraceError(f"{name}: embedding input must be a 'tokens' model input")
            return self.emit("embedding", [x, self.attr(f"{target}.weight")], {}, name)
        raise TraceError(f"{name}: module {type(mod).__name__} is not a leaf the tracer knows")


Lower = Callable[[_Lowering, list, dict, str], Any]


def _arith(tensor_op: str | None, scalar_op: str, negate: bool = False) -> Lower:
    def lower(t: _Lowering, args, kwargs, name):
        a, b = args[0], args[1]
        if negate and _is_value(a) and not _is_value(b):
            b = -b
        if _is_value(a) and _is_value(b) and tensor_op is not None:
            return t.emit(tensor_op, [a, b], {}, name)
        if not _is_value(a) or _is_value(b):
            raise TraceError(f"{name}: {scalar_op} of these operands is not supported")
        return t.emit(scalar_op, [a], {"value": float(b)}, name)

    return lower


def _radd_mul(tensor_op: str, scalar_op: str) -> Lower:
    inner = _arith(tensor_op, scalar_op)

    def lower(t: _Lowering, args, kwargs, name):
        a, b = args[0], args[1]
        if not _is_value(a) and _is_value(b):
            a, b = b, a
        return inner(t, [a, b], kwargs, name)

    return lower


def _amax(t: _Lowering, args, kwargs, name):
    dim = args[1] if len(args) > 1 else kwargs.get("dim", [])
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    dim = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if not dim:
        dim = None
    return t.emit("max", [args[0]], {"dim": dim, "keepdim": keepdim}, name)


def _numel(t: _Lowering, args, kwargs, name):
    """A tensor's element count, a constant of the graph."""
    count = 1
    for n in t.g.shape(args[0][0]):
        count *= n
    return count


def _one_hot(t: _Lowering, args, kwargs, name):
    labels, like = args[0], args[1]
    if not _is_value(labels) or t.g.tensors[labels[0]].kind != "tokens":
        raise TraceError(f"{name}: one_hot takes a 'tokens' model input (one-hot labels)")
    if t.g.shape(labels[0]) != t.g.shape(like[0]):
        raise TraceError(f"{name}: labels {t.g.shape(labels[0])} do not match "
                         f"{t.g.shape(like[0])}")
    return labels


def _pow(t: _Lowering, args, kwargs, name):
    if not _is_value(args[0]) or _is_value(args[1]):
        raise TraceError(f"{name}: only tensor ** constant is supported")
    return t.emit("pow", [args[0]], {"exponent": args[1]}, name)


def _unary(op: str) -> Lower:
    return lambda t, args, kwargs, name: t.emit(op, [args[0]], {}, name)


def _reduce(op: str) -> Lower:
    def lower(t: _Lowering, args, kwargs, name):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if isinstance(dim, tuple):
            dim = list(dim)
        return t.emit(op, [args[0]], {"dim": dim, "keepdim": keepdim}, name)

    return lower


def _softmax(t: _Lowering, args, kwargs, name):
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    return t.emit("softmax", [args[0]], {"dim": dim}, name)


def _transpose(t: _Lowering, args, kwargs, name):
    return t.emit("transpose", [args[0]], {"dim0": args[1], "dim1": args[2]}, name)


def _unflatten(t: _Lowering, args, kwargs, name):
    return t.emit("unflatten", [args[0]], {"dim": args[1], "sizes": list(args[2])}, name)


def _flatten(t: _Lowering, args, kwargs, name):
    start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
    end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
    return t.emit("flatten", [args[0]], {"start": start, "end": end}, name)


def _repeat(t: _Lowering, args, kwargs, name):
    dim = args[2] if len(args) > 2 else kwargs["dim"]
    return t.emit("repeat_interleave", [args[0]], {"repeats": int(args[1]), "dim": dim}, name)


def _einsum(t: _Lowering, args, kwargs, name):
    eq, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if len(operands) != 2:
        raise TraceError(f"{name}: einsum must have two operands")
    return t.emit("einsum", list(operands), {"eq": eq.replace(" ", "")}, name)


def _getitem(t: _Lowering, args, kwargs, name):
    seq, index = args
    if _is_value(seq) or not isinstance(index, int):
        raise TraceError(f"{name}: tensor indexing is not supported")
    return seq[index]


LOWERINGS: dict[Any, Lower] = {
    operator.add: _radd_mul("add", "add_scalar"),
    torch.add: _radd_mul("add", "add_scalar"),
    "method:add": _arith("add", "add_scalar"),
    operator.mul: _radd_mul("mul", "mul_scalar"),
    torch.mul: _radd_mul("mul", "mul_scalar"),
    "method:mul": _arith("mul", "mul_scalar"),
    operator.sub: _arith("sub", "add_scalar", negate=True),
    torch.sub: _arith("sub", "add_scalar", negate=True),
    "method:sub": _arith("sub", "add_scalar", negate=True),
    torch.exp: _unary("exp"),
    "method:exp": _unary("exp"),
    torch.log: _unary("log"),
    "method:log": _unary("log"),
    torch.amax: _amax,
    "method:amax": _amax,
    "method:detach": _unary("detach"),
    "method:numel": _numel,
    leaf.one_hot: _one_hot,
    operator.truediv: _arith(None, "div"),
    "method:div": _arith(None, "div"),
    operator.pow: _pow,
    torch.pow: _pow,
    "method:pow": _pow,
    torch.rsqrt: _unary("rsqrt"),
    "method:rsqrt": _unary("rsqrt"),
    F.silu: _unary("silu"),
    torch.matmul: lambda t, a, k, n: t.emit("matmul", [a[0], a[1]], {}, n),
    operator.matmul: lambda t, a, k, n: t.emit("matmul", [a[0], a[1]], {}, n),
    torch.softmax: _softmax,
    F.softmax: _softmax,
    "method:softmax": _softmax,
    torch.mean: _reduce("mean"),
    "method:mean": _reduce("mean"),
    torch.sum: _reduce("sum"),
    "method:sum": _reduce("sum"),
    torch.transpose: _transpose,
    "method:transpose": _transpose,
    "method:unflatten": _unflatten,
    torch.flatten: _flatten,
    "method:flatten": _flatten,
    "method:repeat_interleave": _repeat,
    torch.repeat_interleave: _repeat,
    torch.einsum: _einsum,
    operator.getitem: _getitem,
    leaf.apply_rotary_emb: lambda t, a, k, n: t.emit("apply_rotary_emb", list(a), {}, n),
    leaf.causal_mask: lambda t, a, k, n: t.emit("causal_mask", [a[0]], {}, n),
    leaf.route: lambda t, a, k, n: t.emit(
        "route", [a[0]], {"topk": int(a[1]), "capacity": int(a[2])}, n
    ),
}


def trace_forward(model: nn.Module, inputs: dict[str, tuple[tuple[int, ...], str]]) -> LogicalGraph:
    """Lower ``model.forward`` to the forward ops of a logical graph.

    ``inputs`` maps each forward argument to (shape, kind); kind 'tokens'
    is a one-hot [..., vocab] input that feeds an nn.Embedding.
    """
    gm = torch.fx.symbolic_trace(model)
    graph = LogicalGraph()
    _Lowering(model, graph, inputs).run(gm)
    return graph
