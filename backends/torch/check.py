"""Check a lowering against PyTorch: run the lowered single-device step in
float64 on the values the traced run used (parameters, buffers, constants,
the batch's ids as one-hot rows) and compare its loss and final gradients
with the ones PyTorch computed.

A lowering that is not the traced program's function shows here as a
difference, independently of the verifier (which compares two lowerings).
The trace must have been recorded with ``keep_values`` (``rank.run``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lower import Lowered
from verdict.numeric import NumericXP, run_node


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
