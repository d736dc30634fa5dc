"""Ops that make tensors of no entries (a dim of size 0).

A recorded op whose every output has a dim of size 0 computes no value:
there is no entry of it to claim, so whatever it reads it is lowered to
``ir.Empty`` of its recorded shape, emitting no node. A reader of an
``Empty`` is lowered only where its meaning does not need an entry of it: a
``cat`` leaves it out, a slice's backward of it is zeros, a
``slice_scatter`` of it writes nothing, an ``index_add`` or
``index_put`` of it adds or writes nothing, a product or a sum over
its dim of size 0 is zeros, and an op that makes no entries
either is ``Empty`` again by this rule; any other reader is refused in one
line (``refusals``). DeepSeek-V4's heavily compressed attention over fewer
tokens than one window (``new_zeros((b, 0, d))``, unsqueezed, joined to the
keys by a ``cat``) is such a chain (docs/soundness.md, "Plans traced from
PyTorch", 110 (a)).

Collectives and the optimizer's ops on the empty shards of parameters keep
their own lowering (``Lowerer.on_empty``, the collectives' handlers): a
collective of an empty input may have members that send entries. So does
an op reading a pending value (``ir.Pending``: FSDP's reduce-scatter
buffer, an all-gather not emitted yet), whose reading may emit a
collective every member of its group must emit too (a rank's empty view of
a reduce-scatter's output): the rule reads only constants and tensors of no
entries, or a lowered value for its dtype only (``new_zeros``): an op of no
entries that computes on a lowered value keeps its own lowering.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.torch.lowering.ir import Const, Empty
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: ops that communicate or move memory, whose outputs other ranks' entries
#: may fill: never lowered by this rule
COMMUNICATING = ("c10d", "_c10d_functional", "fsdp", "mem.")
#: ops that read their tensor for its dtype and device only (``x.new_zeros``)
SHAPE_ONLY = ("aten.new_", "aten.zeros_like", "aten.empty_like", "aten.ones_like",
              "aten.full_like")


def makes_nothing(lw: Lowerer, op: str, ins: list[int], out_shapes: list) -> bool:
    """The event (``op`` reading recorded values ``ins``, making outputs of
    ``out_shapes``) makes only tensors of no entries, communicates
    nothing and reads only constants and tensors of no entries, or is a
    factory that reads a lowered value for its dtype only (no parameter's
    empty shard, no pending value). An op of no entries that reads a
    computed value keeps its own lowering (an expert's rows at an empty
    index: the rules of routed rows, item 88, take them)."""
    return (bool(out_shapes) and all(0 in tuple(s) for s in out_shapes)
            and not op.startswith(COMMUNICATING)
            and (op.startswith(SHAPE_ONLY) and all(isinstance(lw.env.get(v), (int, Const, Empty))
                                                   for v in ins)
                 or all(isinstance(lw.env.get(v), (Const, Empty)) for v in ins)))


def has_no_entries(lw: Lowerer, a: Any) -> bool:
    """Recorded tensor ``a`` (``("v", id)``) was lowered to no value
    (``Empty``). A tensor of no entries lowered otherwise (an expert's rows
    at an empty index, kept by the rules of routed rows) keeps its readers'
    own lowering."""
    return (isinstance(a, tuple) and len(a) == 2 and a[0] == "v"
            and isinstance(lw.env.get(a[1]), Empty))


@refines("aten.index_add.default", "aten.index_add_.default")
def index_add_of_nothing(inner: Handler) -> Handler:
    """``x.index_add(dim, index, source)`` with an index or a source of no
    entries adds nothing: it is x (an expert that received no token adds
    its no rows back, as transformers' experts loop does)."""
    def handler(lw: Lowerer, args, kwargs, shapes, group):
        index = args[2] if len(args) > 2 else kwargs.get("index")
        source = args[3] if len(args) > 3 else kwargs.get("source")
        if has_no_entries(lw, index) or has_no_entries(lw, source):
            return lw.val(args[0])
        return inner(lw, args, kwargs, shapes, group)
    return handler


@refines("aten.index_put.default", "aten.index_put_.default")
def index_put_of_nothing(inner: Handler) -> Handler:
    """``x.index_put(indices, values, accumulate)`` with values or an index
    of no entries writes nothing: it is x (the backward of a gather of no
    rows, ``hidden_states[token_idx]`` for an expert that received no token)."""
    def handler(lw: Lowerer, args, kwargs, shapes, group):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
        values = args[2] if len(args) > 2 else kwargs.get("values")
        if has_no_entries(lw, values) or any(has_no_entries(lw, i) for i in indices or []):
            return lw.val(args[0])
        return inner(lw, args, kwargs, shapes, group)
    return handler


@refines("aten.mm.default", "aten.bmm.default", "aten.sum.dim_IntList", "aten.sum.default")
def contraction_of_nothing(inner: Handler) -> Handler:
    """A product or a sum over a dim of size 0 (a weight's gradient from
    an expert's no rows: ``grad.T @ x`` of two ``[0, n]``) is zeros of its
    shape: the sum of no terms."""
    def handler(lw: Lowerer, args, kwargs, shapes, group):
        reads = [a for a in args[:2] if isinstance(a, tuple) and len(a) == 2 and a[0] == "v"]
        out = tuple(shapes[0])
        if 0 not in out and any(has_no_entries(lw, a) for a in reads):
            return lw.emit("zeros", [], [out], {"shape": list(out)}, direction="none")[0]
        return inner(lw, args, kwargs, shapes, group)
    return handler

