"""An all-to-all from a rank that sends no row, under the fake process group
(docs/soundness.md, "Plans traced from PyTorch", 114 a).

torch's ``FakeProcessGroup.alltoall_base`` fills each member's output slot
by repeating the rank's own input rows (it has no peer's), and raises
("inputBuffer is empty but outputSplitSizes[j] > 0") when that input has no
row while the output expects some: a rank whose experts receive no token
sends nothing back, yet receives the results of the tokens it sent. A real
group runs it. The fake group's values of an all-to-all of rows are
arbitrary in any case (the lowering gives the op its meaning from the
members' inputs, ``lowering/all_to_all.py``), so such a call is answered
here without the fake group: an output of the expected rows, zeros. The
all-to-alls of constants (the counts, ``exchange.py``) are answered from
the members' sends after this, as before.
"""

from __future__ import annotations

from typing import Any

import torch

#: the functional all-to-all (its output a new tensor): (input, output splits)
FUNCTIONAL = "_c10d_functional.all_to_all_single.default"
#: c10d's in-place all-to-all: (output, input, output splits, input splits)
IN_PLACE = "c10d.alltoall_base_.default"


def _rows(splits: Any) -> int:
    return sum(int(s) for s in splits) if splits is not None else 0


def sends_nothing(name: str, args: tuple) -> bool:
    """Whether this all-to-all's input has no row while its output expects some."""
    if name == FUNCTIONAL:
        x, out_splits = args[0], args[1]
        return x.dim() > 0 and x.shape[0] == 0 and _rows(out_splits) > 0
    if name == IN_PLACE:
        out, x = args[0], args[1]
        return x.dim() > 0 and x.shape[0] == 0 and out.shape[0] > 0
    return False


def run_sending_nothing(func: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """The op's result with its output zeros, the fake group given nothing
    to send and nothing to receive (the in-place form: its Work)."""
    if name == FUNCTIONAL:
        x, out_splits = args[0], args[1]
        return x.new_zeros((_rows(out_splits), *x.shape[1:]))
    out, x, out_splits, in_splits = args[0], args[1], args[3], args[4]
    with torch.no_grad():
        out.zero_()
    empty = out.narrow(0, 0, 0)
    zeros = [0] * len(out_splits) if len(out_splits) else []
    return func(empty, x, args[2], zeros, list(in_splits), *args[5:], **kwargs)
