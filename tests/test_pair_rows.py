"""The facts the pair-row sums rely on are checked on the recorded picks,
never assumed (docs/soundness.md, "Plans traced from PyTorch", 54):
a token's pairs must read its own row, no token may read one expert's
value twice, two writes may not land on one row."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backends.torch.errors import LoweringError
from backends.torch.lowering.pair_rows import Assembled, add_assembled, token_rows


def _lw() -> SimpleNamespace:
    return SimpleNamespace(name="experts", shapes={7: (6, 4), 8: (6, 4)})


def test_a_tokens_pairs_read_its_own_row_at_one_offset() -> None:
    rows = Assembled((7, 8), np.array([[0, 1], [1, -1]]), np.array([[2, 2], [3, 0]]))
    assert token_rows(_lw(), rows) == (2, 2)


def test_a_pair_reading_another_tokens_row_is_refused() -> None:
    rows = Assembled((7, 8), np.array([[0, 1], [1, 0]]), np.array([[2, 3], [3, 3]]))
    with pytest.raises(LoweringError, match="other tokens"):
        token_rows(_lw(), rows)


def test_a_token_reading_one_value_twice_is_refused() -> None:
    rows = Assembled((7, 8), np.array([[1, 1], [0, 1]]), np.array([[2, 2], [3, 3]]))
    with pytest.raises(LoweringError, match="two slots"):
        token_rows(_lw(), rows)


def test_pair_rows_written_twice_at_one_row_are_refused() -> None:
    a = Assembled((7,), np.array([0, -1, 0]), np.array([1, 0, 2]))
    b = Assembled((8,), np.array([-1, 0, -1]), np.array([0, 4, 0]))
    both = add_assembled(_lw(), a, b)
    assert both.group.tolist() == [0, 1, 0] and both.index.tolist() == [1, 4, 2]
    with pytest.raises(LoweringError, match="twice"):
        add_assembled(_lw(), a, a)
