"""Devices named in recorded op arguments (shared by the lowering families)."""

from __future__ import annotations

from typing import Any


def on_cpu(device: Any) -> bool:
    """A recorded device argument names the CPU (the ranks' device)."""
    return str(device) in ("cpu", "device(type='cpu')")
