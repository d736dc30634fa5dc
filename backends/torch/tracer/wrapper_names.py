"""The model's own names of parameters and buffers that a recipe's wrappers
moved.

A recipe may wrap a submodule in place: ``apply_activation_checkpointing``
puts each block under a ``CheckpointWrapper`` (its parameters then named
``blocks.0._checkpoint_wrapped_module.ln1.weight``), a user wraps blocks in
``DistributedDataParallel`` one by one (``blocks.0.module.ln1.weight``),
``torch.compile`` puts a module under ``_orig_mod``. The wrapper holds the
very module the model built, so each parameter is the single-device
model's parameter of the name without the wrapper's component; the names
the rank's plan gives its inputs, gradients and updates are those (what
the wrapper does to the values, DDP's reduction or checkpointing's
recomputation, is traced as any other op).

A component is dropped only where the module at that path is one of the
wrappers below and the component is the attribute holding its wrapped
module; a name whose stripped form another parameter already has is kept
as it is (the alignment then refuses it by name).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _wrapped_attr(module: torch.nn.Module) -> str | None:
    """The attribute under which ``module`` holds the module it wraps, when
    it is a wrapper whose forward runs that module's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(module, ActivationWrapper):
        return "_checkpoint_wrapped_module"
    if isinstance(module, DistributedDataParallel):
        return "module"
    orig = getattr(module, "_orig_mod", None)
    if isinstance(orig, torch.nn.Module) and type(module).__name__ == "OptimizedModule":
        return "_orig_mod"
    return None


def own_name(model: torch.nn.Module, name: str) -> str:
    """``name`` (a dotted path under ``model``) without the components that
    only step into a wrapper's wrapped module."""
    parts = name.split(".")
    kept: list[str] = []
    module: torch.nn.Module | None = model
    for part in parts:
        inner = _wrapped_attr(module) if module is not None else None
        if inner is not None and part == inner:
            module = getattr(module, part)
            continue
        kept.append(part)
        module = getattr(module, part, None) if module is not None else None
        if not isinstance(module, torch.nn.Module):
            module = None
    return ".".join(kept)


def _renamed(model: torch.nn.Module, pairs: list[tuple[str, object]]) -> list[tuple[str, object]]:
    names = [n for n, _ in pairs]
    mapped = [own_name(model, n) for n in names]
    taken = set(names)
    out = []
    for (n, t), m in zip(pairs, mapped):
        clash = m != n and (m in taken or mapped.count(m) > 1)
        out.append((n if clash else m, t))
    return out


def named_parameters(model: torch.nn.Module,
                     remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` under the model's own names."""
    yield from _renamed(model, list(model.named_parameters(remove_duplicate=remove_duplicate)))


def named_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_buffers()`` under the model's own names."""
    yield from _renamed(model, list(model.named_buffers()))
