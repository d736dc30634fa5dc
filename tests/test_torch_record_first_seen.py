"""An op reading a tensor the recorder meets for the first time
(backends/torch/tracer/record.py, ``Recorder.__torch_dispatch__``): the
tensor is judged (a constant, or not) before the op is, so the op's
constant-ness does not depend on which op reads the tensor first
(docs/soundness.md, "Plans traced from PyTorch", 82)."""

from __future__ import annotations

import torch

from backends.torch.tracer.record import Recorder, Tracker


def _ops(first_read: bool) -> tuple[Recorder, torch.Tensor]:
    """A view of positions made before recording (torchtitan's ``cp_shard``
    positions, which ``DTensor.from_local`` views first), then an expand."""
    positions = torch.arange(4).view(1, 4)
    rec = Recorder(Tracker())
    with rec:
        if not first_read:
            positions.le(3)  # another op reads them first
        out = positions.view(1, 4).expand(2, 4)
    return rec, out


def test_the_first_reader_of_constant_positions_is_a_constant() -> None:
    for first_read in (True, False):
        rec, out = _ops(first_read)
        v = rec.value(out)
        assert v in rec.constants, first_read
        assert (rec.constvals[v] == torch.arange(4).expand(2, 4).numpy()).all()


def test_a_first_read_float_tensor_stays_computed() -> None:
    """A float tensor of more than one element made outside the step (data,
    a parameter not registered) is not a constant, first read or not."""
    x = torch.ones(3)
    rec = Recorder(Tracker())
    with rec:
        y = x.view(3).mul(2)
    assert rec.value(y) not in rec.constants
