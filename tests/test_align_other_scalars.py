"""A rank's node aligned with the single-device node it differs from only in
float numbers (docs/soundness.md, "Plans traced from PyTorch", 91 (a)):
which kwargs count as such numbers."""

from __future__ import annotations

from backends.torch.tracer.align.claim import key_kwargs
from backends.torch.tracer.align.nodes import _floats_only_differ


def test_another_learning_rate_differs_only_in_floats():
    mine = key_kwargs({"lr": 0.002, "weight_decay": 0.1, "beta1": 0.9, "step": 1})
    theirs = key_kwargs({"lr": 0.001, "weight_decay": 0.1, "beta1": 0.9, "step": 1})
    assert _floats_only_differ(mine, theirs)


def test_an_int_a_flag_or_a_mode_is_not_a_number_to_compare():
    assert not _floats_only_differ(key_kwargs({"dim": 0}), key_kwargs({"dim": 1}))
    assert not _floats_only_differ(key_kwargs({"step": 1, "lr": 0.1}),
                                   key_kwargs({"step": 2, "lr": 0.1}))
    assert not _floats_only_differ(key_kwargs({"decoupled": True}),
                                   key_kwargs({"decoupled": False}))
    assert not _floats_only_differ(key_kwargs({"reduction": "mean"}),
                                   key_kwargs({"reduction": "sum"}))


def test_other_keys_or_equal_kwargs_do_not_match():
    assert not _floats_only_differ(key_kwargs({"lr": 0.1}), key_kwargs({"eps": 0.1}))
    assert not _floats_only_differ(key_kwargs({"lr": 0.1}), key_kwargs({"lr": 0.1}))
