"""torch's fused Adam and AdamW kernels lowered to the rule table's
``adam_step`` (``backends/torch/lowering/fused_adam.py``; docs/soundness.md,
"Plans traced from PyTorch", 135): the node's keywords reproduce what the
kernel computes, and what the node does not express is refused."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backends.torch.errors import LoweringError
from backends.torch.lowering.fused_adam import _hyper
from backends.torch.lowering.registry import handlers
from verdict.numeric import NumericXP
from verdict.ops.step import ADAM_STEP

LR, WD, BETA1, BETA2, EPS = 1e-3, 0.1, 0.9, 0.999, 1e-8


def _kernel(decoupled: bool, step: int, maximize: bool, seed: int = 0):
    """(p, g, m, v) before and after one call of the fused kernel (float64)."""
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.rand(7, generator=gen, dtype=torch.float64)
    before = [t.clone().numpy() for t in (p, g, m, v)]
    func = torch._fused_adamw_ if decoupled else torch._fused_adam_
    func([p], [g], [m], [v], [], [torch.tensor(float(step))], lr=LR, beta1=BETA1, beta2=BETA2,
         weight_decay=WD, eps=EPS, amsgrad=False, maximize=maximize)
    return before, [t.numpy() for t in (p, m, v)]


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("maximize", [False, True])
def test_kernel_is_adam_step(decoupled: bool, step: int, maximize: bool) -> None:
    (p, g, m, v), after = _kernel(decoupled, step, maximize)
    kw = _hyper(LR, BETA1, BETA2, EPS, WD, decoupled, step)
    got = ADAM_STEP.forward(NumericXP, [p, -g if maximize else g, m, v], **kw)
    for mine, theirs in zip(got, after):
        np.testing.assert_allclose(mine, theirs, rtol=1e-12, atol=1e-15)


def test_keywords_match_the_for_loop_lowering() -> None:
    """The for-loop's lowering derives the rate from ``step_size`` and the
    decay from ``keep`` (``arithmetic._addcdiv``); the fused one alike."""
    step_size = LR / (1 - BETA1 ** 1)
    keep = 1 - LR * WD
    b1 = 1.0 - (1 - BETA1)
    rate = step_size * (1 - b1 ** 1)
    kw = _hyper(LR, BETA1, BETA2, EPS, WD, True, 1)
    assert kw["lr"] == rate and kw["weight_decay"] == (1.0 - keep) / rate and kw["beta1"] == b1


def _stub(consts: dict[int, float]):
    """The least a Lowerer offers the handler: a parameter (value 10), its
    gradient (11), fresh states (12, 13) and constant step counts."""
    lw = SimpleNamespace(name="", env={1: 10, 2: 11, 3: 12, 4: 13}, params={10: "w"},
                         shapes={10: (2,), 11: (2,), 12: (2,), 13: (2,)}, nodes=[])
    lw.const = lambda a: consts.get(a[1]) if isinstance(a, tuple) else float(a)
    lw.val = lambda a: lw.env[a[1]]

    def emit(op, ins, shapes, kwargs=None, direction="fw"):
        lw.nodes.append((op, ins, kwargs))
        return [100 + len(lw.nodes) * 3 + k for k in range(len(shapes))]
    lw.emit = emit
    return lw


KW = {"lr": LR, "beta1": BETA1, "beta2": BETA2, "weight_decay": WD, "eps": EPS,
      "amsgrad": False, "maximize": False}
ARGS = ([("v", 1)], [("v", 2)], [("v", 3)], [("v", 4)], [], [("v", 5)])


def test_lowered_outputs_in_recorded_order() -> None:
    lw = _stub({5: 1.0})
    out = handlers()["aten._fused_adamw_.default"](lw, ARGS, dict(KW), [], None)
    (op, ins, kw), = lw.nodes
    assert op == "adam_step" and ins == [10, 11, 12, 13] and kw["step"] == 1
    assert out[1] == 11  # the gradient keeps its value
    assert len(out) == 4


@pytest.mark.parametrize("change, why", [
    ({"amsgrad": True}, "amsgrad"),
    ({"grad_scale": ("v", 9)}, "grad_scale"),
    ({"found_inf": ("v", 9)}, "found_inf"),
])
def test_refused_in_one_line(change: dict, why: str) -> None:
    with pytest.raises(LoweringError, match=why):
        handlers()["aten._fused_adam_.default"](_stub({5: 1.0}), ARGS, {**KW, **change}, [], None)


def test_step_count_not_constant_refused() -> None:
    with pytest.raises(LoweringError, match="step count"):
        handlers()["aten._fused_adamw_.default"](_stub({}), ARGS, dict(KW), [], None)


def test_not_a_parameter_refused() -> None:
    lw = _stub({5: 1.0})
    lw.params = {}
    with pytest.raises(LoweringError, match="not a parameter"):
        handlers()["aten._fused_adamw_.default"](lw, ARGS, dict(KW), [], None)



def test_adam_against_adamw_is_judged_not_refused() -> None:
    """An ``adam_step`` differing from a single-device one in ``decoupled``
    (and its weight decay) is aligned with it, so the stage judges it
    (docs/soundness.md, item 135 (f)); another flag or a size is not."""
    from backends.torch.tracer.align.claim import key_kwargs
    from backends.torch.tracer.align.nodes import _hyperparameters_only_differ
    adamw = {"lr": LR, "beta1": BETA1, "decoupled": True, "weight_decay": 0.1, "step": 1}
    adam = {**adamw, "decoupled": False, "weight_decay": 0.2}
    assert _hyperparameters_only_differ("adam_step", key_kwargs(adam), key_kwargs(adamw))
    assert _hyperparameters_only_differ("adam_step", key_kwargs({**adamw, "decoupled": False}),
                                        key_kwargs(adamw))
    assert not _hyperparameters_only_differ("adam_step", key_kwargs({**adam, "step": 2}),
                                            key_kwargs(adamw))
    assert not _hyperparameters_only_differ("mul", key_kwargs({"flag": True}),
                                            key_kwargs({"flag": False}))
