"""The mesh axes cutting each dim of a rank's parameter, read off its
placements (a DTensor's) or its recipe's ``mesh_axes`` (a plain tensor's),
a library's mesh dims named as the backend's axes by the ranks they span."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

#: the backend's axis of a mesh dim a library names otherwise (transformers'
#: "fsdp", torchtitan's "dp_shard"): the data-parallel axis
AXIS_NAMES = {"fsdp": "dp", "dp_shard": "dp"}


def strided_marker(factor: int) -> str:
    """The name standing first in a dim's axes when the dim is read as
    ``factor`` equal parts, the axes after it cutting each part (a strided
    shard: ``align.claim.strided``)."""
    return f"/{factor}"


def dim_ranks(mesh, mesh_dim: int, coordinate: list[int]) -> list[int]:
    """The global ranks along ``mesh_dim`` through the rank at ``coordinate``."""
    index = list(coordinate)
    index[mesh_dim] = slice(None)
    return [int(r) for r in mesh.mesh[tuple(index)].flatten()]


def data_parallel_axis(mesh, mesh_dim: int, layout: tuple[int, int, int],
                       split: dict[str, int]) -> str | None:
    """The backend axis a data-parallel mesh dim of a library's mesh runs
    along, read off the global ranks it holds (not its name): "dp" when it
    spans every data-parallel rank, "dps" when it spans s consecutive ones
    (an HSDP shard group), "dpr" when it spans every s-th one (an HSDP
    replica group); ``split["dps"]`` records s. None when the ranks vary
    in anything but the data-parallel coordinate, or not in one of these
    patterns, or when this rank's index in the mesh dim is not its
    coordinate on that axis. ``layout`` is (pp, dp, tp) or (pp, dp, tp, cp):
    a data-parallel index's ranks are its cp * tp consecutive ones."""
    _, dp, tp = layout[:3]
    tp *= layout[3] if len(layout) > 3 else 1
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    ranks = dim_ranks(mesh, mesh_dim, coordinate)
    stage = {r // (dp * tp) for r in ranks}
    column = {r % tp for r in ranks}
    ds = [(r // tp) % dp for r in ranks]
    k = len(ds)
    if len(stage) != 1 or len(column) != 1 or k < 2 or dp % k:
        return None
    s = dp // k
    here = ds[coordinate[mesh_dim]]
    if k == dp and ds == list(range(dp)):
        return "dp"
    if ds == [ds[0] + j for j in range(k)] and ds[0] % k == 0 and split.get("dps", k) == k:
        split["dps"] = k
        return "dps" if here % k == coordinate[mesh_dim] else None
    if ds == [ds[0] + j * s for j in range(k)] and ds[0] < s and split.get("dps", s) == s:
        split["dps"] = s
        return "dpr" if here // s == coordinate[mesh_dim] else None
    return None


def is_tensor_parallel_dim(mesh, mesh_dim: int, layout: tuple[int, int, int]) -> bool:
    """The mesh dim's ranks (through this rank) are exactly the backend's
    tensor-parallel ranks of this rank's stage and data-parallel index, in
    order: it is the "tp" axis whatever its name."""
    tp = layout[2]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    ranks = dim_ranks(mesh, mesh_dim, coordinate)
    return len(ranks) == tp and ranks == list(range(ranks[0], ranks[0] + tp)) and ranks[0] % tp == 0


def dims_axes(t: torch.Tensor, layout: tuple[int, int, int] | None = None,
              split: dict[str, int] | None = None) -> list[list[str]]:
    """For each dim of a (DTensor) parameter, the mesh axes sharding it, outer
    first. A mesh dim is the backend axis of its name ("pp", "dp", "tp",
    or one named as in ``AXIS_NAMES``); with the backend's mesh ``layout``
    (pp, dp, tp), a data-parallel one is the axis its ranks run along
    (``data_parallel_axis``: an HSDP shard dim is "dps", and ``split``
    records its size). A plain tensor with a ``mesh_axes`` attribute (a
    recipe's, such as Megatron's sharded parameters) has those axes (the
    plan's claims they make are checked against the values loaded,
    ``check.check_loaded``)."""
    from torch.distributed.tensor.placement_types import _StridedShard
    axes: list[list[str]] = [[] for _ in range(t.dim())]
    own = getattr(t, "mesh_axes", None)  # a plain tensor's layout, set by its recipe
    if own is not None and not isinstance(t, DTensor):
        return [list(a) for a in own]
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        names = [AXIS_NAMES.get(n, n) for n in mesh.mesh_dim_names or ()]
        if layout is not None:
            split = {} if split is None else split
            for mesh_dim, name in enumerate(names):
                if name in ("pp", "tp"):
                    continue
                if name != "dp" and is_tensor_parallel_dim(mesh, mesh_dim, layout):
                    names[mesh_dim] = "tp"  # a dim of the user's own name over the tp ranks
                    continue
                axis = context_parallel_axes(mesh, mesh_dim, layout) \
                    or data_parallel_axis(mesh, mesh_dim, layout, split) \
                    or data_tensor_parallel_axes(mesh, mesh_dim, layout)
                if axis is None and name == "dp" and mesh.size(mesh_dim=mesh_dim) > 1:
                    # a shard's position would be its index in this dim,
                    # which is no coordinate of the backend's mesh
                    raise ValueError(f"mesh dim '{mesh.mesh_dim_names[mesh_dim]}' spans ranks "
                                     f"in no data-parallel layout the backend reads")
                names[mesh_dim] = axis or name
        strided = []
        for mesh_dim, p in enumerate(t.placements):
            if (p.is_shard() or isinstance(p, _StridedShard)) and mesh.size(mesh_dim=mesh_dim) == 1:
                continue  # a shard over one rank is the whole
            if isinstance(p, _StridedShard):
                strided.append((p.dim % t.dim(), p.split_factor, mesh_dim))
            elif p.is_shard():
                axes[p.dim % t.dim()].extend(names[mesh_dim].split("+"))
            elif not p.is_replicate():
                raise ValueError(f"parameter placement {p} is not supported")
        for dim, factor, mesh_dim in strided:
            # sharded after the mesh dims already on this dim (FSDP over TP)
            inner = [mesh.size(mesh_dim=names.index(a)) for a in axes[dim]]
            if factor == math.prod(inner):
                axes[dim].extend(names[mesh_dim].split("+"))
            elif not axes[dim] and factor > 1:
                # the dim read as `factor` equal parts, the rank holding its
                # block of each (transformers' packed_colwise of the fused
                # gate/up columns): `factor` ranges of the tensor, marked as
                # such (claim.STRIDED; docs/soundness.md, "Plans traced from
                # PyTorch", 87)
                axes[dim].extend([strided_marker(factor), *names[mesh_dim].split("+")])
            else:
                raise ValueError(f"parameter placement {t.placements} is not supported: a strided "
                                 f"shard of dim {dim} in {factor} parts over a dim already cut "
                                 f"by {axes[dim]} is not traced")
    return axes


def data_tensor_parallel_axes(mesh, mesh_dim: int, layout: tuple[int, ...]) -> str | None:
    """"dp+tp" when the mesh dim's ranks (through this rank) are every
    data-parallel and tensor-parallel rank of its stage and context-parallel
    coordinate, data-parallel outer, tensor-parallel inner (transformers'
    "ep" dim at ep = dp x tp: its index is d * tp + t); else None.
    ``layout`` is (pp, dp, tp) or (pp, dp, tp, cp)."""
    _, dp, tp = layout[:3]
    cp = layout[3] if len(layout) > 3 else 1
    coordinate = mesh.get_coordinate()
    if dp < 2 or tp < 2 or coordinate is None:
        return None
    ranks = dim_ranks(mesh, mesh_dim, coordinate)
    first = ranks[0]
    if first % tp or (first // (cp * tp)) % dp:
        return None
    if ranks == [first + d * cp * tp + t for d in range(dp) for t in range(tp)]:
        return "dp+tp"
    return None


def context_parallel_axes(mesh, mesh_dim: int, layout: tuple[int, ...]) -> str | None:
    """"cp" when the mesh dim's ranks (through this rank) are exactly this
    rank's context-parallel ranks in order (its stage, data-parallel and
    tensor-parallel coordinates fixed), "dp+cp" when they are every
    data-parallel and context-parallel rank of its stage and tensor-parallel
    coordinate, data-parallel outer (torchtitan's "fsdp" dim, dp_shard x
    cp); else None. ``layout`` is (pp, dp, tp, cp)."""
    if len(layout) < 4 or layout[3] == 1:
        return None
    _, dp, tp, cp = layout
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    ranks = dim_ranks(mesh, mesh_dim, coordinate)
    first = ranks[0]
    if len(ranks) == cp and ranks == [first + c * tp for c in range(cp)] \
            and (first // tp) % cp == 0:
        return "cp"
    if dp > 1 and len(ranks) == dp * cp and ranks == [first + j * tp for j in range(dp * cp)] \
            and (first // tp) % (dp * cp) == 0:
        return "dp+cp"
    return None
