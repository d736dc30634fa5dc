"""Strided slices and writes through strided views
(``backends/torch/lowering/emit.py``: ``every``, ``spread``, ``put_region``;
``tracer/record.py``: ``_region``): the lowered single-device step of each
model of ``tests/strided_models.py`` computes torch's loss and gradients
(float64), and a lowering made wrong fails that comparison."""

from __future__ import annotations

import pytest

from tests.test_torch_layers import _lower_and_check, _single

MODELS = "tests.strided_models"


@pytest.mark.parametrize("name", ["interleaved_rope", "every_other_zero", "copy_into_strided",
                                  "pair_gated",
                                  "slice_scatter", "as_strided_pairs"])
def test_strided_model_lowering_matches_torch(name: str) -> None:
    _lower_and_check(_single(f"{MODELS}:{name}"))
