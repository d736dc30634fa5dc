"""Check a lowering against PyTorch: run the lowered single-device step in
float64 on the values the traced run used (parameters, buffers, constants,
the batch's ids as one-hot rows) and compare its loss and final gradients
with the ones PyTorch computed.

A lowering that is not the traced program's function shows here as a
difference, independently of the verifier (which compares two lowerings).
The trace must have been recorded with ``keep_values`` (``rank.run``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering import Lowered
from verdict.numeric import NumericXP, run_node
from verdict.plan import Logical, Plan, Slices


@dataclass
class LoweringCheck:
    """Loss and gradients of the lowered step next to PyTorch's."""
    loss: tuple[float, float]  # (lowered, torch)
    grads: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def differences(self, rtol: float = 1e-9, atol: float = 1e-11) -> list[str]:
        out = []
        if not np.isclose(self.loss[0], self.loss[1], rtol=rtol, atol=atol):
            out.append(f"loss {self.loss[0]!r} != torch's {self.loss[1]!r}")
        for name, (got, want) in self.grads.items():
            if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
                err = np.max(np.abs(got - want)) if got.shape == want.shape else "shape"
                out.append(f"gradient of {name} differs from torch's (max error {err})")
        return out


def input_values(low: Lowered, values: dict, vocab: int) -> dict[int, np.ndarray]:
    """The traced run's value of every input of the lowering."""
    env: dict[int, np.ndarray] = {}
    for x, (kind, name) in low.inputs.items():
        if kind == "param":
            env[x] = values["params"][name]
        elif kind == "tokens":
            ids = values["tokens" if name == "tokens" else "labels"]
            env[x] = np.eye(vocab)[ids]
        elif x in low.constants:
            env[x] = low.constants[x]
        elif name in values["buffers"]:
            env[x] = values["buffers"][name]
        else:
            raise LoweringError(f"no value for the input {name}")
    return env


def run_lowered(low: Lowered, env: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Evaluate the lowered nodes in order (float64)."""
    xp = NumericXP()
    env = dict(env)
    for node in low.nodes:
        args = [None if v < 0 else env[v] for v in node.ins]
        shapes = [None if v < 0 else low.shapes[v] for v in node.outs]
        plan_node = SimpleNamespace(op=node.op, dir=node.dir, outputs=node.outs, kwargs=node.kwargs)
        for v, value in zip(node.outs, run_node(xp, plan_node, args, shapes)):
            if v >= 0:
                env[v] = np.asarray(value, dtype=np.float64)
    return env


def check_lowering(trace: dict, low: Lowered, vocab: int) -> LoweringCheck:
    """The single-device lowering's loss and gradients against PyTorch's."""
    values = trace.get("values")
    if values is None:
        raise LoweringError("the trace kept no values (run it with keep_values)")
    env = run_lowered(low, input_values(low, values, vocab))
    loss = float(sum(env[v] for v in low.losses))
    check = LoweringCheck((loss, float(sum(values["losses"]))))
    for name, g in low.grads.items():
        want = values["grads"].get(name)
        if g is not None and want is not None:
            check.grads[name] = (env[g], want)
    return check


#: at most this many pieces are compared to name the one a rank holds instead
SEARCHED = 4096


class LoadedValueMismatch(Exception):
    """A rank holds, for an input the plan claims is a piece of a
    single-device tensor, values that are not that piece: the real step
    computes with other values than the plan's (exit 1, not a refusal)."""


def check_loaded(single: dict, traces: list[dict], plan_p: Plan) -> None:
    """Every input each rank loaded (a parameter's local shard, a module's
    buffer, its rows of the batch's tokens and labels) holds exactly the
    piece of the single-device tensor its plan tensor claims (its
    ``slices``). The claims are read from the plan, the values from the
    runs before their step: equality, not a tolerance (they are copies).
    Only a mismatch with the claimed piece is a finding: values that also
    equal another piece (zeros, a norm's ones) are no evidence of anything
    (docs/soundness.md, "Plans traced from PyTorch", 28)."""
    produced = {t for node in plan_p.nodes for t in node.outputs}
    joined = _check_joined(single, traces, plan_p, produced)
    claimed: dict[int, list[Slices]] = {}
    held = []
    for k, t in enumerate(plan_p.tensors):
        if k in produced or k in joined or t.version or t.parts[2] != 1 or t.scale != (1, 1):
            continue
        claimed.setdefault(t.tid, []).append(t.slices)
        held.append(t)
    for t in held:
        logical = plan_p.logical[t.tid]
        full = loaded_value(single, logical)
        mine = loaded_value(traces[t.rank], logical)
        if full is None or mine is None:
            continue  # a constant (its name is its value's digest) or a collective's values
        if not _equal(mine, _cut(full, t.slices)):
            raise LoadedValueMismatch(_evidence(t.rank, logical.name, mine, full, t.slices,
                                                claimed[t.tid]))


def _check_joined(single: dict, traces: list[dict], plan_p: Plan, produced: set[int]) -> set[int]:
    """A loaded strided parameter, written as the ``cat`` of its blocks
    (docs/soundness.md, "Plans traced from PyTorch", 87): the rank's whole
    local tensor equals the join of those blocks of the single-device
    tensor, in order. The blocks checked so, to be left out of the check of
    single loads."""
    joined: set[int] = set()
    for node in plan_p.nodes:
        if node.op != "cat" or not node.inputs or any(k in produced for k in node.inputs):
            continue
        loads = [plan_p.tensors[k] for k in node.inputs]
        t = loads[0]
        logical = plan_p.logical[t.tid]
        if logical.kind != "param" or any(u.tid != t.tid or u.rank != t.rank for u in loads):
            continue
        full, mine = loaded_value(single, logical), loaded_value(traces[t.rank], logical)
        if full is None or mine is None:
            continue
        want = np.concatenate([_cut(full, u.slices) for u in loads], axis=node.kwargs["dim"])
        if not _equal(mine, want):
            pieces = ", ".join(_piece(u.slices, full.shape) for u in loads)
            raise LoadedValueMismatch(f"rank {t.rank} holds values of {logical.name} that are "
                                      f"not its claimed pieces {pieces} of the single-device "
                                      f"tensor joined along dim {node.kwargs['dim']} (its "
                                      f"values before the step against the single-device "
                                      f"tensor's)")
        joined.update(node.inputs)
    return joined


def loaded_value(trace: dict, logical: Logical) -> np.ndarray | None:
    """What a run loaded for a plan input (the batch's ids one-hot, as the
    plan reads them), or None for an input no module or batch holds."""
    loaded = trace["loaded"]
    if logical.kind == "param":
        return loaded["params"].get(logical.name)
    if logical.kind == "buffer":
        return loaded["buffers"].get(logical.name)
    if logical.kind == "tokens":
        ids = trace["batch_ids"].get(logical.name)
        return None if ids is None else np.eye(logical.shape[-1], dtype=np.int8)[ids]
    return None


def _cut(full: np.ndarray, slices: Slices) -> np.ndarray:
    return full[tuple(slice(lo, hi) for lo, hi in slices)]


def _equal(mine: np.ndarray, full: np.ndarray) -> bool:
    """Equal values; a rank holding a floating-point tensor in a narrower
    type than the single-device run (a recipe's float32 copy) is compared
    with the single-device values rounded to it: rounding is no other piece
    (the verifier's arithmetic is exact either way)."""
    floats = mine.dtype.kind in "fc" and full.dtype.kind in "fc"
    if floats and mine.dtype.itemsize < full.dtype.itemsize:
        full = full.astype(mine.dtype)
    return mine.shape == full.shape and bool(np.array_equal(mine, full, equal_nan=floats))


def _evidence(rank: int, name: str, mine: np.ndarray, full: np.ndarray, want: Slices,
              others: list[Slices]) -> str:
    """One line: the rank, the input, the piece it claims and, when one is
    found among the pieces any rank claims or at the offsets of its own
    size, the piece its values are."""
    pieces = itertools.islice(_candidates(full.shape, mine.shape, others), SEARCHED)
    found = next((s for s in pieces if s != want and _equal(mine, _cut(full, s))), None)
    claim = _piece(want, full.shape)
    if found is None:
        return (f"rank {rank} holds values of {name} that are not its claimed {claim} of the "
                f"single-device tensor (nor any piece of its shape at a claimed or aligned offset)")
    return (f"rank {rank} holds {_piece(found, full.shape)} of {name}, not its claimed {claim} "
            f"(its values before the step against the single-device tensor's)")


def _candidates(full: tuple[int, ...], local: tuple[int, ...], others: list[Slices]):
    """Pieces of ``full`` of the shape ``local``: those ranks claim, then
    those at multiples of ``local`` along each dim (the usual wrong offsets),
    lazily."""
    for s in others:
        if tuple(hi - lo for lo, hi in s) == local:
            yield s
    if len(full) != len(local) or any(n > f for n, f in zip(local, full)):
        return
    for starts in itertools.product(*(range(0, f - n + 1, n or 1) for n, f in zip(local, full))):
        yield tuple((lo, lo + n) for lo, n in zip(starts, local))


def _piece(slices: Slices, shape: tuple[int, ...]) -> str:
    """``rows 4:8`` when only dim 0 is cut, else ``[4:8, 0:16]``."""
    cut = [d for d, ((lo, hi), n) in enumerate(zip(slices, shape)) if (lo, hi) != (0, n)]
    if cut == [0]:
        return f"rows {slices[0][0]}:{slices[0][1]}"
    if not cut:
        return "all"
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in slices) + "]"
