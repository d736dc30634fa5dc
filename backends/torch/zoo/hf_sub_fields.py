"""Rotary fields a family's code reads off a part of its configuration
that the part no longer declares.

transformers 5 keeps a model's rotary base in the top configuration's
``rope_parameters`` (``rope_theta`` there). A family may still read it off
a part it configures apart: DBRX's attention sets ``self.rope_theta =
attn_config.rope_theta`` while ``DbrxAttentionConfig`` declares no such
field, so transformers cannot build DBRX from its own default
configuration. Such a part is given, for each such field its family's
code reads, the value the top configuration's ``rope_parameters`` holds:
the number the model's rotary embedding itself computes with. A part
that declares the field, or a field ``rope_parameters`` lacks, is left as
it is.

A part's field the default leaves None where the family's forward needs a
number (``NEEDED``: DBRX clamps its fused query-key-value projection at
``attn_config.clip_qkv`` with no guard for None, so its default raises in
``clamp``) is given the family's released value.
"""

from __future__ import annotations

import inspect
import re
from typing import Any


def declared_names(cfg_cls: type, kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with each standard name the class maps to a field it declares
    (its ``attribute_map``: DBRX's ``hidden_size`` is ``d_model``) given
    under the declared name. A configuration may copy a declared field into
    a part before transformers resolves the standard names (DBRX's
    ``ffn_config.hidden_size = self.d_model``): given under the standard
    name, the part would get the default's width."""
    aliases = getattr(cfg_cls, "attribute_map", None) or {}
    declared = set(getattr(cfg_cls, "__annotations__", {}))
    out: dict[str, Any] = {}
    for name, value in kw.items():
        real = aliases.get(name)
        out[real if real in declared and real not in kw else name] = value
    return out


#: a part's field its default leaves None that the forward reads as a number,
#: and the value the family's released checkpoints give it
NEEDED = {"clip_qkv": 8.0}


def needed_fields(source: str, part: Any) -> dict[str, Any]:
    """The ``NEEDED`` fields ``part`` declares and leaves None, where the
    family's code has no statement guarding for it (MPT's ``if
    self.clip_qkv:`` runs without one)."""
    return {f: v for f, v in NEEDED.items() if hasattr(part, f) and getattr(part, f) is None
            and not re.search(rf"^\s*if [\w.]*\b{f}\b( is not None)?\s*:", source, re.M)}


def read_fields(model_source: str, part: str) -> set[str]:
    """The fields the family's code reads off ``part`` (``attn_config.X``,
    whether through ``config.attn_config`` or a local of that name)."""
    return set(re.findall(rf"\b{re.escape(part)}\.(\w+)", model_source))


def source_of(cfg_cls: type) -> str:
    """The source of the modeling module beside ``cfg_cls``'s configuration
    module ('' when there is none)."""
    import importlib
    module = cfg_cls.__module__.replace(".configuration_", ".modeling_")
    try:
        return inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return ""


def rotary_fields(source: str, name: str, part: Any, rope: Any) -> dict[str, Any]:
    """The fields of ``rope`` (the top configuration's ``rope_parameters``)
    the code reads off the part ``name`` and the part lacks."""
    if not isinstance(rope, dict):
        return {}
    missing = {f for f in read_fields(source, name) if not hasattr(part, f)}
    return {f: rope[f] for f in sorted(missing) if f in rope}
