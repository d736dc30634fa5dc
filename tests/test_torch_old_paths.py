"""The backend's modules moved into rooms (tracer/, zoo/); their old names,
which plans' world specs, users' commands, scripts and docs still write, import
as the very same module objects (backends/torch/__init__.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import backends.torch as backend
from backends.torch.__main__ import parser, resolve
from backends.torch.tracer.rank import load

ROOT = Path(__file__).resolve().parent.parent


def test_every_old_name_is_its_new_module():
    for old, new in backend.OLD_PATHS.items():
        module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert sys.modules[old] is module
        assert module.__name__ == new and module.__spec__.name == new, old


def test_no_file_is_left_at_an_old_path():
    """A file there would be found before the alias and import as a second
    module of another name."""
    for old, new in backend.OLD_PATHS.items():
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old
        assert (ROOT / (new.replace(".", "/") + ".py")).exists(), new


def test_private_names_reach_through_an_old_name():
    from backends.torch.titan import _parallelism

    from backends.torch.zoo.titan import _parallelism as same
    assert _parallelism is same


def test_plan_world_spec_references_load():
    import backends.torch.zoo.recipes as recipes
    assert load("backends.torch.recipes:tp_sp") is recipes.tp_sp
    assert load("backends.torch.stock_models:gpt2") is importlib.import_module(
        "backends.torch.zoo.stock_models").gpt2


def test_user_model_and_recipe_references_resolve_and_load():
    import backends.torch.zoo.titan as titan
    args = resolve(parser().parse_args(
        ["--model", "backends.torch.titan:llama3_debugmodel",
         "--recipe", "backends.torch.titan:parallelize", "--dp", "1", "--tp", "2"]))
    assert load(args.model) is titan.llama3_debugmodel
    assert load(args.recipe) is titan.parallelize
    args = resolve(parser().parse_args(["--model", "titan:llama3_debugmodel", "--recipe", "pp_gpipe"]))
    assert load(args.model) is titan.llama3_debugmodel
    assert args.recipe == "backends.torch.recipes:pp_gpipe"


def test_other_names_are_left_to_the_other_finders():
    finder = next(f for f in sys.meta_path if type(f).__name__ == "_OldPaths")
    assert finder.find_spec("backends.torch.api") is None
    assert finder.find_spec("backends.torch.zoo.recipes") is None
    assert importlib.import_module("backends.torch.errors").__name__ == "backends.torch.errors"


def test_a_fresh_process_imports_an_old_name_first():
    code = ("import backends.torch.megatron as m, backends.torch.zoo.megatron as z, sys\n"
            "print(m is z, sum(type(f).__name__ == '_OldPaths' for f in sys.meta_path))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "1"]


def test_python_dash_m_runs_an_old_name():
    out = subprocess.run([sys.executable, "-m", "backends.torch.rank"], cwd=ROOT,
                         capture_output=True, text=True)
    assert "IndexError" in out.stderr and "No code object" not in out.stderr
