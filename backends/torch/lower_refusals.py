"""What a refused read of a value the lowering keeps pending is, in words:
the op that reads it, what the value is and why it has no plan value, for
the one-line message of ``LoweringError`` (never a generic fall-through)."""

from __future__ import annotations

from typing import Any

#: a pending value's class -> (what it is, why an arbitrary op cannot read it)
WHAT = {
    "_Ids": ("the batch's integer ids", "ids are one-hot rows in a plan: only lookups, "
             "comparisons, losses and the index ops lowered for ids read them"),
    "_IdRows": ("integer ids the model cut, padded or masked", "ids are one-hot rows in a plan"),
    "_IdsTest": ("a comparison of the batch's ids", "only a vocabulary-parallel lookup's "
                 "masking reads it"),
    "_VocabMask": ("a vocabulary-parallel lookup's mask", "only the lookup's masking reads it"),
    "_Shifted": ("ids shifted to a table shard's rows", "only the shard's lookup reads them"),
    "_Compare": ("a comparison of a computed tensor with a number", "only where(cmp, x, 0) "
                 "reads it"),
    "_NormIsZero": ("a norm compared with 0", "only the norm's backward guard reads it"),
    "_Gathered": ("an all-gather along dim 0", "read as the gathered tensor"),
    "_Stacked": ("a buffer split for a reduce-scatter", "only the reduce-scatter reads it"),
    "_Packed": ("FSDP's all-gather input buffer", "only FSDP's all-gather reads it"),
    "_ChunkCat": ("FSDP's reduce-scatter buffer", "only FSDP's reduce-scatter and copy-out "
                  "read it"),
    "_Padding": ("FSDP2's padded shard", "no lowering reads the padding"),
    "_Unpadded": ("an FSDP2 parameter gathered from padded shards", "read as its rows"),
    "_NormStack": ("a stack of gradient norms", "only a norm, a power or an all-reduce of it "
                   "is lowered"),
    "_Decayed": ("AdamW's decayed parameter", "only the optimizer step reads it"),
    "_Moment1": ("Adam's first moment", "only the optimizer step reads it"),
    "_Moment2": ("Adam's second moment", "only the optimizer step reads it"),
    "_Denom": ("Adam's denominator", "only the optimizer step reads it"),
    "_SgdGrad": ("SGD's decayed gradient", "only the optimizer step reads it"),
    "_Scaled": ("a scaled optimizer state", "only the optimizer step reads it"),
}


def refusal(lw: Any, x: Any) -> str:
    """The message for op of the current event reading pending value ``x``."""
    events = lw.trace.get("events", [])
    op = events[lw.event][0] if 0 <= lw.event < len(events) else "an op"
    what, why = WHAT.get(type(x).__name__, (f"a pending {type(x).__name__.strip('_')} value",
                                            "no lowering of that op reads it"))
    return f"{lw.name or 'top level'}: {op} reads {what}, which it does not lower ({why})"
