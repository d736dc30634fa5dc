"""Progress bars for the long phases of a large plan.

A bar shows only on a terminal and only once its phase has run for a
second, so small plans, tests and logs stay quiet.
"""

from __future__ import annotations

from collections.abc import Iterable

from tqdm import tqdm


def progress(items: Iterable | None, desc: str, total: int | None = None,
             enabled: bool | None = None) -> tqdm:
    """``items``, with a bar on stderr; ``enabled`` None means "if stderr is a
    terminal"."""
    return tqdm(items, desc=desc, total=total, disable=None if enabled is None else not enabled,
                delay=1.0, leave=False, mininterval=0.5)
