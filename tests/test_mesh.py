"""The user's mesh (backends/torch/tracer/mesh.py): --mesh NAME=SIZE,... in the
user's order, mapped onto the backend's (pp, dp, cp, tp) layout or refused."""

from __future__ import annotations

import pytest

import verdict_cli
from backends.torch.errors import LoweringError
from backends.torch.tracer.mesh import coords, from_device_mesh, parse_mesh


def test_torchtitan_and_megatron_orders_map_onto_the_layout() -> None:
    titan = parse_mesh("pp=2,dp_replicate=2,dp_shard=2,cp=1,tp=2")
    assert titan.layout() == (2, 4, 2)
    assert titan.data == ("dp_replicate", "dp_shard")
    megatron = from_device_mesh({"pp": 1, "dp": 4, "ep": 1, "cp": 1, "tp": 2})
    assert megatron.layout() == (1, 4, 2)
    assert parse_mesh("rows=2,tp=2", data_dims="rows").layout() == (1, 2, 2)


def test_the_batch_split_follows_the_named_data_dims() -> None:
    mesh = parse_mesh("replicas=2,shards=2,tp=1", data_dims="replicas,shards")
    assert mesh.layout() == (1, 4, 1)
    assert [coords(r, 1, 4, 2)["dp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(("text", "says"), [
    ("tp=2,dp_shard=2", "then the data dims"),
    ("cp=2,dp=2", "then at most one context-parallel dim"),
    ("dp=2,tp=2,cp=2", "then at most one context-parallel dim"),
    ("dp=2,ep=2,tp=2", "at most one model-parallel dim"),
    ("dp=two", "NAME=SIZE"),
    ("dp=2,dp=2", "occurs twice"),
])
def test_meshes_the_layout_cannot_read_are_refused(text: str, says: str) -> None:
    with pytest.raises(LoweringError, match=says):
        parse_mesh(text)


def test_a_context_parallel_dim_stands_between_the_data_and_model_dims() -> None:
    mesh = parse_mesh("dp_shard=2,cp=2,tp=2")
    assert mesh.layout() == (1, 2, 2) and mesh.size("cp") == 2
    # rank ((stage * dp + d) * cp + c) * tp + t, as verdict.final.rank_coords reads it
    assert [(c["dp"], c["cp"], c["tp"]) for c in (coords(r, 1, 2, 2, 2) for r in range(8))] == \
        [(d, c, t) for d in range(2) for c in range(2) for t in range(2)]


def test_size_one_dims_may_stand_anywhere() -> None:
    assert parse_mesh("cp=1,tp=1,dp_shard=2").layout() == (1, 2, 1)


def test_a_recipe_written_for_torchtitans_dims_verifies(capsys) -> None:
    argv = ["torch", "--model", "mlp", "--recipe", "tests.mesh_recipes:fsdp_tp", "--mesh",
            "dp_replicate=1,dp_shard=2,cp=1,tp=2", "--layers", "1", "--hidden", "8"]
    assert verdict_cli.main(argv) == 0
    assert "✅ SUCCESS" in capsys.readouterr().out


def test_replicas_that_never_meet_fail(capsys) -> None:
    argv = ["torch", "--model", "mlp", "--recipe", "tests.mesh_recipes:ddp_on_shard_only",
            "--mesh", "dp_replicate=2,dp_shard=2,cp=1,tp=1", "--layers", "1", "--hidden", "8"]
    assert verdict_cli.main(argv) == 1
    assert "❌ FAIL" in capsys.readouterr().out


def test_a_bad_mesh_is_one_line_exit_2(capsys) -> None:
    assert verdict_cli.main(["torch", "--model", "mlp", "--mesh", "tp=2,dp=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: mesh tp=2,dp=2")
