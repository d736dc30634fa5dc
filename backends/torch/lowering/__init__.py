"""Lower one rank's recorded aten ops onto operators of the rule table.

The package's rooms, in the order they depend on each other:

- ``registry``: the ``@lowers`` and ``@refines`` decorators, the layer order
  of refinements (``LAYERS``) and the dispatch table they build;
- ``ir``: the pending values a handler may return instead of emitting
  nodes at once, and how each is materialized;
- ``constants``, ``emit``, ``shapes``, ``onehot``, ``fills``, ``attention``,
  ``refusals``, ``bucket_pieces``, ``uneven_shards``: helpers the families share;
- ``context``: the ``Lowerer`` every handler receives, and the lowered
  records (``LNode``, ``Lowered``);
- one module per family of ops, each registering its handlers beside them;
- ``walk``: lowering a whole trace (``lower_trace``, ``lower_ranks``).

This index imports every family once, so that the table is complete before
the first op is lowered.
"""

from backends.torch.errors import LoweringError
from backends.torch.lowering import (  # noqa: F401  (each registers its handlers)
    activations,
    all_to_all,
    argmax,
    arithmetic,
    buckets,
    chunk,
    collectives,
    compose,
    const_index,
    const_lookup,
    conv,
    copies,
    count_scales,
    counts,
    expert_rows,
    foreach_copies,
    fused_adam,
    grad_buffers,
    group_norm,
    grouped,
    ids,
    label_masks,
    layout,
    logprob_views,
    losses,
    masked_select,
    masks,
    max,
    max_all,
    merged_views,
    nn,
    no_entries,
    norm_sums,
    packs,
    pair_combine,
    param_buffers,
    permute,
    pool,
    routing,
    safe_softmax,
    scan,
    slices,
    std,
    titan_ops,
    tokens,
    triangular,
    vocab_parallel,
    vocab_picks,
)
from backends.torch.lowering.buckets import check_broadcasts, check_bucket_layouts
from backends.torch.lowering.context import LNode, Lowered, Lowerer
from backends.torch.lowering.registry import handlers
from backends.torch.lowering.uneven_shards import padded_rows
from backends.torch.lowering.walk import check_shards, lower_ranks, lower_trace

__all__ = ["LNode", "Lowered", "Lowerer", "LoweringError", "check_broadcasts",
           "check_bucket_layouts", "check_shards", "handlers", "lower_ranks", "lower_trace",
           "padded_rows"]
