"""The model's own names of parameters under a recipe's in-place wrappers
(``backends/torch/tracer/wrapper_names.py``; docs/soundness.md, "Plans
traced from PyTorch", 129)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from backends.torch.tracer.wrapper_names import named_buffers, named_parameters, own_name


def _model() -> nn.Module:
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
                                  for _ in range(2)])
    model.head = nn.Linear(2, 1)
    return model


def test_checkpoint_wrapper_components_dropped():
    model = _model()
    before = dict(model.named_parameters())
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: isinstance(m, nn.Sequential))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    after = dict(named_parameters(model))
    assert after.keys() == before.keys()
    assert all(after[n] is before[n] for n in before)
    assert {n for n, _ in named_buffers(model)} == {n for n, _ in _model().named_buffers()}


def test_compiled_module_component_dropped():
    model = _model()
    model.head = torch.compile(model.head)
    assert own_name(model, "head._orig_mod.weight") == "head.weight"
    assert "head.weight" in dict(named_parameters(model))


def test_plain_attribute_of_that_name_kept():
    """A component named like a wrapper's attribute, on a module that is no
    wrapper, is the model's own."""
    model = nn.Module()
    model.module = nn.Linear(2, 2)
    assert own_name(model, "module.weight") == "module.weight"


def test_clash_kept_as_is():
    """A stripped name that the rank already holds is not taken over."""
    model = _model()
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    wrapped = model.blocks[0]
    wrapped.register_module("clash", nn.Linear(1, 1))  # the wrapper's own
    wrapped._checkpoint_wrapped_module.register_module("clash", nn.Linear(1, 1))
    names = dict(named_parameters(model))
    assert names["blocks.0.clash.weight"] is wrapped.clash.weight
    assert "blocks.0._checkpoint_wrapped_module.clash.weight" in names
    assert names["blocks.0.0.weight"] is wrapped._checkpoint_wrapped_module[0].weight
