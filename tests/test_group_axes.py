"""A process group read as mesh axes from its members (docs/soundness.md,
"Plans traced from PyTorch", 113): the product of the axes it holds, in
rank order, or nothing."""

from backends.torch.tracer.align.group_axes import product_axes

AXES = ("dp", "cp", "tp")


def _coords(dp: int, cp: int, tp: int) -> dict[int, dict[str, int]]:
    """Rank -> coordinates on a dp x cp x tp mesh, tp fastest."""
    return {(d * cp + c) * tp + t: {"dp": d, "cp": c, "tp": t}
            for d in range(dp) for c in range(cp) for t in range(tp)}


def test_every_rank_of_dp_and_tp_is_their_product() -> None:
    coords = _coords(2, 1, 2)
    assert product_axes((0, 1, 2, 3), coords, AXES, {"dp": 2, "cp": 1, "tp": 2}) == ["dp", "tp"]


def test_a_product_at_fixed_other_coordinates() -> None:
    coords = _coords(2, 2, 2)
    sizes = {"dp": 2, "cp": 2, "tp": 2}
    assert product_axes((0, 1, 4, 5), coords, AXES, sizes) == ["dp", "tp"]
    assert product_axes((2, 3, 6, 7), coords, AXES, sizes) == ["dp", "tp"]
    assert product_axes(tuple(range(8)), coords, AXES, sizes) == ["dp", "cp", "tp"]


def test_a_diagonal_is_no_product() -> None:
    coords = _coords(2, 1, 2)
    assert product_axes((0, 3), coords, AXES, {"dp": 2, "cp": 1, "tp": 2}) is None


def test_part_of_a_product_is_none() -> None:
    coords = _coords(2, 1, 4)
    sizes = {"dp": 2, "cp": 1, "tp": 4}
    assert product_axes((0, 1, 4, 5), coords, AXES, sizes) is None  # half of tp


def test_members_out_of_rank_order_are_none() -> None:
    coords = _coords(2, 1, 2)
    assert product_axes((0, 2, 1, 3), coords, AXES, {"dp": 2, "cp": 1, "tp": 2}) is None
