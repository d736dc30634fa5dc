"""transformers' BLT with its default entropy patching is refused before
tracing, in one line that names the real cause: the patches' count and
lengths are read back from the entropies its patcher's model computes
(backends/torch/zoo/hf.py ``refusal``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from backends.torch.zoo import hf  # noqa: E402


def test_entropy_patching_is_refused_naming_the_cause() -> None:
    why = hf.refusal("blt", 1)
    assert why is not None and "patching_mode 'entropy'" in why
    assert "_local_scalar_dense" in why and "\n" not in why


def test_families_without_a_patcher_are_not_refused_for_it() -> None:
    assert hf.refusal("llama", 1) is None
