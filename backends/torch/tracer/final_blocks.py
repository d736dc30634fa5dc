"""What each rank ends with after a distributed optimizer's step, written
into the parallel plan as blocks (docs/soundness.md, "Plans traced from
PyTorch", 90 (c), (d)).

A parameter or optimizer state whose final value is elements of values
side by side (``Lowered.final_runs``: runs (rank, value, lo, hi), the
elements [lo, hi) of a value a rank computed) is cut into the blocks each
run makes (``flat_ranges.flat_blocks``): on the run's rank, ``narrow``
nodes cut the block from the value's tensor (its slices those of the value
offset by the block's starts); a block another rank computed is then
moved to this rank by a ``send_recv`` node (the all-gather that brought
those elements, one block at a time). The plan's world lists every final
tensor of a parameter or state (``final_blocks``: the rank, the
single-device tensor it must be, the plan tensor's rank, microbatch, tid
and version), the whole ones too, and the final
check (``verdict/final.py``) reads only those: each block must be the
single-device updated tensor at its slices, proved, and the blocks must
cover what the rank must hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.torch.lowering import LoweringError
from backends.torch.lowering.flat_ranges import flat_blocks
from verdict.plan import Node, Tensor

if TYPE_CHECKING:
    from backends.torch.tracer.build import _Writer


def tids_by_name(writer: _Writer) -> dict[str, int]:
    """The single-device tensors by name (parameters and states)."""
    return {lg.name: tid for tid, lg in enumerate(writer.b.logical)}


def write_final_blocks(writer: _Writer) -> None:
    """Every rank's final parameters and states as blocks (the module's
    docstring), when any rank ends with runs or gradient blocks and a step
    (docs/soundness.md, "Plans traced from PyTorch", 108 (c)); the world's
    ``final_blocks``."""
    stepped = writer.plan.world.get("grad_blocks") and any(
        r.low.updates or r.low.states for r in writer.rs.values())
    if not any(r.low.final_runs for r in writer.rs.values()) and not stepped:
        # with gradient blocks and a step, the updates are listed even when each
        # is a whole value (a data-parallel size of 1: every range whole), for
        # the final check reads an update over gradient blocks only from this list
        return
    names = tids_by_name(writer)
    out: list[list[int]] = []
    for r in writer.rs.values():
        rank = r.low.rank
        finals = {n: v for n, v in r.low.updates.items()}
        finals.update({f"{n}.{k}": v for n, st in r.low.states.items() for k, v in st.items()})
        for key, v in finals.items():
            tid = _tid(names, key, rank)
            writer.materialize(r, v)
            t = writer.t_of.get((rank, v))
            if t is None:
                raise LoweringError(f"rank {rank} ends with {key} as a value the plan does not "
                                    f"hold")
            # a strided shard's update (item 116 (c)): its k claimed blocks, not the
            # loose whole that joins them
            out += [[rank, tid, blk] for blk in writer.strided_blocks.get((rank, v), [t])]
        for key, runs in r.low.final_runs.items():
            tid = _tid(names, key, rank)
            for src, v, lo, hi in runs:
                for starts, shape in flat_blocks(tuple(writer.rs[src].low.shapes[v]), lo, hi):
                    t = _cut(writer, src, v, starts, shape, key)
                    if src != rank:
                        t = _moved(writer, t, src, rank, key)
                    out.append([rank, tid, t])
    # world values are scalars: "rank,tid,tensor's rank,mb,tid,version" entries joined by
    # ";" (a tensor named by its identity, not its index: a rewrite may renumber them)
    entries = []
    for rank, tid, t in out:
        x = writer.plan.tensors[t]
        entries.append(",".join(map(str, (rank, tid, x.rank, x.mb, x.tid, x.version))))
    writer.plan.world["final_blocks"] = ";".join(entries)


def _tid(names: dict[str, int], key: str, rank: int) -> int:
    tid = names.get(key)
    if tid is None:
        raise LoweringError(f"rank {rank} ends with {key}, which the single-device step has not")
    return tid


def _cut(writer: _Writer, rank: int, v: int, starts: tuple[int, ...], shape: tuple[int, ...],
         key: str) -> int:
    """Block (starts, shape) of rank ``rank``'s value v: narrow nodes, one
    per dim it cuts; the block's slices the value's offset by its starts."""
    t = writer.t_of.get((rank, v))
    if t is None:
        raise LoweringError(f"rank {rank}: a block of its final {key} lies in a value the plan "
                            f"does not hold")
    src = writer.plan.tensors[t]
    if len(src.slices) != len(shape) or any(b - a != n for (a, b), n in zip(src.slices,
                                                                          src.shape)):
        raise LoweringError(f"rank {rank}: a block of its final {key} lies in a value that is "
                            f"no plain block of a single-device value")
    slices, at_shape = list(src.slices), list(src.shape)
    for d, (s, n) in enumerate(zip(starts, shape)):
        if (s, n) == (0, at_shape[d]):
            continue
        slices[d] = (slices[d][0] + s, slices[d][0] + s + n)
        at_shape[d] = n
        out = writer.plain_tensor(src, src.tid, src.mb, tuple(at_shape), src.lver, tuple(slices))
        writer.plan.nodes.append(Node(rank, max(src.mb, 0), "narrow", "none", (t,), (out,),
                                      {"dim": d, "start": s, "length": n}, f"{key}.final"))
        t, src = out, writer.plan.tensors[out]
    return t


def _moved(writer: _Writer, t: int, src: int, dst: int, key: str) -> int:
    """Tensor t of rank ``src`` received by rank ``dst`` (``send_recv``)."""
    x = writer.plan.tensors[t]
    here = Tensor(dst, x.mb, x.tid, 0, x.shape, x.lver, x.slices, x.parts, x.scale)
    out = writer.plain_tensor(here, x.tid, x.mb, x.shape, x.lver, x.slices)
    writer.plan.nodes.append(Node(dst, max(x.mb, 0), "send_recv", "none", (t,), (out,),
                                  {"src": src, "dst": dst}, f"{key}.final"))
    return out
