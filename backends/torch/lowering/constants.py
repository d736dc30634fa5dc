"""Constants as plan inputs (a recorded value read by value, a one-hot of
recorded ids) and the refusal of traces that read a computed value in
Python."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.read_origin import origin
from backends.torch.tracer.exchange import ANSWERED
from verdict.ops.nn import causal_positions

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

NEG_INF = float("-inf")


def constant_value(lw: Lowerer, a: Any) -> np.ndarray | None:
    """The value of a recorded constant argument (None: not a constant)."""
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
        return None
    if a[1] not in lw.trace.get("constants", ()):
        return None
    value = lw.trace.get("constvals", {}).get(a[1])
    if value is None:
        raise LoweringError(f"{lw.name}: a constant tensor too large to keep is read")
    return value


def constant_input(lw: Lowerer, value: np.ndarray) -> int:
    """The plan input holding ``value`` (one per distinct value and rank),
    named by its value."""
    array = np.ascontiguousarray(np.asarray(value, dtype=np.float64))
    if not np.all(np.isfinite(array)):
        raise LoweringError(f"{lw.name}: a constant with infinite entries is read as a tensor "
                            f"(only the causal mask pattern is lowered)")
    digest = hashlib.sha1(repr(array.shape).encode() + array.tobytes()).hexdigest()[:16]
    name = f"const.{'x'.join(map(str, array.shape)) or 'scalar'}.{digest}"
    if name not in lw.const_inputs:
        x = lw.new(array.shape)
        lw.inputs[x] = ("buffer", name)
        lw.axes[x] = [[] for _ in array.shape]
        lw.const_inputs[name] = x
        lw.const_values[x] = array
    return lw.const_inputs[name]


def one_hot_constant(lw: Lowerer, ids: np.ndarray, rows: int) -> int:
    """Constant integer ids (positions) as the one-hot input ``[..., rows]``."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise LoweringError(f"{lw.name}: constant ids outside [0, {rows}) index an embedding")
    return constant_input(lw, np.eye(rows)[ids])


def causal_fill(mask: np.ndarray, shape: tuple[int, ...]) -> bool:
    """``mask`` (True where filled), broadcast to ``shape``, marks exactly
    the keys after each query: the causal pattern of the last two dims."""
    try:
        m = np.broadcast_to(np.asarray(mask, dtype=bool), shape)
    except ValueError:
        return False
    if len(shape) < 2:
        return False
    pattern = causal_positions(shape[-2], shape[-1], 0, 0)
    return bool(np.array_equal(m, np.broadcast_to(pattern, shape)))


#: the recorder's event for ``.tolist()``, ``.numpy()``, ``np.asarray(t)`` (``record.ValueReads``)
VALUE_READ_EVENT = "python.value_read"


#: ``.item()`` of a float tensor whose number stays traced (``tracer.numbers``):
#: every use of the number is an op on the tensor, so this reads nothing
TRACED_READ_EVENT = "python.traced_read"


#: the recorder's event for a comparison of a number read with ``.item()``
#: (``tracer.numbers``): the branch the traced run took
GUARD_EVENT = "python.guard"


#: ops that hand a tensor's value to Python (``.item()``, ``bool(t)``, ``torch.equal``)
VALUE_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default",
               VALUE_READ_EVENT, GUARD_EVENT}


#: the value reads a count's comparison may meet (``bool(t)``, ``t.item()``)
COUNT_READS = ("aten._local_scalar_dense.default", "aten.is_nonzero.default")


def check_no_value_reads(trace: dict, guards: list | None = None,
                         count_reads: list | None = None) -> None:
    """Refuse a step in which Python read the value of a tensor that depends
    on the parameters or a collective (``if h.sum() > 0:``, ``.item()``):
    the trace holds one path of the program, chosen by that value, and
    other parameters may take another path, which no plan of this trace
    describes (a collective's value is not even real under the fake group).
    A value computed from the batch's ids and constants only
    (``ignore_index=int(labels[0, 0])``) is a fact of the traced step, as
    the label counts a mean divides by are, and so is the device mesh's
    own bookkeeping, and so are the answers to an all-to-all of such
    values (the token counts: exchange.py).

    A branch on a number read with ``.item()`` (a guard) is refused here
    unless ``guards`` is given: then each guard on a computed number is
    appended to it as (the number's value, the comparison, its constant,
    the branch taken, the scope), for the plan builder to match with the
    single-device step's guards or refuse (``tracer.guards.match_guards``;
    docs/soundness.md, "Plans traced from PyTorch", 69-71).

    A value read (``bool(t)``, ``.item()``) of a tensor computed from
    collectives of untainted values only (a count of kept labels
    all-reduced: ``if num_tokens > 0:``) is appended to ``count_reads``
    when given, as (the value, the scope), for the lowering to check that
    the traced branch is the real step's (``count_scales.decided``; item 85)."""
    tainted: set[int] = {v for v, _, _ in trace["params"].values()}
    # tainted only through collectives of untainted values
    reduced: set[int] = set()
    constants = set(trace.get("constants", ()))
    for at, (op, (args, kwargs), outs, _shapes, scope, *_) in enumerate(trace["events"]):
        read = _values_read([args, kwargs])
        if op == GUARD_EVENT and tainted.intersection(read):
            _, name, other, taken, *code = args
            if guards is not None:
                guards.append((read[0], name, other, taken,
                               code[0] if code else scope or "top level"))
                continue
            raise LoweringError(f"{scope or 'top level'}: a branch on a number read with .item() "
                                f"(number {name} {other}: {taken}) is not lowered: the number "
                                f"is not claimed equal to the single-device step's, so other "
                                f"inputs may take the other branch")
        if op in COUNT_READS and count_reads is not None and len(read) == 1 \
                and read[0] in reduced:
            count_reads.append((read[0], scope))
            continue
        if op in VALUE_READS and tainted.intersection(read):
            chosen = origin(trace["events"], at)
            if chosen:
                raise LoweringError(f"{scope or 'top level'}: Python reads {chosen} ({op}), "
                                    f"a routing no recorded topk gives, so the step's path "
                                    f"depends on values; data-dependent control flow is not "
                                    f"lowered")
            raise LoweringError(f"{scope or 'top level'}: Python reads the value of a computed "
                                f"tensor ({op}: .item(), .tolist(), .numpy(), bool(), an if on a "
                                f"tensor), so the "
                                f"step's path depends on values; data-dependent control flow "
                                f"is not lowered")
        if op == "aten.topk.default" and outs[1:2] and outs[1] in constants:
            tainted.update(outs[:1])  # its indices are the recorded routing (routing.py)
            continue
        if outs and set(outs) <= constants and (
                op in ANSWERED and not tainted.intersection(read)
                or not op.startswith(("c10d", "_c10d_functional"))):
            # a constant (of shapes and constants only: zeros_like(scores)),
            # or counts answered with the members' constants (exchange.py)
            continue
        if op.startswith(("c10d", "_c10d_functional")) or tainted.intersection(read):
            if tainted.intersection(read) <= reduced:
                reduced.update(outs)
            tainted.update(outs)


def _values_read(args: Any) -> list[int]:
    if isinstance(args, (list, tuple)):
        if len(args) == 2 and args[0] == "v" and isinstance(args[1], int):
            return [args[1]]
        return [v for a in args for v in _values_read(a)]
    if isinstance(args, dict):
        return [v for a in args.values() for v in _values_read(a)]
    return []
