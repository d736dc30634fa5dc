"""cp: PyTorch's context parallelism run on the CPU through the shim
(backends/torch/zoo/cp_shim.py), over real gloo process groups.

The ring (CP's own ``_templated_ring_attention`` and its backward, with
the CPU flash kernel per block) computes the loss and the weights'
gradients of a causal attention layer as the single-device step does, in
float64, with all-gather and all-to-all rotation, with and without the
head-tail load balancer. Without the shim, CP stops at the CPU kernel."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

F64 = torch.float64
B, H, S, D = 1, 2, 8, 4


def _layer(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    q, k, v = (torch.einsum("bhsd,de->bhse", x, w) for w in weights)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _worker(rank: int, world: int, port: int, method: str, balance: bool, shim: bool,
            results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    from backends.torch.zoo import cp_shim
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        x, r = (torch.randn(B, H, S, D, generator=g, dtype=F64) for _ in range(2))
        weights = [torch.randn(D, D, generator=g, dtype=F64, requires_grad=True)
                   for _ in range(3)]
        (_layer(x, weights) * r).sum().backward()
        want = [w.grad.clone() for w in weights]
        for w in weights:
            w.grad = None
        if shim:
            cp_shim.apply()
        set_rotate_method(method)
        cp._cp_options.enable_load_balance = balance
        cp._cp_options.convert_to_f32 = False
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        try:
            with context_parallel(mesh, buffers=[x, r], buffer_seq_dims=[2, 2]):
                loss = (_layer(x, weights) * r).sum()
                loss.backward()
        except NotImplementedError as e:
            results[rank] = ("refused", str(e))
            return
        grads = [w.grad.clone() for w in weights]
        for grad in grads:
            dist.all_reduce(grad)
        results[rank] = ("ran", max(float((a - b).abs().max()) for a, b in zip(grads, want)))
    finally:
        dist.destroy_process_group()


def _run(world: int, method: str, balance: bool, shim: bool = True) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, port, method, balance, shim, results), nprocs=world)
        return dict(results)


@pytest.mark.parametrize("world,method,balance", [
    (2, "allgather", False), (2, "alltoall", False), (2, "allgather", True),
    (4, "alltoall", True)])
def test_ring_on_cpu_equals_single_device(world, method, balance):
    results = _run(world, method, balance)
    assert set(results) == set(range(world))
    for kind, diff in results.values():
        assert kind == "ran" and diff < 1e-12


def test_without_the_shim_cp_stops_at_the_cpu_kernel():
    results = _run(2, "allgather", False, shim=False)
    assert all(kind == "refused" for kind, _ in results.values()), results
