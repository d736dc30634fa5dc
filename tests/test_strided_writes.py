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


def test_interleaved_regions_read_without_the_single_cat_match_torch(monkeypatch) -> None:
    """The regions of an ``empty`` tensor put one by one (``put_region``)
    give what their single ``cat`` gives: torch's values."""
    from backends.torch.lowering import activations
    monkeypatch.setattr(activations.Written, "interleaved", lambda self, lw: None)
    _lower_and_check(_single(f"{MODELS}:interleaved_rope"))
    _lower_and_check(_single(f"{MODELS}:pair_gated"))


def _shifted_every(real):
    return lambda lw, x, dim, start, step, count: real(lw, x, dim, (start - 1) % step, step, count)


def _shifted_region(real):
    def put(lw, x, starts, steps, block, shape=None):
        moved = [(s - 1) % k if k > 1 else s for s, k in zip(starts, steps)]
        return real(lw, x, moved, steps, block, shape)
    return put


@pytest.mark.parametrize("name, module, helper, wrong", [
    ("interleaved_rope", "slices", "every", _shifted_every),
    ("copy_into_strided", "activations", "put_region", _shifted_region),
    ("every_other_zero", "activations", "put_region", _shifted_region),
    ("slice_scatter", "slices", "put_region", _shifted_region),
])
def test_a_strided_lowering_made_wrong_fails_the_comparison(monkeypatch, name, module, helper,
                                                            wrong) -> None:
    """The comparison with PyTorch is the oracle: a strided slice or write
    moved by one position along its step does not match."""
    import importlib
    mod = importlib.import_module(f"backends.torch.lowering.{module}")
    monkeypatch.setattr(mod, helper, wrong(getattr(mod, helper)))
    with pytest.raises(AssertionError):
        _lower_and_check(_single(f"{MODELS}:{name}"))
