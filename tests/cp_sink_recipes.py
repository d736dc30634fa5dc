

def sink_ring_every_step_only(model, mesh):
    """Bug: the sink folded into the block at every ring step and not after
    the ring, so that it enters the merged normalizer once per block a
    rank merges (cp times on the last rank)."""
    model.fold_once = False
    return sink_ring(model, mesh, merger=_sink_every_step(model))
