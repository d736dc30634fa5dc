"""Which handler lowers which recorded op, and in what order refinements apply.

A handler turns one recorded op into lowered values::

    handler(lw, args, kwargs, out_shapes, group) -> value or list of values

``lw`` is the :class:`~backends.torch.lowering.context.Lowerer`, ``args`` and
``kwargs`` the recorded arguments (a tensor is ``("v", id)``), ``out_shapes``
the recorded outputs' shapes and ``group`` the ranks of a collective.

Two decorators fill the table, each written beside the function it registers:

- ``@lowers("aten.mm.default", ...)`` makes a function *the* handler of those
  ops. A second ``@lowers`` of the same op is refused at import.
- ``@refines("aten.where.self", ...)`` registers a *refinement*: a function
  ``refine(base) -> handler`` that takes its own cases and hands the others to
  ``base``, the op's handler as the layers before it left it. ``base=`` names
  another op whose handler to refine (``flatten`` refines ``view``);
  ``absent=`` gives the base when that op has no handler yet (a function of
  the op; by default the base is ``None``).

The layer of a refinement is the family module that registers it, and the
order of the layers is written once, in ``LAYERS``: a refinement sees every
handler of the layers before it, none of its own layer or after. The package
index imports every family once; ``handlers()`` then builds the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: ``handler(lw, args, kwargs, out_shapes, group)``; see the module docstring
Handler = Callable[..., Any]
#: ``refine(base) -> handler``
Refinement = Callable[[Handler | None], Handler]

#: the families whose refinements wrap the handlers, innermost first: a
#: family refines what the ones before it made
LAYERS = ("vocab_parallel", "masks", "count_scales", "ids", "compose", "std", "max", "argmax",
          "max_all", "slices", "norm_sums", "const_lookup", "chunk", "label_masks", "logprob_views", "scan",
          "const_index", "vocab_picks", "merged_views", "grad_buffers",
          "routing", "safe_softmax", "grouped", "permute", "counts",
          "expert_rows", "packs", "pair_combine", "param_buffers", "no_entries", "titan_ops")

_PACKAGE = "backends.torch.lowering."


@dataclass(frozen=True)
class _Refinement:
    refine: Refinement
    base: str | None
    absent: Callable[[str], Handler | None] | None


_HANDLERS: dict[str, Handler] = {}
_REFINEMENTS: dict[str, dict[str, _Refinement]] = {layer: {} for layer in LAYERS}


def lowers(*ops: str) -> Callable[[Handler], Handler]:
    """Make the decorated function the handler of ``ops``."""
    def register(handler: Handler) -> Handler:
        for op in ops:
            if op in _HANDLERS:
                raise ValueError(f"{op} is lowered twice: by {_name(_HANDLERS[op])} and "
                                 f"{_name(handler)}")
            _HANDLERS[op] = handler
        return handler
    return register


def refines(*ops: str, base: str | None = None,
            absent: Callable[[str], Handler | None] | None = None
            ) -> Callable[[Refinement], Refinement]:
    """Register ``refine(base) -> handler`` for ``ops`` in its module's layer
    (``LAYERS``). ``base``: the op whose handler is refined (default: each op
    itself); ``absent(op)``: the base when that op has no handler."""
    def register(refine: Refinement) -> Refinement:
        layer = refine.__module__.removeprefix(_PACKAGE)
        if layer not in _REFINEMENTS:
            raise ValueError(f"{_name(refine)}: {layer} is not a layer of the lowering "
                             f"(backends.torch.lowering.registry.LAYERS)")
        for op in ops:
            if op in _REFINEMENTS[layer]:
                raise ValueError(f"{op} is refined twice in the layer {layer}")
            _REFINEMENTS[layer][op] = _Refinement(refine, base, absent)
        return refine
    return register


def not_lowered(op: str, why: str = "") -> Handler:
    """A handler that refuses ``op`` in one line (``why`` ends the line)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        raise LoweringError(f"aten op {op} (at {lw.name or 'top level'}) is not lowered onto the "
                            f"rule table{why}")
    return lower


@cache
def handlers() -> dict[str, Handler]:
    """The dispatch table: each op's handler wrapped by the refinements of
    every layer in ``LAYERS`` order. Built once, after the package index
    has imported the families."""
    table = dict(_HANDLERS)
    for layer in LAYERS:
        before = dict(table)
        for op, r in _REFINEMENTS[layer].items():
            base = before.get(r.base or op)
            if base is None and r.absent is not None:
                base = r.absent(op)
            table[op] = r.refine(base)
    return table


def _name(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"
