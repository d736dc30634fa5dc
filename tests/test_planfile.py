"""Plan files: round trips, atomic writes, and one clear PlanError for every bad file."""

from __future__ import annotations

import ast
import builtins
import collections
import copy
import json
import os
import pickle
import random
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.planfile import PlanError, load_plan, load_world, save_plan, validate
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from verdict.numeric import execute, final_values
from verdict.plan import Node, Plan

CONFIGS = {
    "mlp": ModelConfig("mlp", layers=2, hidden=8),
    "llama3": ModelConfig(
        "llama3", layers=1, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=11, seqlen=4
    ),
    "moe": ModelConfig(
        "moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=11, seqlen=4,
        experts=4, topk=2, moe_ffn=8, first_dense=1,
    ),
}


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: make_plan(cfg, Parallelism(), 2) for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="module")
def tiny_plan() -> Plan:
    """mlp, one 2x2 layer, cross-entropy loss. Tensors: 0 x, 1 weight, 2 the
    layer's output (logical tensor 3: logical 1 is the labels), then the loss
    computation and the backward; the last two are the grad buffer v0 and
    v1. Nodes: 0 linear fw, 1 detach fw, then the loss, ..., zeros,
    accumulate."""
    return make_plan(ModelConfig("mlp", layers=1, hidden=2), Parallelism(), 2)


@pytest.fixture
def tiny(tiny_plan: Plan) -> dict[str, Any]:
    return copy.deepcopy(tiny_plan.to_data())


def write_pickle(path: Path, obj: Any, protocol: int = pickle.HIGHEST_PROTOCOL) -> Path:
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


def load_error(path: Path, *fragments: str) -> str:
    """Load ``path``, expect a PlanError naming the file and every fragment; return it."""
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message
    return message


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("model", list(CONFIGS))
def test_round_trip(plans: dict[str, Plan], tmp_path: Path, model: str) -> None:
    plan = plans[model]
    pkl, spec = save_plan(plan, tmp_path / f"{model}.pkl")
    assert (pkl, spec) == (tmp_path / f"{model}.pkl", tmp_path / f"{model}.json")
    loaded = load_plan(pkl)
    assert loaded == plan
    assert loaded.to_data() == plan.to_data()
    assert load_world(pkl) == plan.world
    expected, got = execute(plan, seed=3), execute(loaded, seed=3)
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)
    want, have = final_values(plan, expected), final_values(loaded, got)
    assert want.keys() == have.keys()
    assert all(np.array_equal(want[k], have[k]) for k in want)


def test_world_spec_written_beside(tiny_plan: Plan, tmp_path: Path) -> None:
    save_plan(tiny_plan, tmp_path / "deep" / "dir" / "mlp_default.pkl")
    spec = tmp_path / "deep" / "dir" / "mlp_default.json"
    assert spec.read_text() == json.dumps(tiny_plan.world, indent=2, sort_keys=True) + "\n"
    assert json.loads(spec.read_text()) == tiny_plan.world


def test_plan_loads_without_world_spec(tiny_plan: Plan, tmp_path: Path) -> None:
    pkl, spec = save_plan(tiny_plan, tmp_path / "plan.pkl")
    spec.unlink()
    assert load_plan(pkl) == tiny_plan
    with pytest.raises(PlanError, match="plan.json: no such file"):
        load_world(pkl)


def test_wrong_operator_shape_still_loads(tiny: dict, tmp_path: Path) -> None:
    """Shape rules are the verifier's findings, not load errors."""
    tiny["logical"][tiny["tensors"][2][2]][1] = [2, 3]
    tiny["tensors"][2][4] = [2, 3]
    tiny["tensors"][2][6] = [[0, 2], [0, 3]]
    plan = load_plan(write_pickle(tmp_path / "plan.pkl", tiny))
    assert plan.tensors[2].shape == (2, 3)


def test_tuples_are_accepted_for_lists(tiny: dict, tmp_path: Path) -> None:
    tiny["tensors"] = [tuple(row) for row in tiny["tensors"]]
    tiny["nodes"][0][4] = tuple(tiny["nodes"][0][4])
    assert load_plan(write_pickle(tmp_path / "plan.pkl", tiny)).nodes[0].inputs == (0, 1)


# ---------------------------------------------------------------- atomic writes


def test_save_leaves_no_temp_files(plans: dict[str, Plan], tmp_path: Path) -> None:
    for model, plan in plans.items():
        save_plan(plan, tmp_path / f"{model}.pkl")
        save_plan(plan, tmp_path / f"{model}.pkl")  # overwrite too
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"{m}.{ext}" for m in plans for ext in ("json", "pkl"))


def test_crash_keeps_the_old_file(
    plans: dict[str, Plan], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkl, spec = save_plan(plans["mlp"], tmp_path / "plan.pkl")
    before = pkl.read_bytes(), spec.read_bytes()

    def crash(src: Any, dst: Any) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk on fire"):
        save_plan(plans["moe"], pkl)
    monkeypatch.undo()
    assert (pkl.read_bytes(), spec.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "plan.pkl"]


def test_save_refuses_what_load_would_refuse(tiny_plan: Plan, tmp_path: Path) -> None:
    broken = copy.deepcopy(tiny_plan)
    broken.nodes[0] = broken.nodes[0]._replace(op="frobnicate")
    with pytest.raises(PlanError, match="cannot save: node 0: unknown operator 'frobnicate'"):
        save_plan(broken, tmp_path / "a.pkl")
    not_plain = copy.deepcopy(tiny_plan)
    node = not_plain.nodes[1]
    not_plain.nodes[1] = Node(*node[:6], {**node.kwargs, "dim": np.int64(0)}, node.name)
    with pytest.raises(PlanError, match=r"cannot save: holds a int64 np.int64\(0\), which is not plain data"):
        save_plan(not_plain, tmp_path / "b.pkl")

    class Size(int):
        pass

    subclass = copy.deepcopy(tiny_plan)
    t = subclass.tensors[0]
    subclass.tensors[0] = t._replace(rank=Size(0))
    with pytest.raises(PlanError, match="cannot save: holds a Size 0"):
        save_plan(subclass, tmp_path / "b.pkl")
    with pytest.raises(PlanError, match="may not end in .json"):
        save_plan(tiny_plan, tmp_path / "c.json")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- unreadable files


def test_missing_file(tmp_path: Path) -> None:
    load_error(tmp_path / "nope.pkl", "no such file")


def test_directory(tmp_path: Path) -> None:
    (tmp_path / "dir.pkl").mkdir()
    load_error(tmp_path / "dir.pkl", "is a directory")


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.pkl").write_bytes(b"")
    load_error(tmp_path / "empty.pkl", "empty file")


def test_truncated_pickle(tiny: dict, tmp_path: Path) -> None:
    blob = pickle.dumps(tiny, protocol=pickle.HIGHEST_PROTOCOL)
    (tmp_path / "half.pkl").write_bytes(blob[: len(blob) // 2])
    load_error(tmp_path / "half.pkl", "truncated")


def test_every_prefix_is_refused(tmp_path: Path) -> None:
    # the plain-sum plan: a third of the cross-entropy plan's bytes, the same structure
    small = make_plan(ModelConfig("mlp", layers=1, hidden=2, loss="sum"), Parallelism(), 2)
    for protocol in (0, pickle.HIGHEST_PROTOCOL):
        blob = pickle.dumps(small.to_data(), protocol=protocol)
        path = tmp_path / f"cut{protocol}.pkl"
        for cut in range(len(blob)):
            path.write_bytes(blob[:cut])
            load_error(path)


def test_trailing_bytes(tiny: dict, tmp_path: Path) -> None:
    path = tmp_path / "tail.pkl"
    path.write_bytes(pickle.dumps(tiny) + pickle.dumps(tiny))
    load_error(path, "trailing bytes")


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "noise.pkl"
    for seed in range(50):
        path.write_bytes(random.Random(seed).randbytes(512))
        load_error(path)
    path.write_bytes(random.Random(0).randbytes(512))
    load_error(path, "not a pickle")


def test_flipped_bytes_never_escape(tiny: dict, tmp_path: Path) -> None:
    """A corrupted plan either loads (the flip hit a harmless number) or gives a PlanError."""
    blob = bytearray(pickle.dumps(tiny, protocol=pickle.HIGHEST_PROTOCOL))
    path = tmp_path / "flip.pkl"
    rng = random.Random(1)
    for _ in range(400):
        bad = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        path.write_bytes(bytes(bad))
        try:
            load_plan(path)
        except PlanError as e:
            assert str(e).startswith(f"{path}: ") and "\n" not in str(e)


def test_json_renamed_to_pkl(tiny_plan: Plan, tmp_path: Path) -> None:
    _, spec = save_plan(tiny_plan, tmp_path / "real.pkl")
    fake = tmp_path / "fake.pkl"
    fake.write_bytes(spec.read_bytes())
    load_error(fake, "not a pickle")


def test_not_a_dict(tiny: dict, tmp_path: Path) -> None:
    load_error(write_pickle(tmp_path / "list.pkl", list(tiny.items())), "is a list, not a dict")


def test_wrong_format(tiny: dict, tmp_path: Path) -> None:
    tiny["format"] = "other-plan"
    load_error(write_pickle(tmp_path / "fmt.pkl", tiny), "not a verdict plan", "'other-plan'")


def test_wrong_version(tiny: dict, tmp_path: Path) -> None:
    tiny["version"] = 4
    load_error(
        write_pickle(tmp_path / "v4.pkl", tiny),
        "unsupported plan version 4", "reads versions 1, 2 and 3",
    )


def test_bool_version(tiny: dict, tmp_path: Path) -> None:
    tiny["version"] = True  # == 1 in Python, but not an int here
    load_error(write_pickle(tmp_path / "vb.pkl", tiny), "version must be an int, got bool")


# ---------------------------------------------------------------- invalid data

Mutation = Callable[[dict], Any]


def _swap_first_nodes(d: dict) -> None:
    d["nodes"][0], d["nodes"][1] = d["nodes"][1], d["nodes"][0]


def _set_slices(d: dict, slices: list, shape: list) -> None:
    d["tensors"][0][6] = slices
    d["tensors"][0][4] = shape


BAD_DATA: list[tuple[str, Mutation, str]] = [
    ("missing key", lambda d: d.pop("grads"), "missing field 'grads'"),
    ("unknown key", lambda d: d.update(extra=1), "unknown field 'extra'"),
    ("bool rank", lambda d: d["tensors"][1].__setitem__(0, True),
     "tensor 1: rank must be an int, got bool"),
    ("bool loss", lambda d: d.update(loss=True), "field 'loss' must be an int, got bool"),
    ("huge int", lambda d: d["tensors"][0].__setitem__(0, 10**5000),
     "tensor 0: rank does not fit in 64 bits"),
    ("world not dict", lambda d: d.update(world=[]), "field 'world' must be a dict"),
    ("world nested", lambda d: d["world"].update(dp=[1]), "world 'dp': value must be"),
    ("logical kind", lambda d: d["logical"][0].__setitem__(2, "weights"),
     "logical 0 ('x'): kind 'weights' is not one of"),
    ("logical shape", lambda d: d["logical"][0].__setitem__(1, [-1, 2]),
     "logical 0: shape[0] must be >= 0"),
    ("tensor row", lambda d: d["tensors"].__setitem__(0, d["tensors"][0][:7]),
     "tensor 0: must be a list [rank, mb, tid, version, shape, lver, slices, parts], got 7"),
    ("tensor mb", lambda d: d["tensors"][0].__setitem__(1, -2), "tensor 0: mb must be >= -1"),
    ("tensor tid", lambda d: d["tensors"][0].__setitem__(2, 99),
     "tensor 0: tid 99 is not a logical id"),
    ("slice out of bounds", lambda d: _set_slices(d, [[0, 3], [0, 2]], [3, 2]),
     "tensor 0: slice [0, 3] of dim 0 is outside the logical shape [2, 2]"),
    ("empty slice", lambda d: _set_slices(d, [[1, 1], [0, 2]], [0, 2]),
     "tensor 0: slice [1, 1] of dim 0 is outside"),
    ("slice count", lambda d: _set_slices(d, [[0, 2]], [2]),
     "tensor 0: slices must have 2 entries, got 1"),
    ("slice pair", lambda d: _set_slices(d, [[0, 2, 4], [0, 2]], [2, 2]),
     "tensor 0: slices[0] must have 2 entries, got 3"),
    ("shape vs slices", lambda d: d["tensors"][0].__setitem__(4, [2, 3]),
     "tensor 0: shape [2, 3] does not match its slices"),
    ("parts", lambda d: d["tensors"][0].__setitem__(7, [1, 1, 2]),
     "tensor 0: parts [1, 1, 2] must satisfy 0 <= lo < hi <= |n|"),
    ("max parts", lambda d: d["tensors"][0].__setitem__(7, [2, 3, -2]),
     "tensor 0: parts [2, 3, -2] must satisfy 0 <= lo < hi <= |n|"),
    ("duplicate tensor", lambda d: d["tensors"].append(list(d["tensors"][0])),
     "same (rank, mb, tid, version) (0, 0, 0, 0) as tensor 0"),
    ("index out of range", lambda d: d["nodes"][0].__setitem__(4, [0, 99]),
     "node 0 (linear on rank 0 mb 0): input 99 is not a tensor index (plan has 34 tensors)"),
    ("index -2", lambda d: d["nodes"][3].__setitem__(4, [-2, 4]),
     "node 3 (multiref on rank 0 mb 0): input -2 is not a tensor index"),
    ("output out of range", lambda d: d["nodes"][0].__setitem__(5, [99]),
     "node 0 (linear on rank 0 mb 0): output 99 is not a tensor index"),
    ("-1 in fw node", lambda d: d["nodes"][0].__setitem__(4, [-1, 1]),
     "node 0 (linear on rank 0 mb 0): input -1 (absent slot) is allowed only in bw nodes"),
    ("written twice", lambda d: d["nodes"][2].__setitem__(5, [2]),
     "node 2 (max on rank 0 mb 0): tensor 2 is already written by node 0"),
    ("written twice by one node", lambda d: d["nodes"][0].__setitem__(5, [2, 2]),
     "node 0 (linear on rank 0 mb 0): tensor 2 is already written by node 0"),
    ("read before write", _swap_first_nodes,
     "node 0 (detach on rank 0 mb 0): reads tensor 2 before node 1 writes it"),
    ("reads own output", lambda d: d["nodes"][1].__setitem__(5, [2]) or d["nodes"].pop(0),
     "node 0 (detach on rank 0 mb 0): tensor 2 is both an input and an output"),
    ("unknown op", lambda d: d["nodes"][0].__setitem__(2, "frobnicate"),
     "node 0: unknown operator 'frobnicate'"),
    ("bad dir", lambda d: d["nodes"][0].__setitem__(3, "sideways"),
     "node 0 (linear on rank 0 mb 0): dir 'sideways' is not one of"),
    ("node row", lambda d: d["nodes"][0].pop(), "node 0: must be a list [rank, mb, op,"),
    ("kwargs key", lambda d: d["nodes"][1].__setitem__(6, {1: 2}),
     "node 1 (detach on rank 0 mb 0): kwargs key must be a str, got int"),
    ("kwargs type", lambda d: d["nodes"][1].__setitem__(6, []), "kwargs must be a dict"),
    ("node name", lambda d: d["nodes"][1].__setitem__(7, None), "name must be a str"),
    ("loss range", lambda d: d.update(loss=99), "loss 99 is not a logical id"),
    ("grads pair", lambda d: d.update(grads=[[1]]), "grad 0: entry must have 2 entries"),
    ("grads bool", lambda d: d.update(grads=[[True, 7]]), "grad 0: entry[0] must be an int"),
    ("grads range", lambda d: d.update(grads=[[1, 70]]), "grad 0: grad 70 is not a logical id"),
    ("grads twice", lambda d: d.update(grads=[[1, 7], [1, 7]]),
     "grad 1: param 1 already has a gradient (grad 0)"),
]


@pytest.mark.parametrize(
    ("mutate", "fragment"), [case[1:] for case in BAD_DATA], ids=[case[0] for case in BAD_DATA]
)
def test_invalid_data(tiny: dict, tmp_path: Path, mutate: Mutation, fragment: str) -> None:
    mutate(tiny)
    with pytest.raises(PlanError) as info:
        validate(tiny)
    assert str(info.value) == info.value.problem  # no path from validate() itself
    load_error(write_pickle(tmp_path / "bad.pkl", tiny), fragment)


def test_valid_data_passes(tiny: dict) -> None:
    validate(tiny)


# ---------------------------------------------------------------- world spec


def test_world_spec_mismatch(tiny_plan: Plan, tmp_path: Path) -> None:
    pkl, spec = save_plan(tiny_plan, tmp_path / "plan.pkl")
    spec.write_text(json.dumps({**tiny_plan.world, "gbs": 4}))
    load_error(pkl, "world spec plan.json does not match the plan", "'gbs' is 4 in the JSON")


def test_world_spec_invalid(tiny_plan: Plan, tmp_path: Path) -> None:
    pkl, spec = save_plan(tiny_plan, tmp_path / "plan.pkl")
    spec.write_text("{not json")
    with pytest.raises(PlanError, match=r"plan\.json: not valid JSON"):
        load_plan(pkl)
    spec.write_text("[1, 2]")
    with pytest.raises(PlanError, match=r"plan\.json: world spec is a JSON list, not an object"):
        load_world(pkl)
    spec.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PlanError, match=r"plan\.json: not valid JSON"):
        load_world(pkl)


# ---------------------------------------------------------------- hostile pickles


class Payload:
    """Unpickling this calls ``func(*args)``: what a malicious plan would do."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def payloads(marker: Path) -> dict[str, tuple[Payload, str]]:
    return {
        "os.system": (Payload(os.system, f"touch {marker}"), f"{os.system.__module__}.system"),
        "eval": (Payload(builtins.eval, f"open({str(marker)!r}, 'w').close()"), "builtins.eval"),
        "subprocess": (Payload(subprocess.call, ["touch", str(marker)]), "subprocess.call"),
    }


#: Protocols 0-2 write Python 2 module names (pickle's fix_imports).
PY2_NAMES = {"builtins.eval": "__builtin__.eval", "subprocess.call": "commands.call"}


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("attack", ["os.system", "eval", "subprocess"])
def test_hostile_pickle_runs_nothing(
    tiny: dict, tmp_path: Path, attack: str, protocol: int
) -> None:
    marker = tmp_path / "pwned"
    payload, refused = payloads(marker)[attack]
    if protocol < 3:
        refused = PY2_NAMES.get(refused, refused)
    tiny["nodes"][1][6]["dim"] = payload  # hidden deep inside a valid plan
    path = write_pickle(tmp_path / "evil.pkl", tiny, protocol)
    load_error(path, f"refused global {refused}")
    assert not marker.exists()
    path = write_pickle(tmp_path / "bare.pkl", payload, protocol)
    load_error(path, f"refused global {refused}")
    assert not marker.exists()


@pytest.mark.parametrize("attack", ["os.system", "eval", "subprocess"])
def test_hostile_payloads_are_real(tmp_path: Path, attack: str) -> None:
    """Control: an ordinary unpickler does run them, so the test above means something."""
    marker = tmp_path / "pwned"
    payload, _ = payloads(marker)[attack]
    pickle.loads(pickle.dumps(payload))  # noqa: S301 - the point of the test
    assert marker.exists()


@dataclass
class Box:
    value: int


@pytest.mark.parametrize(
    ("obj", "refused"),
    [
        (collections.OrderedDict(a=1), "collections.OrderedDict"),
        (Box(1), "Box"),
        (Node(0, 0, "sum", "fw", (0,), (1,), {}), "verdict.plan.Node"),
    ],
    ids=["OrderedDict", "dataclass", "NamedTuple"],
)
def test_class_instances_refused(tiny: dict, tmp_path: Path, obj: Any, refused: str) -> None:
    tiny["nodes"][1][6]["dim"] = obj
    load_error(write_pickle(tmp_path / "inst.pkl", tiny), "refused global", refused)


def test_pickled_plan_object_refused(tiny_plan: Plan, tmp_path: Path) -> None:
    """Pickling the Plan itself instead of its to_data() is refused, not trusted."""
    load_error(write_pickle(tmp_path / "obj.pkl", tiny_plan), "refused global verdict.plan.Plan")


def test_persistent_id_refused(tmp_path: Path) -> None:
    path = tmp_path / "pid.pkl"
    path.write_bytes(b"Pfoo\n.")  # protocol 0 PERSID
    load_error(path, "refused persistent id")


# ---------------------------------------------------------------- PlanError


def test_plan_error_is_one_line_and_picklable(tmp_path: Path) -> None:
    err = PlanError("two\nlines", tmp_path / "x.pkl")
    assert str(err) == f"{tmp_path / 'x.pkl'}: two lines"
    assert isinstance(err, ValueError)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_docs_example_is_current() -> None:
    """The example in docs/plan-format.md is exactly this plan's to_data()."""
    text = (Path(__file__).parents[1] / "docs" / "plan-format.md").read_text()
    example = text.split("## Example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    plan = make_plan(ModelConfig("mlp", layers=1, hidden=2, loss="sum"), Parallelism(), 2)
    assert ast.literal_eval(example) == plan.to_data()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tiny: dict, tmp_path: Path) -> None:
    path = write_pickle(tmp_path / "secret.pkl", tiny)
    path.chmod(0)
    load_error(path, "not readable")


def test_huge_declared_length(tmp_path: Path) -> None:
    """A few bytes claiming a 2**60-byte string: refused without a traceback."""
    path = tmp_path / "huge.pkl"
    path.write_bytes(b"\x80\x05\x8e" + (2**60).to_bytes(8, "little") + b"abc")  # BINBYTES8
    load_error(path, "too large for memory")
