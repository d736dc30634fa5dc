"""What a refused read of a value the lowering keeps pending is, in words:
the op that reads it, what the value is and why it has no plan value, for
the one-line message of ``LoweringError`` (never a generic fall-through).
Read by ``Pending.materialize`` (a kind with no reading of its own) and by
``Lowerer.materialize`` (a record that is not ``Pending``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: a pending kind's class name (``ir``) -> (what it is, why an arbitrary op
#: cannot read it)
WHAT = {
    "Ids": ("the batch's integer ids", "ids are one-hot rows in a plan: only lookups, "
            "comparisons, losses and the index ops lowered for ids read them"),
    "IdRows": ("integer ids the model cut, padded or masked", "ids are one-hot rows in a plan"),
    "IdsTest": ("a comparison of the batch's ids", "only a vocabulary-parallel lookup's "
                "masking reads it"),
    "VocabMask": ("a vocabulary-parallel lookup's mask", "only the lookup's masking reads it"),
    "Shifted": ("ids shifted to a table shard's rows", "only the shard's lookup reads them"),
    "Compare": ("a comparison of a computed tensor with a number", "only where(cmp, x, 0) "
                "reads it"),
    "NormIsZero": ("a norm compared with 0", "only the norm's backward guard reads it"),
    "Gathered": ("an all-gather along dim 0", "read as the gathered tensor"),
    "Stacked": ("a buffer split for a reduce-scatter", "only the reduce-scatter reads it"),
    "Packed": ("FSDP's all-gather input buffer", "only FSDP's all-gather reads it"),
    "ChunkCat": ("FSDP's reduce-scatter buffer", "only FSDP's reduce-scatter and copy-out "
                 "read it"),
    "Padding": ("FSDP2's padded shard", "no lowering reads the padding"),
    "Unpadded": ("an FSDP2 parameter gathered from padded shards", "read as its rows"),
    "NormStack": ("a stack of gradient norms", "only a norm, a power or an all-reduce of it "
                  "is lowered"),
    "Empty": ("a tensor of no entries", "only a cat (which leaves it out), a slice's "
              "backward, a slice_scatter, an index_add or index_put of it, a product or sum over "
              "its empty dim and ops that make no entries "
              "either read one"),
    "Decayed": ("AdamW's decayed parameter", "only the optimizer step reads it"),
    "Moment1": ("Adam's first moment", "only the optimizer step reads it"),
    "Moment2": ("Adam's second moment", "only the optimizer step reads it"),
    "Denom": ("Adam's denominator", "only the optimizer step reads it"),
    "SgdGrad": ("SGD's decayed gradient", "only the optimizer step reads it"),
    "Scaled": ("a scaled optimizer state", "only the optimizer step reads it"),
}


def refusal(lw: Lowerer, x: Any) -> str:
    """The message for the op of the current event reading pending value ``x``."""
    events = lw.trace.get("events", [])
    op = events[lw.event][0] if 0 <= lw.event < len(events) else "an op"
    what, why = WHAT.get(type(x).__name__.strip("_"),
                         (f"a pending {type(x).__name__.strip('_')} value",
                          "no lowering of that op reads it"))
    return f"{lw.name or 'top level'}: {op} reads {what}, which it does not lower ({why})"
