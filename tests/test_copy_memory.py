"""The memory of a parameter's copy written in place, followed by the
recorder (``tracer/copy_memory.py``; docs/soundness.md, "Plans traced from
PyTorch", 134): a later write into the copy's memory reaches the views bound
to it before (autograd's saved ``t(weight)``), and an in-place write of a
rank's own shard reaches what reads that memory through the registry
(FSDP2's flat shard, which its all-gathers read)."""

from __future__ import annotations

import torch
from torch.utils.module_tracker import ModuleTracker

from backends.torch.tracer.copy_memory import WrittenCopies
from backends.torch.tracer.rank import run
from backends.torch.tracer.record import Recorder

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 12, "vocab": 10, "seqlen": 4}


def test_a_write_reaches_the_views_inside_it_as_strided_views() -> None:
    buffer = torch.zeros(2, 32)
    weight = buffer.view(-1)[:64].view(8, 8)
    saved = weight.t()
    outside = torch.zeros(100)[70:80]  # another storage: never reached
    copies = WrittenCopies()
    copies.mark(weight)
    assert copies.holds(buffer) and not copies.holds(outside)
    hits = {id(h.tensor): h.view for h in copies.reached(buffer, [weight, saved, outside])}
    assert set(hits) == {id(weight), id(saved)}
    shape, stride, offset, _ = hits[id(saved)]
    assert (shape, stride, offset) == ([8, 8], [1, 8], 0)


def test_a_view_partly_inside_the_write_has_no_known_value() -> None:
    memory = torch.zeros(64)
    copies = WrittenCopies()
    copies.mark(memory)
    across = memory[24:40]
    (hit,) = copies.reached(memory[:32], [across])
    assert hit.tensor is across and hit.view is None


def test_the_copy_is_held_by_identity_across_a_new_allocation() -> None:
    # FSDP2 frees the gathered buffer (its storage resized to nothing) and
    # allocates it again for the backward: the same storage, another address
    t = torch.zeros(16)
    copies = WrittenCopies()
    copies.mark(t)
    storage = t.untyped_storage()
    storage.resize_(0)
    storage.resize_(16 * t.element_size())
    assert copies.holds(t)


def test_an_in_place_write_of_a_held_shard_reaches_its_registered_memory() -> None:
    rec = Recorder(ModuleTracker())
    shard = torch.randn(4, 8)
    v = rec.new_value(shard)
    rec.register_storage(shard, v, shard=True)
    flat = shard.view(-1)  # made before recording: read through the registry
    with rec:
        shard.clamp_(-0.2, 0.2)
        flat.mul(2.0)
    clamped = next(e for e in rec.events if e[0] == "aten.clamp_.default")[2][0]
    read = next(e for e in rec.events if e[0] == "aten.view.default")
    assert read[1][0][0] == ("v", clamped), "the flat shard is read clamped"


def _fsdp_rank0(model: str) -> dict:
    spec = {"model": model, "model_kwargs": SIZES, "recipe": "backends.torch.stock_recipes:fsdp",
            "dp": 2, "tp": 1, "pp": 1, "batch": 4, "seqlen": SIZES["seqlen"],
            "vocab": SIZES["vocab"], "seed": 0, "parallel": True}
    return run(spec, 0)


def test_the_backward_reads_the_weight_gathered_again_not_the_clamped_copy() -> None:
    trace = _fsdp_rank0("tests.hash_routed_models:clipped_tagger")
    events = trace["events"]
    made = {o: e for e in events for o in e[2]}
    clamp = next(e for e in events if e[0] == "aten.clamp_.default")[2][0]
    backward_mm = [e for e in events if e[0] == "aten.mm.default" and e[4].startswith("bw:")
                   and e[4].endswith("layers.0.coefs")]
    # the product giving the gradient of the block's input reads t(t(weight))
    weights = [made[a[1]] for e in backward_mm for a in e[1][0] if made[a[1]][0] == "aten.t.default"]
    reads = {made[w[1][0][0][1]][0] for w in weights}
    assert "aten.as_strided.default" in reads, "t(weight) read from the memory gathered again"
    for w in weights:
        src = made[w[1][0][0][1]]
        if src[0] == "aten.as_strided.default":
            flat = made[src[1][0][0][1]]
            gathered = made[flat[1][0][0][1]]
            assert gathered[0] == "fsdp.split_with_sizes_copy.default" and gathered[4].startswith("bw:")
            assert clamp not in (src[1][0][0][1], flat[1][0][0][1])
