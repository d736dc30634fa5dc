"""Mistakes in a loss-parallel log-softmax, for the tests of
``backends/torch/lowering/vocab_parallel.py``: each is a recipe that applies
``recipes.tp_sp_loss_parallel`` with DTensor's loss-parallel
``_log_softmax`` replaced (in the rank's own process) by a variant whose
stabilizing shift is not the all-reduced row maximum. docs/soundness.md
("Plans traced from PyTorch", 7a) says what the verifier reports.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor.parallel import loss as dtensor_loss

from backends.torch.zoo.recipes import tp_sp_loss_parallel


def _log_softmax_shifted_by(reduce_op: str | None):
    """DTensor's loss-parallel log-softmax with the local row maxima reduced
    by ``reduce_op`` over the tensor-parallel group (None: not reduced)."""
    def log_softmax(x, dim, half_to_float, mesh, mesh_dim):
        top = torch.amax(x, dim, keepdim=True)
        if reduce_op is not None:
            top = funcol.all_reduce(top, reduceOp=reduce_op, group=(mesh, mesh_dim))
        shifted = x - top
        total = funcol.all_reduce(torch.sum(torch.exp(shifted), dim, keepdim=True),
                                  reduceOp="sum", group=(mesh, mesh_dim))
        return shifted - torch.log(total)
    return log_softmax


def loss_parallel_local_max(model, mesh):
    """Each rank shifts its vocabulary shard by its own row maximum (the MAX
    all-reduce left out): the shards' exponentials are summed with different
    shifts, so the log-probabilities are wrong."""
    dtensor_loss._log_softmax = _log_softmax_shifted_by(None)
    return tp_sp_loss_parallel(model, mesh)


def loss_parallel_sum_max(model, mesh):
    """The local row maxima all-reduced with SUM instead of MAX: the same
    shift on every rank (harmless in exact arithmetic, an overflow risk in
    floats); the verifier proves the shift is the row maximum, so it FAILs."""
    dtensor_loss._log_softmax = _log_softmax_shifted_by("sum")
    return tp_sp_loss_parallel(model, mesh)
