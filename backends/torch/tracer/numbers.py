"""Python numbers read from traced tensors (``.item()``), kept traced.

``TracedNumber`` is a Python number (not a ``float``: see below) that carries a 0-dim tensor holding the
same value, computed from the tensor it was read from by tensor ops, so
the dispatch mode records its lineage. Python arithmetic on it gives
another ``TracedNumber`` whose tensor the corresponding torch op computes;
``TracedNumbers`` (a TorchFunctionMode, which sees Python arguments before
they become ``at::Scalar``) hands an op the number's tensor in place of the
number, so ``g.mul_(coeff)`` is recorded as a product with a traced 0-dim
tensor. A comparison returns the traced run's plain ``bool`` and records a
guard event (the branch taken; docs/soundness.md, "Plans traced from
PyTorch", 60-63). Uses that cannot be traced (an integer of it: a shape,
an index, a count) raise ``UntracedNumber``, a refusal, and so does a
conversion to a plain ``float`` (``float(x)``, ``math.sqrt(x)``,
``torch.tensor([x])``): the number would go on as a constant of the traced
run, its lineage lost. That is why it is no ``float`` subclass: C code reads
a float subclass's value directly, without any method of ours.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class UntracedNumber(TypeError):
    """A number read with ``.item()`` used where it cannot stay traced."""


def _tensor_of(x: Any) -> Any:
    """``x``'s tensor if it is traced, else ``x`` as it is (a Python number
    is a scalar argument of the op)."""
    return x.tensor if isinstance(x, TracedNumber) else x


#: the tensor method computing ``number op tensor``
REFLECTED = {operator.add: "__radd__", operator.sub: "__rsub__", operator.mul: "__rmul__",
             operator.truediv: "__rtruediv__", operator.pow: "__rpow__"}


def _plain(x: Any) -> float:
    return x.value if isinstance(x, TracedNumber) else float(x)


class TracedNumber:
    """A Python number read from a traced tensor: ``value`` as Python
    computed it, and the 0-dim tensor ``tensor`` holding it (its lineage).
    ``guard`` records a comparison."""

    __slots__ = ("guard", "tensor", "value")

    def __init__(self, value: float, tensor: torch.Tensor,
                 guard: Callable[[TracedNumber, str, Any, bool], None] | None = None):
        self.value = float(value)
        self.tensor = tensor
        self.guard = guard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Torch's argument parser takes an object with ``__torch_function__``
        where a tensor goes (``mul(g, other)``, ``_foreach_mul_(gs, other)``)
        and hands the call here: the op runs on the number's tensor. A tensor
        made from it as data (``torch.tensor([x])``) would copy its value
        into a constant: refused."""
        _refuse_as_data(func, args, kwargs)
        return func(*(_replace(a) for a in args),
                    **{k: _replace(v) for k, v in (kwargs or {}).items()})

    def _made(self, value: float, tensor: torch.Tensor) -> TracedNumber:
        return TracedNumber(value, tensor, self.guard)

    def _binary(self, other: Any, op: Callable[[Any, Any], Any], reflected: bool) -> Any:
        if not isinstance(other, (int, float, TracedNumber)) or isinstance(other, bool):
            return NotImplemented
        a, b = (other, self) if reflected else (self, other)
        value = op(_plain(a), _plain(b))
        ta, tb = _tensor_of(a), _tensor_of(b)
        if not isinstance(ta, torch.Tensor):  # a plain number on the left: the tensor's reflected
            return self._made(value, getattr(tb, REFLECTED[op])(ta))  # op (2 / t: reciprocal, mul)
        return self._made(value, op(ta, tb))

    def __add__(self, o: Any) -> Any: return self._binary(o, operator.add, False)
    def __radd__(self, o: Any) -> Any: return self._binary(o, operator.add, True)
    def __sub__(self, o: Any) -> Any: return self._binary(o, operator.sub, False)
    def __rsub__(self, o: Any) -> Any: return self._binary(o, operator.sub, True)
    def __mul__(self, o: Any) -> Any: return self._binary(o, operator.mul, False)
    def __rmul__(self, o: Any) -> Any: return self._binary(o, operator.mul, True)
    def __truediv__(self, o: Any) -> Any: return self._binary(o, operator.truediv, False)
    def __rtruediv__(self, o: Any) -> Any: return self._binary(o, operator.truediv, True)

    def __pow__(self, o: Any, mod: Any = None) -> Any:
        if mod is not None:
            return NotImplemented
        return self._binary(o, operator.pow, False)

    def __rpow__(self, o: Any, mod: Any = None) -> Any:
        if mod is not None:
            return NotImplemented
        return self._binary(o, operator.pow, True)

    def __neg__(self) -> TracedNumber:
        return self._made(-self.value, -self.tensor)

    def __pos__(self) -> TracedNumber:
        return self

    def __abs__(self) -> TracedNumber:
        return self._made(abs(self.value), self.tensor.abs())

    def _compare(self, other: Any, name: str, op: Callable[[Any, Any], bool]) -> Any:
        if isinstance(other, TracedNumber):
            raise UntracedNumber("two numbers read with .item() compared with each other: "
                                 "not traced")
        if not isinstance(other, (int, float)):
            return NotImplemented
        taken = op(self.value, float(other))
        if self.guard is not None:
            self.guard(self, name, other, taken)
        return taken

    def __lt__(self, o: Any) -> Any: return self._compare(o, "lt", operator.lt)
    def __le__(self, o: Any) -> Any: return self._compare(o, "le", operator.le)
    def __gt__(self, o: Any) -> Any: return self._compare(o, "gt", operator.gt)
    def __ge__(self, o: Any) -> Any: return self._compare(o, "ge", operator.ge)
    def __eq__(self, o: Any) -> Any: return self._compare(o, "eq", operator.eq)
    def __ne__(self, o: Any) -> Any: return self._compare(o, "ne", operator.ne)

    __hash__ = None  # type: ignore[assignment]  # equality records a guard

    def __bool__(self) -> bool:
        return self._compare(0.0, "ne", operator.ne)

    def _untraced(self, *_: Any) -> Any:
        raise UntracedNumber("a number read with .item() is used as an integer (a shape, an "
                             "index or a count), which is not traced")

    __int__ = __index__ = __trunc__ = __floor__ = __ceil__ = __round__ = _untraced

    def __float__(self) -> float:
        raise UntracedNumber("a number read with .item() is converted to a plain float "
                             "(float(x), math.*, torch.tensor([x])), which is not traced")

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)  # printing it reads nothing into the step


#: the functions making a tensor from Python data: they copy a number's value
DATA_FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)


def _mentions(x: Any, traced: Callable[[torch.Tensor], bool] | None = None) -> bool:
    if isinstance(x, TracedNumber):
        return True
    if isinstance(x, torch.Tensor):
        return traced is not None and traced(x)
    if isinstance(x, (list, tuple)):
        return any(_mentions(i, traced) for i in x)
    return False


def _refuse_as_data(func: Any, args: tuple, kwargs: dict,
                    traced: Callable[[torch.Tensor], bool] | None = None) -> None:
    """A tensor made from a traced number as data (``torch.tensor([x])``)
    would hold its value as a constant: refused. ``torch.as_tensor(x)`` of
    the number itself is its tensor (no copy), traced. With ``traced``
    (the mode's test of a computed tensor), a computed tensor copied as
    data (``torch.tensor([t1, t2])``, ``torch.tensor(t)``: C code reads its
    values without any op the recorder sees) is refused too; a tensor given
    whole to ``torch.as_tensor`` is that tensor (no copy)."""
    if func not in DATA_FACTORIES:
        return
    data = list(args) + list(kwargs.values())
    if func in (torch.as_tensor, torch.asarray) and args \
            and isinstance(args[0], (TracedNumber, torch.Tensor)) \
            or func is torch.Tensor.new_tensor:  # its first argument is the tensor it is of
        data = list(args[1:]) + list(kwargs.values())
    if any(_mentions(x) for x in data):
        raise UntracedNumber("a number read with .item() is made into a new tensor as data "
                             "(torch.tensor([x])), which is not traced")
    if traced is not None and any(_mentions(x, traced) for x in data):
        raise UntracedNumber("a computed tensor is copied into a new tensor as data "
                             "(torch.tensor([t, ...])), which is not traced")


def _replace(x: Any) -> Any:
    if isinstance(x, TracedNumber):
        return x.tensor
    if isinstance(x, (list, tuple)) and any(isinstance(i, TracedNumber) for i in x):
        return type(x)(_replace(i) for i in x)
    return x


class TracedNumbers(TorchFunctionMode):
    """``.item()`` of a traced tensor returns a ``TracedNumber``; a traced
    number passed to a torch op is replaced by its 0-dim tensor.
    ``traced(t)`` says whether ``t`` is a traced value (not a fake or
    untracked tensor); ``read(t)`` reads its value (as ``.item()`` does,
    recorded as a traced read); ``guard`` records a comparison."""

    def __init__(self, traced: Callable[[torch.Tensor], bool], read: Callable[[torch.Tensor], float],
                 guard: Callable[[TracedNumber, str, Any, bool], None]):
        super().__init__()
        self.traced = traced
        self.read = read
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.item and args and isinstance(args[0], torch.Tensor) \
                and args[0].is_floating_point() and self.traced(args[0]):
            t = args[0]
            return TracedNumber(self.read(t), t.reshape(()), self.guard)
        _refuse_as_data(func, args, kwargs, self.traced)
        args = tuple(_replace(a) for a in args)
        kwargs = {k: _replace(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
