"""The plan builder (backends/torch/tracer/build.py) reads the lowered traces
and leaves them as they are: a rank's coordinates as its claims read them
(HSDP's data-parallel sub-coordinates, "cp" when the mesh has none) and the
values it adds are its own (``align.claim.rank_coords``)."""

from __future__ import annotations

import copy

from backends.torch.lowering import lower_ranks, lower_trace
from backends.torch.tracer.align.claim import rank_coords
from backends.torch.tracer.build import build_plans
from backends.torch.tracer.rank import run
from backends.torch.tracer.ranks import trace_ranks


def test_rank_coords_adds_the_sub_coordinates_to_a_copy() -> None:
    coords = {"pp": 0, "dp": 3, "tp": 0}
    out = rank_coords(coords, {"dp": 4, "dpr": 2, "dps": 2, "tp": 1, "cp": 1, "mb": 1})
    assert out == {"pp": 0, "dp": 3, "tp": 0, "cp": 0, "dpr": 1, "dps": 1}
    assert coords == {"pp": 0, "dp": 3, "tp": 0}
    assert rank_coords({"dp": 1, "cp": 1}, {"dp": 2, "cp": 2}) == {"dp": 1, "cp": 1}


def test_building_hsdp_plans_leaves_the_lowered_traces_as_they_are() -> None:
    kw = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 8, "vocab": 5, "seqlen": 4}
    spec = {"model": "backends.torch.zoo.stock_models:mlp", "model_kwargs": kw,
            "recipe": "backends.torch.zoo.stock_recipes:hsdp", "dp": 4, "tp": 1, "pp": 1,
            "cp": 1, "batch": 4, "seqlen": 4, "vocab": 5, "seed": 0, "optimizer": "none",
            "clip": None, "clipper": None}
    single = lower_trace(run({**spec, "parallel": False}, 0), 5)
    traces = trace_ranks({**spec, "parallel": True}, 4)
    lows = lower_ranks(traces, 5)
    assert any("dps" in low.split for low in lows)
    before = copy.deepcopy([(low.coords, low.shapes) for low in lows])
    world = {"model": spec["model"], "variant": "torch", "gbs": 4, "dp": 4, "tp": 1, "pp": 1,
             "cp": 1, "ep": 1, "nm": traces[0]["microbatches"], "recipe": spec["recipe"], **kw}
    _, plan = build_plans(single, lows, world)
    assert plan.nodes
    assert [(low.coords, low.shapes) for low in lows] == before
