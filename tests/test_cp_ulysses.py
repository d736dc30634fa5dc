"""cp: Ulysses-style context parallelism (backends/torch/lowering/arranged.py;
docs/soundness.md, "Plans traced from PyTorch", all-to-alls of views). The
element numbers of an all-to-all of views are read as a box of the members'
bases gathered along one dim, in the order the members appear; the traced
steps (tests/cp_ulysses_models.py, tests/cp_ulysses_recipes.py) are judged
by the oracle, which trusts none of the plan's claims: the right ones
verify, the wrong ones as they ship FAIL."""

from __future__ import annotations

import numpy as np
import pytest

import verdict_cli
from backends.torch.__main__ import parser, trace_and_build
from backends.torch.lowering.arranged import Arranged, Base, is_box
from harness.oracle import judge
from main import verify

SIZES = ["--layers", "1", "--hidden", "8", "--heads", "4", "--seqlen", "8", "--vocab", "10",
         "--batch", "2"]
MODEL = "tests.cp_ulysses_models:ulysses_tagger"
#: with attention sinks, each rank its head group's (soundness.md, 101)
SINKS = "tests.cp_ulysses_models:ulysses_sink_tagger"


def _received(n: int, me: int, shape: tuple[int, ...], order: list[int]) -> Arranged:
    """What member ``me`` of ``n`` receives when every member sends member j
    its heads block j (dim 2) of a base of ``shape`` [b, s/n, H, d], the
    blocks put one after another along the sequence in ``order``."""
    h = shape[2] // n
    numbers = np.arange(np.prod(shape)).reshape(shape)
    block = numbers[:, :, me * h:(me + 1) * h]
    pos = np.concatenate([np.full(block.shape, p) for p in order], axis=1)
    flat = np.concatenate([block for _ in order], axis=1)
    return Arranged(tuple(range(n)), pos, (Base(7, (shape,) * n, flat),))


def test_blocks_of_a_base_are_boxes_or_not() -> None:
    numbers = np.arange(24).reshape(2, 3, 4)
    assert is_box(numbers[:, 1:, 2:], (2, 3, 4))
    assert not is_box(numbers[:, :, ::2], (2, 3, 4))


def test_heads_received_along_the_sequence_are_the_gather_narrowed() -> None:
    got = _received(2, 1, (2, 4, 4, 3), [0, 1])
    assert got.box() == (0, 1, (0, 1), [(0, 2), (0, 8), (2, 2), (0, 3)])


def test_blocks_in_the_wrong_order_are_the_members_gathered_in_that_order() -> None:
    got = _received(2, 0, (2, 4, 4, 3), [1, 0])
    assert got.box() == (0, 1, (1, 0), [(0, 2), (0, 8), (0, 2), (0, 3)])


def test_a_permuted_view_is_no_box_until_permuted_back() -> None:
    got = _received(2, 0, (2, 4, 4, 3), [0, 1]).permuted([0, 2, 1, 3])
    assert got.box() is None
    assert got.permuted([0, 2, 1, 3]).box() is not None


@pytest.mark.parametrize(("model", "recipe", "mesh", "right"), [
    (MODEL, "ulysses", "cp=2", True),
    (MODEL, "ulysses_list", "cp=2", True),
    ("tests.cp_ulysses_models:ulysses_tagger_sbhd", "ulysses", "cp=2", True),
    (MODEL, "ulysses_tp", "cp=2,tp=2", True),
    (MODEL, "ulysses_wrong_order", "cp=2", False),
    (MODEL, "ulysses_list_wrong_order", "cp=2", False),
    (MODEL, "ulysses_unshifted", "cp=2", False),
    (MODEL, "ulysses_averaged", "dp=2,cp=2", False),
    (SINKS, "ulysses_sinks", "cp=2", True),
    (SINKS, "ulysses_sinks", "dp=2,cp=2", True),
    (SINKS, "ulysses_sinks_first_group", "dp=2,cp=2", False),
])
def test_ulysses_steps_judged_by_the_oracle(model, recipe, mesh, right) -> None:
    args = parser().parse_args(["--model", model, "--recipe", f"tests.cp_ulysses_recipes:{recipe}",
                                "--mesh", mesh, *SIZES])
    (single, parallel), _ = trace_and_build(args)
    assert judge(single, parallel).right == right
    v = verify(single, parallel)
    assert v.success == right and v.kind != "internal", v.message


def test_heads_and_sequence_swapped_is_a_wrong_step(capsys) -> None:
    code = verdict_cli.torch(["--model", MODEL, "--recipe",
                              "tests.cp_ulysses_recipes:ulysses_swapped", "--mesh", "cp=2", *SIZES])
    assert code == 1
    assert "all_gather" in capsys.readouterr().out


def test_ulysses_sinks_dropped_fail_at_the_softmax(capsys) -> None:
    code = verdict_cli.torch(["--model", SINKS, "--recipe",
                              "tests.cp_ulysses_recipes:ulysses_sinks_dropped", "--mesh", "cp=2",
                              *SIZES])
    out = capsys.readouterr()
    assert code == 1, out.err
    assert "op='softmax'" in out.out + out.err


def test_a_split_of_a_whole_value_at_another_index_than_the_cp_index_fails(capsys) -> None:
    """Rank 1 reads piece 0 of the whole sinks: claimed as that piece
    (``split2`` at index 0; soundness.md, 130 (b)), refuted (gloo differs)."""
    code = verdict_cli.torch(["--model", SINKS, "--recipe",
                              "tests.cp_ulysses_recipes:ulysses_sinks_first_group", "--mesh",
                              "cp=2", *SIZES])
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    assert "not equivalent" in out.out + out.err
