"""The recorder's registered memory (backends/torch/tracer/record.py,
``Recorder.storage_view``): a tensor object that reads a parameter's memory
is that parameter only while the memory is still the parameter's."""

from __future__ import annotations

import torch

from backends.torch.tracer.record import Recorder, Tracker


def test_a_live_parameter_read_through_another_tensor_is_its_value() -> None:
    rec = Recorder(Tracker())
    p = torch.arange(6.0)
    v = rec.new_value(p)
    rec.register_storage(p, v, shard=True)
    seen = p.view(2, 3).view(6)  # another tensor object over the same memory
    w = rec.storage_view(seen)
    assert w is not None and rec.events[-1][1][0][0] == ("v", v)


def test_memory_given_up_is_no_longer_the_parameter() -> None:
    """FSDP2 frees an unsharded parameter by resizing its storage to
    nothing, and the allocator may give the address to a later tensor (an
    optimizer's step count, say): that tensor is not the parameter. The
    address handed back is simulated by moving the entry to the new
    tensor's address."""
    rec = Recorder(Tracker())
    p = torch.ones(1)
    v = rec.new_value(p)
    rec.register_storage(p, v, shard=True)
    (key, entry), = rec.storages.items()
    p.untyped_storage().resize_(0)
    later = torch.zeros(1)
    rec.storages = {(later.untyped_storage().data_ptr(), 0, 1): entry}
    rec.shard_starts = {(later.untyped_storage().data_ptr(), 0): (v, 1, entry[1])}
    assert rec.storage_view(later) is None


COALESCED = """
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager
from torch.testing._internal.distributed.fake_pg import FakeStore
from backends.torch.tracer.record import Recorder, Tracker
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
rec = Recorder(Tracker())
bucket = torch.ones(8)
rec.new_value(bucket)
mine = bucket[0:4]  # this rank's range of the bucket, written by the reduce-scatter
with rec:
    with _coalescing_manager(dist.group.WORLD, async_ops=False):
        dist.reduce_scatter_tensor(mine, bucket)
name, _, ids, shapes = rec.events[-1][:4]
assert name == "c10d.reduce_scatter_tensor_coalesced_.default", name
assert ids and shapes == [(4,)], (ids, shapes)
assert rec.value(mine) == ids[0]
print("ok")
"""


def test_a_coalesced_collective_writes_its_outputs() -> None:
    """c10d's coalesced collectives (``reduce_scatter_tensor`` inside a
    ``_coalescing_manager``, as Megatron's grad buffers run it) return only
    their work: the output buffers they write hold new values, never the
    old ones (read as they were, the step would be judged on values the
    memory no longer holds)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", COALESCED], cwd=root, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(root), "PATH": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok")


def test_a_write_through_a_detached_gradient_writes_the_gradient() -> None:
    """Megatron's clipping scales ``g.detach()`` in place
    (``dst.copy_(src * scale)``): ``g`` holds the scaled value after, as in
    the real run, not the value it was bound to before."""
    rec = Recorder(Tracker())
    g = torch.arange(4.0)
    v = rec.new_value(g)
    with rec:
        d = g.detach()
        d.copy_(d * 0.5)
    assert rec.current(g) != v and rec.current(g) == rec.current(d)
    assert torch.equal(g, torch.arange(4.0) * 0.5)
