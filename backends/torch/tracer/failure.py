"""The one line for a rank whose step raised: where, what, and whether a
real run takes the same path.

A rank's step that raises (a recipe's plan that does not run on the model:
a shape mismatch between a split module and one left whole, a plain tensor
met by a DTensor, an in-place write into a DTensor's local view) is no step
to verify (exit 2). Its line names the innermost module of the model whose
``forward`` was running (read off the traceback), the error, and, when the
rank read no value it computed before the error (no parameter or
collective value reached Python: ``lowering.constants.
check_no_value_reads`` on the events recorded so far), that its path is
the one a real run takes: the fake process group gives every collective's
result the shape, dtype and placement a real group gives, so an error
that depends on those alone is raised by a real run (gloo) the same way
(docs/soundness.md, "Plans traced from PyTorch", 110 (c)).
"""

from __future__ import annotations

import types

import torch

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import check_no_value_reads


class StepFailed(Exception):
    """A rank's step raised; the message is its one line."""


def failing_module(tb: types.TracebackType | None, model: torch.nn.Module) -> str | None:
    """The model's innermost module whose code was running where ``tb``
    ends (``Root.path.to.module``), or None outside every module."""
    names = {id(m): n for n, m in model.named_modules()}
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    if found is None:
        return None
    return type(model).__name__ + (f".{found}" if found else "")


def read_no_computed_value(params: dict, events: list, constants: set) -> bool:
    """No event recorded so far hands Python a value computed from the
    parameters or a collective (``params``: name -> (value, ...), as a
    trace holds them)."""
    try:
        check_no_value_reads({"params": params, "events": events, "constants": constants})
    except LoweringError:
        return False
    return True


def failure_line(e: BaseException, model: torch.nn.Module, params: dict, events: list,
                 constants: set) -> str:
    """``module: Type: last line of the error`` and, when the rank read no
    computed value before it, that a real run raises it too (not said of an
    index out of range, which a kernel checks on values)."""
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    what = f"{type(e).__name__}: {text[-1] if text else ''}"
    where = failing_module(e.__traceback__, model)
    line = f"{where}: {what}" if where else what
    by_value = isinstance(e, IndexError) or "out of bounds" in what or "out of range" in what
    if not isinstance(e, LoweringError) and not by_value \
            and read_no_computed_value(params, events, constants):
        line += (" (raised on a path no computed value chose: shapes, dtypes and placements, "
                 "which a real process group gives alike, so a real run raises it too)")
    return line
