"""An all-to-all from a rank that sends no row while it receives some
(backends/torch/tracer/empty_sends.py; docs/soundness.md, "Plans traced
from PyTorch", 114 a): torch's fake process group raises on it, a real
group runs it; under the recorder it runs, its output of the expected rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from backends.torch.tracer.empty_sends import FUNCTIONAL, IN_PLACE, sends_nothing

SENDS_NOTHING = """
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.testing._internal.distributed.fake_pg import FakeStore
from backends.torch.tracer.record import Recorder, Tracker
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
group = dist.group.WORLD
nothing = torch.zeros(0, 3, requires_grad=True)
try:  # the fake group alone raises
    all_to_all_single_autograd(nothing, [0, 2], [0, 0], group)
    raise SystemExit("the fake group ran it")
except RuntimeError as e:
    assert "inputBuffer is empty" in str(e), e
rec = Recorder(Tracker())
with rec:
    got = all_to_all_single_autograd(nothing, [0, 2], [0, 0], group)
    got = torch.ops._c10d_functional.wait_tensor(got)
    got.sum().backward()  # its backward sends the 2 rows back, receives none
    out = torch.ones(2, 3)
    dist.all_to_all_single(out, torch.zeros(0, 3), [0, 2], [0, 0], group=group)
assert tuple(got.shape) == (2, 3), got.shape
assert nothing.grad is not None and tuple(nothing.grad.shape) == (0, 3)
assert torch.equal(out, torch.zeros(2, 3))
names = [e[0] for e in rec.events]
assert "_c10d_functional.all_to_all_single.default" in names, names
assert "c10d.alltoall_base_.default" in names, names
print("ok")
"""


def test_only_an_empty_input_with_rows_to_receive_is_taken() -> None:
    none, rows = torch.zeros(0, 3), torch.zeros(2, 3)
    assert sends_nothing(FUNCTIONAL, (none, [0, 2], [0, 0], "g"))
    assert not sends_nothing(FUNCTIONAL, (none, [0, 0], [0, 0], "g"))
    assert not sends_nothing(FUNCTIONAL, (rows, [0, 2], [0, 2], "g"))
    assert sends_nothing(IN_PLACE, (rows, none, "pg", [0, 2], [0, 0], -1))
    assert not sends_nothing(IN_PLACE, (rows, rows, "pg", [0, 2], [0, 2], -1))
    assert not sends_nothing("aten.add.Tensor", (none, rows))


def test_a_rank_sending_no_row_runs_under_the_recorder() -> None:
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", SENDS_NOTHING], cwd=root, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(root), "PATH": ""})
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-500:]
    assert run.stdout.strip().endswith("ok")
