"""A scaling the single-device step does not do, among single-device
scalings of the same value by other numbers (``tracer/align/nodes.py``
``rescales``; docs/soundness.md, "Plans traced from PyTorch", 135 (d) and
(e)): a microbatch's ``loss * 1/2`` of the backward's ones, where the
single-device step scales the ones by 0.9 and by 0.1 / classes (a smoothed
cross-entropy)."""

from __future__ import annotations

from types import SimpleNamespace

from backends.torch.lowering.context import LNode
from backends.torch.tracer.align.claim import key_kwargs, phase
from backends.torch.tracer.align.nodes import NodeMatching


def _matching(rank_readers: list[float]):
    """Single-device: ones (1) scaled by 0.9 (-> 2) and by 0.00625 (-> 3).
    Rank: its ones (11, aligned with 1) scaled by 0.5 (-> 12), then read by
    scalings by ``rank_readers``."""
    single = [LNode("mul_scalar", "fw", [1], [2], {"value": 0.9}, "bw:"),
              LNode("mul_scalar", "fw", [1], [3], {"value": 0.00625}, "bw:")]
    by_key: dict = {}
    for c, n in enumerate(single):
        by_key.setdefault((n.op, n.dir, tuple(n.ins), key_kwargs(n.kwargs)), []).append(c)
    node = LNode("mul_scalar", "fw", [11], [12], {"value": 0.5}, "bw:")
    readers = [LNode("mul_scalar", "fw", [12], [20 + k], {"value": v}, "bw:")
               for k, v in enumerate(rank_readers)]
    m = SimpleNamespace(b=SimpleNamespace(s=SimpleNamespace(low=SimpleNamespace(nodes=single),
                                                            by_key=by_key)),
                        sv={11: 1}, consumers={12: readers})
    for name in ("missed_as", "readers_missed"):
        setattr(m, name, getattr(NodeMatching, name).__get__(m))
    return m, node


def test_microbatch_share_is_a_rescale() -> None:
    m, node = _matching([0.9, 0.00625])
    assert NodeMatching.rescales(m, node, [0, 1])


def test_a_scaling_by_the_same_number_is_matched() -> None:
    m, node = _matching([0.9, 0.00625])
    node.kwargs = {"value": 0.9}
    assert not NodeMatching.rescales(m, node, [0, 1])


def test_no_reader_gained_keeps_the_candidate() -> None:
    m, node = _matching([])
    assert not NodeMatching.rescales(m, node, [0, 1])


def test_a_forward_op_run_by_autograd_is_named_in_the_backward() -> None:
    """The alignment's refusal names an op applied as itself while autograd
    runs a backward (a sum's backward expanding its gradient) as running
    in the backward, not "(fw)" (docs/soundness.md, item 135 (e))."""
    assert phase("fw", "bw:FSDPTiedCausalLM") == "in the backward"
    assert phase("fw", "TiedCausalLM.head") == "fw"
    assert phase("bw", "bw:TiedCausalLM.head") == "bw"
    assert phase("none", "tok.weight.optimizer") == "none"
