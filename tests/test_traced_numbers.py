"""Numbers read from traced tensors with ``.item()`` (``tracer.numbers``):
their arithmetic stays traced, a comparison is recorded as a guard, a use
that cannot be traced is refused in one line."""

import math

import pytest
import torch

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import GUARD_EVENT, check_no_value_reads
from backends.torch.tracer.numbers import TracedNumber, TracedNumbers, UntracedNumber


def _mode(guards: list) -> TracedNumbers:
    return TracedNumbers(lambda t: True, lambda t: t.item(),
                         lambda n, name, other, taken: guards.append((name, other, taken)))


def test_item_of_traced_tensor_is_traced_number() -> None:
    g = torch.tensor([3.0, 4.0])
    with _mode([]):
        n = (g * g).sum().item()
    assert isinstance(n, TracedNumber)
    assert n.value == 25.0 and n.tensor.shape == () and n.tensor.item() == 25.0


@pytest.mark.parametrize("f", [
    lambda x: x ** 0.5, lambda x: 0.5 / (x + 1e-6), lambda x: 2 - x, lambda x: x * 3,
    lambda x: -x, lambda x: abs(-x), lambda x: 1 + x, lambda x: x / 4, lambda x: 2 ** x,
    lambda x: x - x * 0.5,
])
def test_arithmetic_keeps_the_value_and_the_tensor(f) -> None:
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    with _mode([]):
        n = (g * g).sum().item()
        r = f(n)
    assert isinstance(r, TracedNumber)
    assert r.value == pytest.approx(f(25.0))
    assert r.tensor.item() == pytest.approx(f(25.0))


def test_number_as_scalar_argument_is_its_tensor() -> None:
    g = torch.tensor([3.0, 4.0])
    with _mode([]):
        c = 0.5 / (g.norm().item() + 1e-6)
        a, b, d = g * c, c * g, g.clone().mul_(c)
        e = [g.clone()]
        torch._foreach_mul_(e, c)
    for t in (a, b, d, e[0]):
        assert torch.allclose(t, g * 0.1)


def test_comparison_is_a_guard_with_the_branch_taken() -> None:
    guards: list = []
    g = torch.tensor([3.0, 4.0])
    with _mode(guards):
        c = 0.5 / (g.norm().item() + 1e-6)
        taken = c < 1.0
        big = bool(c > 2)
    assert taken is True and big is False
    assert guards == [("lt", 1.0, True), ("gt", 2, False)]


@pytest.mark.parametrize("use", [int, round, math.floor, float, math.sqrt, math.isnan,
                                 lambda x: torch.zeros(x), lambda x: [1, 2][x],
                                 lambda x: torch.tensor([x]), lambda x: torch.tensor(x),
                                 lambda x: torch.as_tensor([x])])
def test_untraceable_use_is_refused(use) -> None:
    g = torch.tensor([3.0, 4.0])
    with _mode([]):
        n = g.norm().item()
        with pytest.raises((UntracedNumber, TypeError)) as e:
            use(n)
    assert "\n" not in str(e.value)


def test_integer_item_and_untraced_tensor_stay_plain() -> None:
    with TracedNumbers(lambda t: False, lambda t: t.item(), lambda *a: None):
        assert type(torch.tensor(2.0).item()) is float
    with _mode([]):
        assert type(torch.tensor(3).item()) is int


def test_guard_on_a_computed_number_is_refused() -> None:
    trace = {"params": {"w": (0, (2,), None)}, "constants": [],
             "events": [("aten.sum.default", [[("v", 0)], {}], [1], [()], "m", None, -1),
                        (GUARD_EVENT, [[("v", 1), "lt", 1.0, True], {}], [], [], "m", None, -1)]}
    with pytest.raises(LoweringError, match="branch on a number read with .item"):
        check_no_value_reads(trace)


def test_computed_tensor_copied_as_data_is_refused() -> None:
    g = torch.tensor([3.0, 4.0])
    with _mode([]):
        norms = [g.norm(), (2 * g).norm()]
        with pytest.raises(UntracedNumber, match="copied into a new tensor as data"):
            torch.tensor(norms)
        with pytest.raises(UntracedNumber, match="copied into a new tensor as data"):
            torch.tensor(norms[0])
        assert torch.as_tensor(norms[0]) is norms[0]  # the tensor itself, no copy
        assert torch.stack(norms).shape == (2,)
        assert g.new_tensor([1.0, 2.0]).tolist() == [1.0, 2.0]


def test_guard_collected_for_the_builder() -> None:
    events = [("aten.sum.default", [[("v", 0)], {}], [1], [()], "m", None, -1),
              (GUARD_EVENT, [[("v", 1), "lt", 1.0, True, "clip (x.py:3)"], {}], [], [], "m", None,
               -1)]
    trace = {"params": {"w": (0, (2,), None)}, "constants": [], "events": events}
    guards: list = []
    check_no_value_reads(trace, guards)
    assert guards == [(1, "lt", 1.0, True, "clip (x.py:3)")]
