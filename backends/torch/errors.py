"""The backend's bad-input error (exit 2, one line)."""

from __future__ import annotations


class LoweringError(ValueError):
    """An op or a run the backend cannot lower: bad input, exit 2."""


class WrongStep(LoweringError):
    """A traced step that is wrong on its face, before any proof: a rank
    computing a value no piece of the single-device one can be (more rows
    than it has), a tie of two parameters broken. A finding, exit 1, one
    line naming the rank, the module and the value."""


class AlignError(LoweringError):
    """A parallel op with no single-device counterpart."""
