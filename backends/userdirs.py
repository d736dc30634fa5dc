"""Where the tools write by default: a directory of the user's, not the
working directory. ``$VERDICT_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/verdict``, else ``~/.cache/verdict``; one subdirectory
per kind (``cache``: the plan and stage caches, ``stats``: stats.csv,
``logs``: --dump_* and --brief's failure dumps, ``plans``: traced plans)."""

from __future__ import annotations

import os
from pathlib import Path


def user_dir(kind: str) -> Path:
    root = os.environ.get("VERDICT_CACHE_DIR")
    if root:
        return Path(root) / kind
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "verdict" / kind
