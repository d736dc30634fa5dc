"""The backend's bad-input error (exit 2, one line)."""

from __future__ import annotations


class LoweringError(ValueError):
    """An op or a run the backend cannot lower: bad input, exit 2."""
