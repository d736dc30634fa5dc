"""The data-parallel axis of a parameter's mesh dim is read off the mesh's
ranks, not its name (backends/torch/tracer/record.py, ``data_parallel_axis``;
docs/soundness.md, "Plans traced from PyTorch", 11). Each case runs in a
child process: a fake process group per rank of an 8-rank (pp 1, dp 4,
tp 2) mesh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from backends.torch.tracer.record import data_parallel_axis
rank = int(sys.argv[1])
dist.init_process_group("fake", rank=rank, world_size=8, store=FakeStore())
mesh = init_device_mesh("cpu", (1, 4, 2), mesh_dim_names=("pp", "dp", "tp"))
layout = (1, 4, 2)
out = {}
hsdp = mesh._unflatten("dp", (2, 2), ("dp_replicate", "dp_shard"))
two = hsdp["dp_replicate", "dp_shard"]
split = {}
out["hsdp"] = [data_parallel_axis(two, 0, layout, split), data_parallel_axis(two, 1, layout, split)]
out["split"] = split.get("dps")
# the same ranks named the other way round: the names do not matter
swapped = mesh._unflatten("dp", (2, 2), ("dp_shard", "dp_replicate"))["dp_shard", "dp_replicate"]
out["swapped"] = [data_parallel_axis(swapped, 0, layout, {}), data_parallel_axis(swapped, 1, layout, {})]
out["dp"] = data_parallel_axis(mesh["dp"], 0, layout, {})
out["tp"] = data_parallel_axis(mesh["tp"], 0, layout, {})
out["rank"] = dist.get_rank()
print(json.dumps(out))
"""


def _axes(rank: int) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(rank)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_hsdp_mesh_dims_are_read_from_their_ranks() -> None:
    got = _axes(3)  # dp coordinate 1 (replica 0, shard 1), tp coordinate 1
    assert got["hsdp"] == ["dpr", "dps"] and got["split"] == 2
    assert got["swapped"] == ["dpr", "dps"]
    assert got["dp"] == "dp"
    assert got["tp"] is None  # not data-parallel: the name decides
