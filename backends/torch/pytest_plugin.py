"""pytest support: prove a parallelization in a test, fail with the diagnosis.

    from backends.torch.pytest_plugin import assert_equivalent

    def test_tensor_parallel_mlp():
        assert_equivalent("mypkg.model:build", "mypkg.parallel:apply_tp", mesh="dp=2,tp=2")

Installed with the package, this module is also a pytest plugin (entry
point ``pytest11``): it gives tests the fixture ``verdict_equivalent``, the
same function. A test that fails prints the verdict's diagnosis (tensor,
module, operator, ranks, the relation that fails, the counterexample's
values) as its message, without a traceback; ``Result.report`` has the
full dump. Arguments are those of ``backends.torch.api.verify``.
"""

from __future__ import annotations

from typing import Any

import pytest


def assert_equivalent(model: Any, parallelize: Any, mesh: Any = None, batch: int = 4,
                      **options: Any):
    """``backends.torch.api.verify(...)``; fails the test unless equivalent.
    The Result, for more checks."""
    from backends.torch.api import verify

    result = verify(model, parallelize, mesh, batch, **options)
    if not result:
        pytest.fail(f"parallelization not proved equivalent ({result.status}):\n"
                    f"{result.explain()}", pytrace=False)
    return result


@pytest.fixture
def verdict_equivalent():
    """``assert_equivalent`` as a fixture (no import needed in the test)."""
    return assert_equivalent
