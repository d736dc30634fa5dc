"""An op that writes in place and returns nothing has its schema's mutable
arguments recorded as written (``backends/torch/tracer/tensor_views.py``
``outputs_written``; docs/soundness.md, "Plans traced from PyTorch", 129 (d))."""

from __future__ import annotations

import torch

from backends.torch.tracer.tensor_views import outputs_written


def test_fused_adamw_writes_its_lists():
    params, grads, avgs, sqs = ([torch.zeros(2)] for _ in range(4))
    steps = [torch.zeros(())]
    func = torch.ops.aten._fused_adamw_.default
    args = (params, grads, avgs, sqs, [], steps)
    kwargs = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.1, "eps": 1e-8,
              "amsgrad": False, "maximize": False}
    out = func(*args, **kwargs)
    written = outputs_written(func.name(), args, kwargs, out, func)
    ids = {id(t) for t in written}
    assert {id(params[0]), id(avgs[0]), id(sqs[0])} <= ids
    assert id(steps[0]) not in ids  # read only


def test_returned_tensors_unchanged():
    x = torch.ones(2)
    func = torch.ops.aten.mul_.Tensor
    out = func(x, x)
    assert outputs_written(func.name(), (x, x), {}, out, func) == [out]
