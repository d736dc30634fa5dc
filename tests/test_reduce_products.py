"""Shape reduction of a flatten whose outer dim has size 1: the pieces the
flattened dim needs are carried by the inner dim (a size-1 dim cannot be
grown). Found on Qwen2's bias gradient under FSDP (a [1, n] sum flattened
to [n], reduce-scattered into quarters): before, the size-1 dim was grown
and the stage's reduced shapes disagreed, a false alarm."""

from __future__ import annotations

from verdict.reduce import _Classes, _sizes


def test_flatten_of_a_size_one_dim_grows_the_inner_dim() -> None:
    classes = _Classes()
    outer, inner, flat = (0, 0), (0, 1), (1, 0)
    classes.add(outer, 1)
    classes.add(inner, 8)
    classes.add(flat, 8)
    classes.need(inner, 2)   # the inputs are cut in halves
    classes.need(flat, 4)    # the output in quarters
    size = _sizes(classes, [(flat, [outer, inner], 1)])
    assert size(outer) == 1
    assert size(flat) == size(outer) * size(inner)
    assert size(flat) % 4 == 0 and size(inner) % 2 == 0


def test_flatten_grows_the_outer_dim_when_it_can() -> None:
    classes = _Classes()
    outer, inner, flat = (0, 0), (0, 1), (1, 0)
    classes.add(outer, 4)
    classes.add(inner, 8)
    classes.add(flat, 32)
    classes.need(flat, 4)
    size = _sizes(classes, [(flat, [outer, inner], 1)])
    assert size(flat) == size(outer) * size(inner)
    assert size(flat) % 4 == 0


def test_flatten_keeps_the_minimum_of_its_output() -> None:
    """A flattened [1, 1, 14] gradient that a parallel narrow reads (FSDP2's
    padded shard: rows [0, 4) of 14) must keep its 14: the product grows
    its factor to the output's minimum (before, it stayed at 7 and the
    narrow's shapes broke: a false alarm)."""
    classes = _Classes()
    a, b, c, flat = (0, 0), (0, 1), (0, 2), (1, 0)
    for ref, full in ((a, 1), (b, 1), (c, 14), (flat, 14)):
        classes.add(ref, full)
    classes.need(c, 7)
    classes.need(flat, 7, minimum=14)
    size = _sizes(classes, [(flat, [a, b, c], 1)])
    assert size(flat) == 14 == size(a) * size(b) * size(c)


def _cat_plan(op: str = "cat"):
    from verdict.plan import Logical, Node, Plan, Tensor
    plan = Plan(world={}, logical=[Logical("a", (8,), "activation"), Logical("b", (8,), "activation")])
    plan.tensors = [Tensor(0, 0, 0, 0, (2,), 0, ((0, 2),), (0, 1, 1)),
                    Tensor(0, 0, 0, 1, (2,), 0, ((4, 6),), (0, 1, 1)),
                    Tensor(0, 0, 1, 0, (4,), 0, ((0, 4),), (0, 1, -2))]
    if op == "cat":
        plan.nodes = [Node(0, 0, "cat", "none", (0, 1), (2,), {"dim": 0})]
    else:
        plan.tensors[2] = plan.tensors[2]._replace(shape=(2,), slices=((0, 2),))
        plan.nodes = [Node(0, 0, op, "fw", (0,), (2,), {})]
    return plan


def test_a_cat_of_ranges_whose_reduction_breaks_it_is_kept_at_full_size() -> None:
    """A strided value's join (docs/soundness.md, "Plans traced from
    PyTorch", 87 (e)): the dims a parallel node relates by a product are
    kept whole when the reduced sizes break the node; a node with no
    product relation is left to fail as before."""
    from verdict.reduce import RuleMemo, _keep_products
    classes = _Classes()
    a, b = (10, 0), (11, 0)
    classes.add(a, 8)
    classes.add(b, 8)
    assert _keep_products(_cat_plan(), 0, classes, {0: 10, 1: 10, 2: 11}, RuleMemo())
    assert classes.size(a) == 8 and classes.size(b) == 8
    other = _Classes()
    other.add(a, 8)
    other.add(b, 8)
    assert not _keep_products(_cat_plan("exp"), 0, other, {0: 10, 1: 10, 2: 11}, RuleMemo())
    assert other.size(a) == 1
