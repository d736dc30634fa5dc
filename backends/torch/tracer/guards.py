"""The single-device step's branches on numbers read with ``.item()``
(guards): what a SUCCESS covers, and every rank's branches matched with
them (docs/soundness.md, "Plans traced from PyTorch", 69-71)."""

from __future__ import annotations

from backends.torch.lowering import Lowered, LoweringError
from backends.torch.tracer.single_plan import Builder
from verdict.plan import Plan

#: a guard's comparison as Python writes it
COMPARISONS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def describe_guards(guards: list[tuple[int, str, float, bool, str]]) -> str:
    """The single-device step's branches on numbers read with ``.item()``,
    in order, each with the branch taken: what a SUCCESS covers."""
    return "; ".join(f"branch {k} ({where}): number {COMPARISONS.get(name, name)} {other!r} "
                     f"is {taken}" for k, (_, name, other, taken, where) in enumerate(guards, 1))


def refuse_guard(rank: int, guard: tuple, why: str) -> LoweringError:
    _, name, other, taken, where = guard
    return LoweringError(f"{where}: a branch on a number read with .item() (number {name} "
                         f"{other}: {taken}) on rank {rank} is not lowered: {why}")


def same_branches(single: Lowered, ranks: list[Lowered]) -> None:
    """Every rank's branches on numbers read with ``.item()`` are the
    single-device step's, in order: the same comparison with the same
    constant, the same branch taken; else refused."""
    want = [(name, other, taken) for _, name, other, taken, _ in single.guards]
    for low in ranks:
        got = [(name, other, taken) for _, name, other, taken, _ in low.guards]
        if got != want:
            guard = (low.guards or single.guards)[0]
            raise refuse_guard(low.rank, guard, (
                f"the rank's branches {got} are not the single-device step's {want}, so the "
                f"number is not claimed equal to the single-device step's and other inputs may "
                f"take the other branch"))


def match_guards(single: Lowered, plan_s: Plan, plan: Plan, t_of: dict[tuple[int, int], int],
                 ranks: list[Lowered], b: Builder) -> None:
    """Every rank's branches on numbers read with ``.item()`` (guards) are
    the single-device step's, in order (the same comparison with the same
    constant, the same branch taken), and the number each rank's k-th guard
    tests is claimed to be, whole and at factor 1, the number the
    single-device step's k-th guard tests: a claim its stage proves for
    every input, so on every input on which the single-device step takes
    the traced branches every rank takes them too (docs/soundness.md,
    "Plans traced from PyTorch", 69-71). A number inferred as a part or a
    multiple of the single-device number (a rank's own norm) is claimed
    whole all the same, so its stage refutes it; a number claimed to be
    another value is refused."""
    same_branches(single, ranks)
    s_tensor = {}
    for t in plan_s.tensors:
        s_tensor.setdefault((t.tid, t.lver), t)
    for low in ranks:
        for guard, s_guard in zip(low.guards, single.guards):
            t = t_of.get((low.rank, guard[0]))
            s_v = s_guard[0]
            claim = plan.tensors[t] if t is not None else None
            whole = s_tensor.get((b.s.tid.get(s_v, -1), b.s.lver.get(s_v, 0)))
            if claim is None or whole is None or claim.tid != whole.tid \
                    or claim.lver != whole.lver or claim.shape != whole.shape:
                raise refuse_guard(low.rank, guard, (
                    "its number is not claimed to be the number the single-device step's "
                    "branch tests, so other inputs may take the other branch"))
            if not claim.is_whole() or claim.factor() != 1 or claim.slices != whole.slices:
                # inferred as a part or a multiple of it (a rank's own norm): claimed whole
                # instead, a claim its stage proves or refutes like any other
                plan.tensors[t] = claim._replace(slices=whole.slices, parts=whole.parts,
                                                        scale=whole.scale)
