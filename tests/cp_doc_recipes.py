"""cp: recipes for the document tagger (tests/cp_doc_models.py) under
PyTorch's per-document head-tail load balancer
(``_PerDocumentHeadTailLoadBalancer``): the batch laid out in its order
and cut over "cp" (``model.cp_load_balancer``), each rank's queries its
chunk, the keys and values all-gathered over "cp", the document mask at
the positions the rank holds; the gradients summed over cp and dp. The
wrong ones: a rank's mask not shifted to its chunk, and one rank undoing
the balancer's order of the gathered keys wrongly."""

from __future__ import annotations

import torch

from tests.cp_split_recipes import cp_sum


def per_document(lengths: list[int]):
    """The balancer, as a function of (sequence length, cp size)."""
    def make(seq_length: int, size: int):
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _PerDocumentHeadTailLoadBalancer,
        )
        if sum(lengths) != seq_length:
            raise ValueError(f"documents {lengths} do not fill {seq_length} positions")
        return _PerDocumentHeadTailLoadBalancer([lengths], size, torch.device("cpu"))
    return make


def _setup(model, mesh, fault: str = ""):
    cp_mesh = mesh["cp"]
    c, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    model.kv_group = cp_mesh
    model.cp_load_balancer = per_document(model.lengths)
    order = model.cp_load_balancer(model.seqlen, cp)._generate_indices()[0]
    n = model.seqlen // cp
    rows = order[c * n:(c + 1) * n]
    cols = order
    if fault == "unshifted":  # every rank's mask rows are the first rank's
        rows = order[:n]
    if fault == "keys_unordered" and c == cp - 1:  # the gathered keys read in the plain order
        cols = torch.arange(model.seqlen)
    model.query_positions, model.key_positions = rows, cols
    return cp_sum(model, mesh)


def doc_allgather(model, mesh):
    """The keys and values all-gathered over "cp"; each rank's document mask
    at its query rows' and the gathered keys' single-device positions."""
    return _setup(model, mesh)


def doc_mask_unshifted(model, mesh):
    """Bug: the mask's rows not shifted to the rank's chunk (every rank
    masks its queries as the first rank's)."""
    return _setup(model, mesh, "unshifted")


def doc_keys_unordered(model, mesh):
    """Bug: the last rank reads the gathered keys as if in the single-device
    order (the balancer's order not undone on the key side)."""
    return _setup(model, mesh, "keys_unordered")


def doc_allgather_contiguous(model, mesh):
    """doc_allgather without a load balancer: rank c holds chunk c."""
    cp_mesh = mesh["cp"]
    c, n = cp_mesh.get_local_rank(), model.seqlen // cp_mesh.size()
    model.kv_group = cp_mesh
    model.query_positions = torch.arange(c * n, (c + 1) * n)
    model.key_positions = torch.arange(model.seqlen)
    return cp_sum(model, mesh)
