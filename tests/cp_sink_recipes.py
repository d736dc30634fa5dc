"""cp: recipes for the sink tagger (tests/cp_sink_models.py) with the
sequence cut over a "cp" mesh dim: each rank holds its chunk of the
queries, all-gathers the keys and values over "cp" and runs the eager
sink attention of its rows (the causal mask's rows at its positions);
the gradients are summed over cp and dp. The wrong ones as they ship:
the sinks dropped under CP (prime-rl PR 3397), and the sink entered once
per gathered chunk (once per ring step)."""

from __future__ import annotations

from tests.cp_split_recipes import cp_sum


def sink_allgather(model, mesh):
    """All-gather of K/V over "cp", eager sink attention of the rank's query
    rows over every key; gradients summed over cp and dp."""
    return _setup(model, mesh, "")


def sink_allgather_dropped(model, mesh):
    """Bug (prime-rl PR 3397): the context-parallel attention drops the
    sinks (the softmax over the scores alone)."""
    return _setup(model, mesh, "no_sinks")


def sink_allgather_per_chunk(model, mesh):
    """Bug: the sink appended to each gathered chunk's scores, so that it
    enters the normalizer cp times (as a ring adding it at every step)."""
    return _setup(model, mesh, "sink_per_chunk")


def _setup(model, mesh, fault: str):
    model.kv_group = mesh["cp"]
    model.fault = fault
    model.cp_rank = mesh["cp"].get_local_rank()
    return cp_sum(model, mesh)


def sink_ring(model, mesh, method: str = "allgather", merger=None):
    """PyTorch's ring attention over "cp" (through the CPU shim) as the
    kernel of the sink tagger's flash form: the ring's merged (out, lse)
    of the rank's queries over every key, the sink folded into them once
    after the ring (the merged normalizer ``exp(sink) + sum_i exp(lse_i)``);
    the backward the ring's at the folded out and lse. Gradients summed."""
    from tests.cp_split_recipes import _Ring
    model.cp_mesh = mesh["cp"]
    model.train_context = lambda: _Ring(mesh["cp"], method, merger)
    return cp_sum(model, mesh)


def sink_ring_alltoall(model, mesh):
    """sink_ring with the all-to-all rotation."""
    return sink_ring(model, mesh, "alltoall")


def sink_ring_dropped(model, mesh):
    """Bug (prime-rl PR 3397): the context-parallel attention's wrapper
    takes the sinks (``s_aux``) into ``**kwargs`` and never applies them:
    the ring's result is the attention without sinks."""
    model.fold_once = False
    return sink_ring(model, mesh)


def _sink_every_step(model):
    def make(merger):
        class SinkEveryStep(merger):
            """Each block folded with the sink before it is merged (a
            sink-aware block kernel called at every ring step)."""

            def _merge_one(self, block_out, block_lse, partial):
                from tests.cp_sink_models import fold_sink
                lse = block_lse if block_lse.dim() < block_out.dim() else block_lse.squeeze(-1)
                out, lse = fold_sink(block_out, lse, model.sinks.detach())
                lse = lse if block_lse.dim() < block_out.dim() else lse.unsqueeze(-1)
                super()._merge_one(out, lse, partial)
        return SinkEveryStep
    return make


def sink_ring_every_step(model, mesh):
    """Bug: the sink folded into the block at every ring step (and once
    more after the ring), so that it enters the merged normalizer cp + 1
    times."""
    return sink_ring(model, mesh, merger=_sink_every_step(model))


def sink_ring_every_step_only(model, mesh):
    """Bug: the sink folded into the block at every ring step and not after
    the ring, so that it enters the merged normalizer once per block a
    rank merges (cp times on the last rank)."""
    model.fold_once = False
    return sink_ring(model, mesh, merger=_sink_every_step(model))


def sink_ring_balanced(model, mesh):
    """sink_ring with PyTorch's head-tail load balancer (rank c holds chunks
    c and 2 cp - 1 - c; the batch laid out in the balancer's order)."""
    from tests.cp_split_recipes import _Balanced, _head_tail
    model.cp_mesh = mesh["cp"]
    model.cp_load_balancer = _head_tail
    model.train_context = lambda: _Balanced(mesh["cp"], "allgather")
    return cp_sum(model, mesh)


def sink_ring_balanced_dropped(model, mesh):
    """Bug (prime-rl PR 3397) under the load balancer: the sinks swallowed."""
    model.fold_once = False
    return sink_ring_balanced(model, mesh)
