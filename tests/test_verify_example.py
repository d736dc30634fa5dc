from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from backends.torch.pytest_plugin import assert_equivalent
from backends.torch.zoo.stock_models import mlp_mean as model  # your model factory


def parallelize(model, mesh):  # your recipe: TP on "tp", FSDP2 on "dp"
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"gate": ColwiseParallel(),
                                               "up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def test_fsdp_tp_is_the_single_device_step():
    assert_equivalent(model, parallelize, mesh="dp=2,tp=2", batch=4, hidden=8)
