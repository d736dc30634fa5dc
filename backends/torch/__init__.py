"""Verify real PyTorch parallelism: trace DTensor, FSDP2 and pipelining steps per rank
and lower them into plans (docs/torch-backend.md).

The backend's modules live in three rooms: ``tracer/`` (record one rank's
step, trace every rank, build and check the plans), ``lowering/`` (aten ops
given their meaning) and ``zoo/`` (models, recipes and the adapters of
torchtitan, transformers and Megatron-Core). They used to sit flat in this
package, and their old names are still written in places this package does
not control: plans record their model and recipe as module paths in their
world spec (``backends.torch.recipes:tp_sp``), users type them
(``--model backends.torch.titan:llama3_debugmodel``), and so do scripts and
tests. ``OLD_PATHS`` maps each old name to its new one, and an import hook
makes ``import backends.torch.recipes`` give the very module object
``backends.torch.zoo.recipes`` (one module, one state, private names
included), so no file is left at the old paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

#: every module moved out of this package: old name -> new name
OLD_PATHS: dict[str, str] = {
    **{f"backends.torch.{name}": f"backends.torch.tracer.{name}" for name in (
        "build", "check", "circular_pad", "exchange", "hidden_memory", "loaded", "mesh",
        "pipeline", "rank", "ranks", "record", "routing")},
    **{f"backends.torch.{name}": f"backends.torch.zoo.{name}" for name in (
        "cp_shim", "hf", "hf_moe", "loss_models", "loss_recipes", "megatron", "megatron_shim",
        "models", "moe", "recipes", "scaling_recipes", "stock_models", "stock_recipes",
        "titan", "titan_shim")},
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module of its new name, which it imports."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the old name's spec on the module: give
        # the module its own back (its name, file and loader stay its own)
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m`` with an old name
        (``python -m backends.torch.rank SPEC RANK OUT``)."""
        spec = importlib.util.find_spec(self.new)
        assert spec is not None and isinstance(spec.loader, importlib.abc.InspectLoader)
        return spec.loader.get_code(self.new)

    def is_package(self, fullname: str) -> bool:
        return False


class _OldPaths(importlib.abc.MetaPathFinder):
    """Finds the old names of ``OLD_PATHS``; every other name is left to the
    other finders (a module added later at ``backends/torch/NAME.py`` imports
    as any file does)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = OLD_PATHS.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


if not any(type(finder).__name__ == _OldPaths.__name__ for finder in sys.meta_path):
    sys.meta_path.append(_OldPaths())
