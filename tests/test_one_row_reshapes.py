"""lowering: reshapes that come back to the shape they started from are
the value they started from (docs/soundness.md, "Plans traced from
PyTorch", 126 (a)). A one-row microbatch's softmax gradient squeezed and
unsqueezed by autograd (``[1, n, s, s]`` -> ``[n, s, s]`` -> back) and the
single-device one flattened and unflattened (``[b, n, s, s]`` -> ``[b n s
s]`` -> ``[b n, s, s]`` -> back) both read the value itself; a reshape to
another shape still emits its nodes."""

from __future__ import annotations

import backends.torch.lowering  # noqa: F401 (registers the handlers)
from backends.torch.lowering.context import Lowerer
from backends.torch.lowering.shapes import view_to


def _lowerer(shape: tuple[int, ...]) -> tuple[Lowerer, int]:
    lw = Lowerer({"events": [], "shapes": {}, "consts": {}, "constants": set()}, vocab=10)
    x = lw.new(shape)
    lw.env[x] = x
    return lw, x


def test_squeezed_and_unsqueezed_is_the_value() -> None:
    lw, x = _lowerer((1, 4, 4, 4))
    squeezed = lw.reshape(x, (4, 4, 4))
    assert squeezed != x
    assert view_to(lw, squeezed, (1, 4, 4, 4)) == x


def test_flattened_through_several_shapes_and_back_is_the_value() -> None:
    lw, x = _lowerer((4, 4, 4, 4))
    flat = lw.reshape(x, (256,))
    rows = lw.reshape(flat, (16, 4, 4))
    assert view_to(lw, rows, (4, 4, 4, 4)) == x


def test_a_reshape_to_another_shape_is_emitted() -> None:
    lw, x = _lowerer((4, 4, 4, 4))
    rows = lw.reshape(x, (16, 4, 4))
    before = len(lw.nodes)
    other = lw.reshape(rows, (4, 16, 4))
    assert other not in (x, rows) and len(lw.nodes) > before
    assert lw.shapes[other] == (4, 16, 4)


def test_an_op_between_reshapes_breaks_the_chain() -> None:
    lw, x = _lowerer((1, 4, 4))
    squeezed = lw.reshape(x, (4, 4))
    doubled = lw.emit("mul_scalar", [squeezed], [(4, 4)], {"value": 2.0})[0]
    back = lw.reshape(doubled, (1, 4, 4))
    assert back != x


def test_a_reshape_of_other_dims_and_back_keeps_its_nodes() -> None:
    # logits [b s, v] unflattened to [b, s, v] and viewed back: a rank's own
    # unflatten of its piece is matched with the single-device one, so it stays read
    lw, x = _lowerer((16, 16))
    rows = lw.reshape(x, (4, 4, 16))
    assert view_to(lw, rows, (16, 16)) != x


def test_an_unsqueeze_and_back_keeps_its_nodes() -> None:
    # a one-row rank's logits [s, v] unsqueezed to [1, s, v] and flattened
    # back keep their nodes, as the single-device logits [b s, v] unflattened
    # to [b, s, v] and flattened back do: the readers of both plans read the
    # reshapes (a rank reading the logits themselves matches nothing there)
    lw, x = _lowerer((4, 16))
    rows = lw.reshape(x, (1, 4, 16))
    back = lw.reshape(rows, (4, 16))
    assert back not in (x, rows) and lw.shapes[back] == (4, 16)
