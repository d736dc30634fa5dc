"""The user's mesh: dims named and sized in the user's order, mapped onto the
backend's rank layout.

    --mesh dp_replicate=2,dp_shard=2,cp=1,tp=2

builds, on every rank, ``init_device_mesh("cpu", (2, 2, 1, 2),
mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))`` and passes it to
the recipe as it is. The backend itself reads a rank as a coordinate
(stage, data-parallel index, context-parallel index, tensor-parallel index)
of the layout (pp, dp, cp, tp), rank ``((stage * dp + d) * cp + c) * tp +
t`` (the verifier's layout, ``verdict.final.rank_coords``). A user's mesh
maps onto it when its dims, outer to inner and leaving out those of size 1,
are: at most one pipeline dim ("pp"), then the data dims (their product is
dp; the batch is split along them, outer first), then at most one
context-parallel dim ("cp": each rank's tokens and labels are its chunks of
the sequence), then at most one model-parallel dim (tp). torchtitan's
order (pp, dp_replicate, dp_shard, cp, tp) and Megatron-Core's (pp, dp,
ep, cp, tp, outer to inner) are such orders. Any other order, or two
pipeline, context-parallel or model-parallel dims of size > 1, is refused
in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backends.torch.errors import LoweringError

#: dims that split the batch unless the user names the data dims
DATA_NAMES = ("dp", "dp_replicate", "dp_shard", "fsdp", "ddp", "hsdp", "data")
PIPELINE_NAMES = ("pp",)
#: the dim that splits the sequence (context parallelism)
CONTEXT_NAMES = ("cp",)
#: the default mesh, (pp, dp, tp) in this order
DEFAULT_NAMES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshSpec:
    """Named dims with sizes, outer first, and which of them split the batch."""
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    data: tuple[str, ...]

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def size(self, kind: str) -> int:
        """The product of the sizes of the dims of ``kind`` (pp, dp, cp, tp)."""
        return math.prod(s for n, s in zip(self.names, self.sizes) if self.kind(n) == kind)

    def kind(self, name: str) -> str:
        if name in PIPELINE_NAMES:
            return "pp"
        if name in self.data:
            return "dp"
        return "cp" if name in CONTEXT_NAMES else "tp"

    def layout(self) -> tuple[int, int, int]:
        """The backend's (pp, dp, tp); the context-parallel size is ``size("cp")``."""
        return self.size("pp"), self.size("dp"), self.size("tp")

    def label(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))

    def as_spec(self) -> dict:
        """What the rank processes get (plain data)."""
        return {"names": list(self.names), "sizes": list(self.sizes), "data": list(self.data)}


def parse_mesh(text: str, data_dims: str | None = None) -> MeshSpec:
    """``"dp_shard=2,tp=2"`` (and optionally the data dims, ``"dp_shard"``)
    -> a checked MeshSpec; LoweringError (one line, exit 2) when malformed
    or not mappable onto the backend's layout."""
    names, sizes = [], []
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or not name or not value.strip().isdigit() or int(value) < 1:
            raise LoweringError(f"--mesh {text!r}: each dim is NAME=SIZE with SIZE >= 1, "
                                f"such as dp_shard=2,tp=2")
        names.append(name.strip())
        sizes.append(int(value))
    data = None if data_dims is None else [d.strip() for d in data_dims.split(",") if d.strip()]
    return mesh_spec(names, sizes, data)


def mesh_spec(names, sizes, data=None) -> MeshSpec:
    """A checked MeshSpec from dim names and sizes in the user's order; the
    data dims default to those named as in ``DATA_NAMES``."""
    names, sizes = tuple(str(n) for n in names), tuple(int(s) for s in sizes)
    if len(names) != len(sizes) or not names:
        raise LoweringError("a mesh needs one size per dim name")
    if len(set(names)) != len(names):
        raise LoweringError(f"mesh dims {names}: a name occurs twice")
    if any(s < 1 for s in sizes):
        raise LoweringError(f"mesh sizes {sizes}: each is at least 1")
    if data is None:
        data = tuple(n for n in names if n in DATA_NAMES)
    data = tuple(data)
    unknown = [d for d in data if d not in names]
    if unknown:
        raise LoweringError(f"data dims {unknown} are not dims of the mesh {names}")
    spec = MeshSpec(names, sizes, data)
    check_order(spec)
    return spec


def check_order(spec: MeshSpec) -> None:
    """Refuse a mesh whose ranks are not laid out as the backend reads them."""
    big = [(n, s) for n, s in zip(spec.names, spec.sizes) if s > 1]
    kinds = [spec.kind(n) for n, _ in big]
    rank = {"pp": 0, "dp": 1, "cp": 2, "tp": 3}
    order = [rank[k] for k in kinds]
    if order != sorted(order) or any(kinds.count(k) > 1 for k in ("pp", "cp", "tp")):
        shown = ", ".join(f"{n}={s} ({spec.kind(n)})" for n, s in big)
        raise LoweringError(
            f"mesh {spec.label()}: its dims of size > 1, outer to inner, are {shown}; the "
            f"backend reads a mesh of at most one pipeline dim, then the data dims "
            f"{list(spec.data) or '(none)'}, then at most one context-parallel dim (cp), then "
            f"at most one model-parallel dim, in this order")


def default_spec(pp: int, dp: int, tp: int) -> MeshSpec:
    return MeshSpec(DEFAULT_NAMES, (pp, dp, tp), ("dp",))


def from_device_mesh(mesh, data=None) -> MeshSpec:
    """A MeshSpec from a DeviceMesh-like object (``mesh_dim_names`` and
    ``shape`` or ``mesh.shape``), a dict name -> size, or a sequence of
    (name, size) pairs, in the given order."""
    if isinstance(mesh, MeshSpec):
        return mesh if data is None else mesh_spec(mesh.names, mesh.sizes, data)
    if isinstance(mesh, str):
        return parse_mesh(mesh, None if data is None else ",".join(data))
    if isinstance(mesh, dict):
        return mesh_spec(list(mesh), list(mesh.values()), data)
    names = getattr(mesh, "mesh_dim_names", None)
    if names is not None:
        shape = getattr(mesh, "shape", None)
        shape = shape if shape is not None else mesh.mesh.shape
        return mesh_spec(names, tuple(shape), data)
    pairs = list(mesh)
    return mesh_spec([n for n, _ in pairs], [s for _, s in pairs], data)


def build(spec: dict):
    """The DeviceMesh a rank passes to the recipe: the user's (``spec["mesh"]``,
    ``MeshSpec.as_spec``) or the default ("pp", "dp", "tp")."""
    from torch.distributed.device_mesh import init_device_mesh
    user = spec.get("mesh")
    if user is None:
        return init_device_mesh("cpu", (spec["pp"], spec["dp"], spec["tp"]),
                                mesh_dim_names=DEFAULT_NAMES)
    return init_device_mesh("cpu", tuple(user["sizes"]), mesh_dim_names=tuple(user["names"]))


def coords(rank: int, pp: int, dp: int, tp: int, cp: int = 1) -> dict[str, int]:
    """The backend's coordinate of a global rank: ((stage * dp + d) * cp + c) * tp + t."""
    return {"pp": rank // (dp * cp * tp), "dp": (rank // (cp * tp)) % dp,
            "cp": (rank // tp) % cp, "tp": rank % tp}
