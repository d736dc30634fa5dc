"""A parameter's ``_StridedShard`` placement (backends/torch/tracer/placements.py,
``dims_axes``): FSDP2 over tensor parallelism (the strided shard's factor the
tensor-parallel size already cutting the dim) is a block, axes ``[tp, dp]``;
a strided shard with no such inner cut (transformers' ``packed_colwise`` of
a fused gate/up weight: each rank holds its block of each packed half, two
ranges of the tensor) names the dim's parts first, ``["/2", "tp"]``
(docs/soundness.md, "Plans traced from PyTorch", 87), and one over a dim
another mesh dim cuts already is refused with a line saying so. Each case
runs in a child process: a fake process group per rank of a 4-rank (pp 1,
dp 2, tp 2) mesh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore
from backends.torch.tracer.placements import dims_axes
rank = int(sys.argv[1])
dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
layout = (1, 2, 2)
out = {}
# FSDP2 over TP: dim 0 cut by tp, then again by dp
fsdp_tp = DTensor.from_local(torch.zeros(2, 3), mesh, [_StridedShard(0, split_factor=2), Shard(0)],
                             run_check=False)
out["fsdp_tp"] = dims_axes(fsdp_tp, layout, {})
# packed columns over tp alone: dim 1 read as two halves, a block of each
packed = DTensor.from_local(torch.zeros(4, 8, 3), mesh["tp"], [_StridedShard(1, split_factor=2)],
                            run_check=False)
out["packed"] = dims_axes(packed, layout, {})
# packed columns with FSDP2's rows over dp: each dim its own cut
both = DTensor.from_local(torch.zeros(2, 8, 3), mesh, [Shard(0), _StridedShard(1, split_factor=2)],
                          run_check=False)
out["both"] = dims_axes(both, layout, {})
# a strided shard of a dim dp already cuts: no layout the claims name
over = DTensor.from_local(torch.zeros(4, 2, 3), mesh, [Shard(1), _StridedShard(1, split_factor=4)],
                          run_check=False)
try:
    out["over"] = dims_axes(over, layout, {})
except ValueError as e:
    out["over"] = str(e)
print(json.dumps(out))
"""


def _axes(rank: int) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(rank)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_fsdp_over_tp_is_a_block_and_packed_columns_name_their_parts() -> None:
    got = _axes(1)
    assert got["fsdp_tp"] == [["tp", "dp"], []]
    assert got["packed"] == [[], ["/2", "tp"], []]
    assert got["both"] == [["dp"], ["/2", "tp"], []]
    assert "strided shard of dim 1 in 4 parts over a dim already cut" in got["over"]
