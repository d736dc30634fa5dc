"""Which tests ``make test`` runs: the tests that run cases of
scripts/torch_suite.py as they are there (through
``tests/cli_pair.suite_cases``) are marked ``suite`` and deselected by
default (docs/workflow.md, "Set up and the test suite")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import runs_suite_cases  # the module pytest loaded (tests/ is on the path)

from tests.cli_pair import suite_cases, traced_and_verified


def _runs_a_case() -> None:
    suite_cases("megatron tp2 sp")


def _traces_its_own(tmp_path) -> None:
    traced_and_verified(tmp_path, "--model", "backends.torch.megatron:gpt")


def test_a_test_calling_suite_cases_is_a_suite_test() -> None:
    assert runs_suite_cases(SimpleNamespace(function=_runs_a_case))
    assert not runs_suite_cases(SimpleNamespace(function=_traces_its_own))
    assert not runs_suite_cases(SimpleNamespace())  # a doctest or another non-function item


def test_suite_tests_are_deselected_by_default_and_the_marker_is_registered(
        pytestconfig: pytest.Config) -> None:
    addopts = pytestconfig.getini("addopts")
    assert ["-m", "not suite"] in [addopts[i:i + 2] for i in range(len(addopts))]
    assert any(m.startswith("suite:") for m in pytestconfig.getini("markers"))

