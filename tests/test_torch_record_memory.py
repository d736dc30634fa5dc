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
