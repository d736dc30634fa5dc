"""A composite family (a text model beside a vision or audio tower) given as
``--hf``: the causal LM of its text model, with a one-line note.

The backend builds text-only causal LMs: ids in, a loss out. A composite
family's configuration names its text model's own type (``text_config``'s
``model_type``: ``gemma3_text`` for ``gemma3``). When that type is itself a
causal-LM family of transformers, ``--hf FAMILY`` builds it, and says so
on one line (stderr): either the family's causal-LM class is its text
model already (``Qwen3_5ForCausalLM`` is built from the text
configuration: nothing of a tower in it), or its class joins a tower to
the text model (``Gemma3ForConditionalGeneration``), and the tower is left
out: with ids alone, as the backend feeds them, no tower runs. A composite
family whose text model is not a causal-LM family stays refused
(``hf.refusal``).
"""

from __future__ import annotations

import inspect
from typing import Any


def towers(default: Any) -> tuple[str, ...]:
    """The parts of a composite configuration: its ``sub_configs`` when one
    of them is a text, vision or audio model (else none)."""
    subs = tuple(getattr(default, "sub_configs", None) or ())
    return subs if any(n == "text_config" or "vision" in n or "audio" in n for n in subs) else ()


def text_family(family: str, default: Any, model_cls: type, families: list[str]) -> tuple[str, str] | None:
    """(the text model's family, the note) for a composite ``family`` whose
    text model is a causal-LM family; None otherwise."""
    parts = towers(default)
    others = [p for p in parts if p != "text_config"]
    text = getattr(getattr(default, "text_config", None), "model_type", None)
    if not others or text is None or text == family or text not in families \
            or "labels" not in inspect.signature(model_cls.forward).parameters:
        return None  # no tower to leave out, or no training step (a drafter): refused as before
    own = _config_class(model_cls)
    if own is not None and own is type(default.text_config):
        how = (f"its causal LM {model_cls.__name__} is built from its text configuration "
               f"(no tower in it)")
    else:
        how = (f"{model_cls.__name__} joins the text model to its {', '.join(others)}, left "
               f"out (the backend feeds ids only)")
    return text, f"--hf {family}: a composite model ({', '.join(parts)}); built as its text " \
                 f"model '{text}': {how}"


def _config_class(model_cls: type) -> type | None:
    """The configuration class a causal-LM class is built from (its
    ``config_class``, else its ``config`` annotation)."""
    own = getattr(model_cls, "config_class", None)
    if isinstance(own, type):
        return own
    hint = inspect.get_annotations(model_cls, eval_str=False).get("config")
    return hint if isinstance(hint, type) else None
