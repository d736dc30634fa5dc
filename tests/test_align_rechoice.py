"""A constant's match chosen again at a reader that matches nothing
(``tracer/align/rechoice.py``; docs/soundness.md, "Plans traced from
PyTorch", 100)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backends.torch.lowering.context import LNode
from backends.torch.tracer.align.claim import Claim, key_kwargs
from backends.torch.tracer.align.rechoice import Rechoice

NAME = "M.experts"


class _Rank(Rechoice):
    """One rank's state, as much of it as ``Rechoice`` reads."""

    def __init__(self, nodes: list[LNode], constants: dict[int, np.ndarray],
                 single: list[LNode], single_constants: dict[int, np.ndarray]) -> None:
        shapes = {v: (2, 1) for n in nodes for v in [*n.ins, *n.outs] if v >= 0}
        self.low = SimpleNamespace(constants=constants, shapes=shapes,
                                   inputs={c: ("buffer", f"const{c}") for c in constants},
                                   axes={c: [[], []] for c in constants})
        self.mb: dict[int, int] = {}
        self.split_from: dict[int, int] = {}
        self.copied: list[tuple[int, int, LNode]] = []
        self.producer = {o: n for n in nodes for o in n.outs}
        self.consumers: dict[int, list[LNode]] = {}
        for n in nodes:
            for v in n.ins:
                self.consumers.setdefault(v, []).append(n)
        by_key: dict[tuple, list[int]] = {}
        for i, n in enumerate(single):
            by_key.setdefault((n.op, n.dir, tuple(n.ins), key_kwargs(n.kwargs)), []).append(i)
        s_shapes = {v: (4, 1) for v in single_constants}
        s_shapes.update({v: (4, 1) for n in single for v in [*n.ins, *n.outs] if v >= 0})
        self.b = SimpleNamespace(s=SimpleNamespace(
            by_key=by_key, low=SimpleNamespace(nodes=single, constants=single_constants,
                                               shapes=s_shapes,
                                               inputs={v: ("buffer", f"c{v}")
                                                       for v in single_constants})))
        self.sv: dict[int, int] = {}
        self.claim: dict[int, Claim] = {}
        self.own_tid: dict[int, int] = {}
        self.matches: dict[int, list[tuple[int, Claim]]] = {}
        self.retagged: list[int] = []


def _node(op: str, ins: list[int], outs: list[int], **kwargs) -> LNode:
    return LNode(op, "fw", ins, outs, kwargs, NAME)


def _two_experts() -> tuple[list[LNode], dict[int, np.ndarray]]:
    """The single-device step: expert e's mask (constant 10 + e) expanded
    (20 + e) and multiplied with its rows (30 + e) into 40 + e."""
    single = [_node("expand", [10], [20], shape=[4, 1]), _node("mul", [30, 20], [40]),
              _node("expand", [11], [21], shape=[4, 1]), _node("mul", [31, 21], [41])]
    return single, {10: np.zeros((4, 1)), 11: np.ones((4, 1))}


def _rank(own: bool, other_reader: bool = False) -> tuple[_Rank, LNode]:
    """A rank whose mask of expert 1 (constant 1) was matched with expert
    0's (value 10), expanded (2) and read with expert 1's rows (3)."""
    single, consts = _two_experts()
    expand = _node("expand", [1], [2], shape=[2, 1])
    mul = _node("mul", [3, 2], [4])
    nodes = [expand, mul] + ([_node("neg", [1], [5])] if other_reader else [])
    r = _Rank(nodes, {1: np.ones((2, 1))}, single, consts)
    r.sv.update({1: 10, 2: 20, 3: 31})
    r.claim[1] = Claim([["dp"], []])
    if other_reader:
        r.sv[5] = 99  # a reader matched already
    if own:
        r.own_tid[1] = 7
    else:
        r.matches[1] = [(10, Claim([["dp"], []])), (11, Claim([["dp"], []]))]
    return r, mul


def test_an_input_of_its_own_is_matched_again_where_its_reader_matches() -> None:
    r, mul = _rank(own=True)
    assert r.rechosen(mul) == [3]
    assert r.sv[1] == 11 and r.sv[2] == 21
    assert r.retagged == [2]  # the constant keeps its own input's tensor


def test_a_piece_of_several_constants_is_matched_again_and_retagged() -> None:
    r, mul = _rank(own=False)
    assert r.rechosen(mul) == [3]
    assert r.sv[1] == 11 and r.retagged == [1, 2]


def test_an_input_of_its_own_another_matched_node_reads_is_left_alone() -> None:
    r, mul = _rank(own=True, other_reader=True)
    assert r.rechosen(mul) == []
    assert r.sv[1] == 10 and r.sv[2] == 20 and not r.retagged and not r.copied


def test_a_piece_another_matched_node_reads_is_copied_for_the_chain() -> None:
    """One constant for two experts' equal masks (jamba's rank 0): the
    other reader keeps the constant and its match, the chain reads a copy
    of it matched with the other mask."""
    r, mul = _rank(own=False, other_reader=True)
    expand = r.producer[2]
    assert r.rechosen(mul) == [3]
    u = expand.ins[0]
    assert u != 1 and r.sv[1] == 10 and r.sv[u] == 11 and r.sv[2] == 21
    assert np.array_equal(r.low.constants[u], r.low.constants[1])
    assert r.copied == [(1, u, expand)] and r.retagged == [2]
    assert [n.op for n in r.consumers[1]] == ["neg"] and r.consumers[u] == [expand]


def test_a_chain_value_another_matched_node_reads_is_left_alone() -> None:
    r, mul = _rank(own=False)
    r.consumers[2].append(_node("neg", [2], [6]))
    r.sv[6] = 98
    assert r.rechosen(mul) == [] and r.sv[2] == 20


def test_a_piece_is_matched_only_with_constants_it_is_a_piece_of() -> None:
    r, mul = _rank(own=False)
    r.matches[1] = [(10, Claim([["dp"], []]))]
    assert r.rechosen(mul) == []
    r.matches[1] = [(10, Claim([["dp"], []])), (11, Claim([["tp"], []]))]
    assert r.rechosen(mul) == []  # another claim: not the constant's


def test_an_input_standing_in_for_a_value_is_not_matched_again() -> None:
    r, mul = _rank(own=True)
    r.sv[1] = 50  # ``own_value``: no single-device constant
    assert r.rechosen(mul) == []


def test_mixtral_seed5_routed_to_other_token_fails_on_rank0() -> None:
    """Rank 0 dispatches its first two tokens with each other's experts at
    seed 5: its wrong mask of expert 2 equals expert 3's on rank 1's rows;
    matched again with expert 2's where the experts' mul reads it, the
    plan FAILs there (refused before)."""
    pytest.importorskip("transformers")
    from backends.torch.__main__ import parser, trace_and_build
    from main import verify
    from verdict.diagnosis import diagnose

    args = parser().parse_args(["--hf", "mixtral", "--recipe",
                                "harness.moe_bugs:routed_to_other_token", "--dp", "2",
                                "--tp", "1", "--seed", "5"])
    (plan_s, plan_p), _ = trace_and_build(args)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage"
    lead = "\n".join(diagnose(verdict, plan_s, plan_p))
    assert "module CausalLM.hf.model.layers.0.mlp.experts, operator mul" in lead
    assert "on rank 0" in lead
