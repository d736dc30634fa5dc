"""A token count broadcast from the last pipeline stage (Megatron's
``finalize_model_grads`` with ``calculate_per_token_loss`` at pipeline size
> 1; docs/soundness.md, "Plans traced from PyTorch", 102 (d)): the trace
answers the broadcast of one number with the root's, the lowering reads it
as the root's count, and a count all-reduced after it reads the broadcast
one (``lower_ranks`` lowers again until the sums settle)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from backends.torch.lowering.count_scales import _broadcast_count
from backends.torch.lowering.ir import Const
from backends.torch.lowering.mask_values import Count, Tentative
from backends.torch.lowering.walk import _count_sums
from backends.torch.tracer.exchange import Exchanges

BROADCAST = "c10d.broadcast_.default"


def _group(_pg) -> tuple[int, ...]:
    return (0, 1)


def _args(x: torch.Tensor, root: int = 1) -> tuple:
    return ([x], "pg", root, 0, False, -1)


def test_a_broadcast_number_is_answered_with_the_root_s():
    first = {rank: Exchanges(rank) for rank in (0, 1)}
    zero, count = torch.zeros((), dtype=torch.int32), torch.tensor(8, dtype=torch.int32)
    assert first[0].broadcast(BROADCAST, _args(zero), True, _group) is None
    assert first[1].broadcast(BROADCAST, _args(count), False, _group) is None
    sent = {rank: ex.sent for rank, ex in first.items()}
    again = Exchanges(0, sent)
    assert again.broadcast(BROADCAST, _args(zero), True, _group) is False  # the root's: no constant
    assert int(zero) == 8 and again.answered == [8.0] and not again.unanswered


def test_only_a_broadcast_of_one_number_is_answered():
    ex = Exchanges(0)
    assert ex.input_of(BROADCAST, _args(torch.zeros(3))) is None  # DDP's buffers: left alone
    one = torch.zeros(())
    assert ex.input_of(BROADCAST, _args(one)) is one


def _lowerer(rank: int, env: dict, counts, answers: dict | None = None):
    return SimpleNamespace(env=env, counts=counts, count_reduces=[], event=0, name="step",
                           trace={"rank": rank, "answers": answers or {},
                                  "events": [(BROADCAST, None, [9])]},
                           const=lambda a: 0.0)


def test_the_root_s_count_on_every_member():
    args = ([("v", 5)], ("pg", [0, 1]), 1)
    root = _lowerer(1, {5: Count(8)}, "collect")
    other = _lowerer(0, {5: Const(5, 0)}, "collect", {9: 8.0})
    assert _broadcast_count(root, args) == Count(8, unsummed=True, traced=8)
    assert _broadcast_count(other, args) == Count(0, unsummed=True, traced=8)
    assert (root.count_reduces, other.count_reduces) == ([((0, 1), 8)], [((0, 1), 0)])
    summed = _lowerer(0, {5: Const(5, 0)}, [8], {9: 8.0})
    assert _broadcast_count(summed, args) == Count(8, traced=8)
    unanswered = _lowerer(0, {5: Const(5, 0)}, [8])
    assert _broadcast_count(unanswered, args).held == 0  # the fake group's: the branch differs
    assert _broadcast_count(_lowerer(0, {5: 3}, "collect"), args) is None  # no count


def test_a_count_reduced_after_a_broadcast_reads_its_sum():
    """Rank 0 (non-root) all-reduces the broadcast count over its own group:
    in the pass that collects the counts it adds its share (0); lowered
    again with the broadcast's sum (``Tentative``), it adds the root's."""
    collect = [SimpleNamespace(rank=0, count_reduces=[((0, 1), 0), ((0,), 0)]),
               SimpleNamespace(rank=1, count_reduces=[((0, 1), 8), ((1,), 8)])]
    assert _count_sums(collect) == [[8, 0], [8, 8]]
    again = [SimpleNamespace(rank=0, count_reduces=[((0, 1), 0), ((0,), 8)]),
             SimpleNamespace(rank=1, count_reduces=[((0, 1), 8), ((1,), 8)])]
    assert _count_sums(again) == [[8, 8], [8, 8]]
    assert isinstance(Tentative([8]), list)
