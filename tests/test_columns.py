"""Columnar plans: round trips, reading by content, hostile and truncated files."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
import pytest

import main
from backends.columnar import MEMBERS, columns_bytes, load_columns_file
from backends.planfile import PlanError, load_plan, save_plan
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from verdict.columns import Columns, trim_heap

LLAMA = ModelConfig("llama3", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=32,
                    seqlen=4, optimizer="adam")


@cache
def plan():
    return make_plan(LLAMA, Parallelism(dp=4, tp=2, pp=2, nm=2), 16,
                     policy=Policy(vocab_parallel=True))


def members(cols: Columns) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(columns_bytes(cols)), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def write(path: Path, arrays: dict[str, np.ndarray], compressed: bool = False) -> Path:
    with open(path, "wb") as f:
        (np.savez_compressed if compressed else np.savez)(f, **arrays)
    return path


def test_round_trip_in_memory_and_on_disk(tmp_path):
    p = plan()
    cols = Columns.from_plan(p)
    assert cols.to_plan() == p
    save_plan(p, tmp_path / "p.npz")
    assert load_plan(tmp_path / "p.npz") == p
    # read by content: a columnar file named .pkl, a pickle named .npz
    shutil.copy(tmp_path / "p.npz", tmp_path / "q.pkl")
    assert load_plan(tmp_path / "q.pkl") == p
    save_plan(p, tmp_path / "r.pkl")
    shutil.copy(tmp_path / "r.pkl", tmp_path / "s.npz")
    assert load_plan(tmp_path / "s.npz") == p


def test_shared_inputs_are_stored_once():
    p = make_plan(ModelConfig("mlp", layers=2, hidden=8), Parallelism(dp=32), 32)
    cols = Columns.from_plan(p)
    reducers = [n for n in p.nodes if n.op == "reducer"]
    assert reducers and len(cols.nodes.inputs) < sum(len(n.inputs) for n in reducers)
    back = cols.to_plan()
    assert back == p
    assert cols.nbytes() / len(p.nodes) < 120


def test_sub_plan_of_some_nodes():
    p = plan()
    cols = Columns.from_plan(p)
    sub = cols.to_plan(nodes=[3, 4])
    assert [n.op for n in sub.nodes] == [p.nodes[3].op, p.nodes[4].op]
    used = {t for n in p.nodes[3:5] for t in (*n.inputs, *n.outputs) if t >= 0}
    assert sorted(sub.tensors) == sorted(p.tensors[t] for t in used)


def test_convert_command(tmp_path, capsys):
    save_plan(plan(), tmp_path / "p.pkl")
    assert main.main(["--convert", str(tmp_path / "p.pkl"), str(tmp_path / "p.npz")]) == 0
    assert load_plan(tmp_path / "p.npz") == plan()
    assert (tmp_path / "p.json").exists()


def _refused(path: Path, capsys, needle: str) -> None:
    with pytest.raises(PlanError) as err:
        load_columns_file(path)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert main.main(["--convert", str(path), str(path.with_name("out.npz"))]) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith("error: ") and needle in line
    assert not path.with_name("out.npz").exists()


def test_truncated_files_are_refused(tmp_path, capsys):
    blob = columns_bytes(Columns.from_plan(plan()))
    for cut in (0, 10, len(blob) // 3, len(blob) // 2, len(blob) - 30, len(blob) - 1):
        path = tmp_path / f"cut{cut}.npz"
        path.write_bytes(blob[:cut] if cut else b"PK\x03\x04")
        with pytest.raises(PlanError):
            load_plan(path)
    path = tmp_path / "cut.npz"
    path.write_bytes(blob[: len(blob) // 2])
    _refused(path, capsys, "cut.npz")


def test_flipped_bytes_never_escape(tmp_path):
    """Any damaged file is refused with a PlanError or loads as a valid plan."""
    blob = bytearray(columns_bytes(Columns.from_plan(plan())))
    rng = np.random.default_rng(0)
    for k in range(60):
        bad = bytearray(blob)
        for pos in rng.integers(0, len(bad), size=3):
            bad[pos] ^= int(rng.integers(1, 256))
        path = tmp_path / f"f{k}.npz"
        path.write_bytes(bytes(bad))
        try:
            load_plan(path)
        except PlanError as e:
            assert "\n" not in str(e)


def test_code_and_compression_are_refused(tmp_path, capsys):
    arrays = members(Columns.from_plan(plan()))
    objects = dict(arrays, n_rank=np.array([print], dtype=object))
    path = tmp_path / "obj.npz"
    with open(path, "wb") as f:
        np.savez(f, allow_pickle=True, **objects)
    _refused(path, capsys, "holds Python objects")
    _refused(write(tmp_path / "zip.npz", arrays, compressed=True), capsys, "compressed")
    _refused(write(tmp_path / "more.npz", dict(arrays, extra=np.zeros(1))), capsys,
             "unknown member")
    less = {k: v for k, v in arrays.items() if k != "n_outputs"}
    _refused(write(tmp_path / "less.npz", less), capsys, "missing member")
    pickled = tmp_path / "pickled.npz"
    pickled.write_bytes(b"PK\x03\x04" + pickle.dumps(print))
    _refused(pickled, capsys, "pickled.npz")
    assert set(arrays) == set(MEMBERS)


def _header(arrays, **changes):
    header = json.loads(bytes(arrays["header"]))
    header.update(changes)
    return dict(arrays, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))


def test_bad_contents_are_refused(tmp_path, capsys):
    cols = Columns.from_plan(plan())
    arrays = members(cols)
    cases = {
        "version": (_header(arrays, version=9), "unsupported columnar plan version 9"),
        "op": (_header(arrays, ops=["rm_rf", *cols.ops[1:]]), "unknown operator"),
        "float": (dict(arrays, t_rank=arrays["t_rank"].astype(float)), "int8, int16, int32 or int64"),
    }
    n_in = arrays["n_inputs"].astype(np.int64)
    n_in[np.flatnonzero(n_in >= 0)[0]] = len(cols.tensors) + 5
    cases["index"] = (dict(arrays, n_inputs=n_in), "is not a tensor index")
    sl = arrays["t_slices"].astype(np.int64)
    sl[0, 1] = 10**6
    cases["slice"] = (dict(arrays, t_slices=sl), "outside the logical shape")
    outs = arrays["n_outputs"].copy()
    outs[1] = outs[0]
    cases["twice"] = (dict(arrays, n_outputs=outs), "already written")
    ver = arrays["t_version"].copy()
    first_dup = _same_but_version(cols)
    ver[first_dup[1]] = ver[first_dup[0]]
    cases["key"] = (dict(arrays, t_version=ver), "same (rank, mb, tid, version)")
    fw = _reader_of_computed(cols)
    order = arrays["n_op"].copy()
    cases["order"] = (_swap_nodes(arrays, fw), "before node")
    assert order is not None
    for name, (bad, needle) in cases.items():
        _refused(write(tmp_path / f"{name}.npz", bad), capsys, needle)


def _same_but_version(cols: Columns) -> tuple[int, int]:
    t = cols.tensors
    seen = {}
    for i in range(len(t.rank)):
        key = (int(t.rank[i]), int(t.mb[i]), int(t.tid[i]))
        if key in seen:
            return seen[key], i
        seen[key] = i
    raise AssertionError("no tensor with two versions")


def _reader_of_computed(cols: Columns) -> int:
    """A node reading a tensor its predecessor writes."""
    for i in range(1, len(cols.nodes)):
        if set(cols.inputs_of(i).tolist()) & set(cols.outputs_of(i - 1).tolist()):
            return i
    raise AssertionError("no such node")


def _swap_nodes(arrays, i):
    """Nodes i - 1 and i exchanged in every node column (outputs included)."""
    out = dict(arrays)
    perm = np.arange(len(arrays["n_rank"]))
    perm[[i - 1, i]] = perm[[i, i - 1]]
    for k in ("n_rank", "n_mb", "n_op", "n_dir", "n_kwargs", "n_name", "n_in_start",
              "n_in_count"):
        out[k] = arrays[k][perm]
    off = arrays["n_out_off"]
    pieces = [arrays["n_outputs"][off[j]: off[j + 1]] for j in perm]
    out["n_outputs"] = np.concatenate(pieces)
    out["n_out_off"] = np.concatenate([[0], np.cumsum([len(x) for x in pieces])]).astype(
        off.dtype)
    return out


def test_absent_slot_only_in_backward(tmp_path, capsys):
    cols = Columns.from_plan(plan())
    fw = int(np.flatnonzero((cols.nodes.dir == 0) & (cols.nodes.in_count > 0))[0])
    pool = np.array(cols.nodes.inputs)
    pool[int(cols.nodes.in_start[fw])] = -1
    bad = replace(cols, nodes=replace(cols.nodes, inputs=pool))
    arrays = members(cols)
    arrays["n_inputs"] = bad.nodes.inputs
    _refused(write(tmp_path / "absent.npz", arrays), capsys, "absent slot")


def test_slices_checked_in_chunks(monkeypatch):
    """The slice check runs over chunks of tensors; one in a later chunk is found."""
    import backends.columnar as columnar

    monkeypatch.setattr(columnar, "_CHUNK", 5)
    cols = Columns.from_plan(plan())
    columnar.validate_columns(cols)
    off = cols.tensors.slice_offsets(cols.logical)
    victim = next(i for i in range(len(cols.tensors) - 1, 0, -1) if off[i + 1] > off[i])
    sl = cols.tensors.slices.astype(np.int64)
    sl[off[victim], 1] = 10**6
    bad = replace(cols, tensors=replace(cols.tensors, slices=sl))
    with pytest.raises(PlanError, match=f"tensor {victim}: slice"):
        columnar.validate_columns(bad)


def test_main_verifies_columnar_files(tmp_path, capsys):
    """Columnar plans verify as their pickles do: the equivalent pair exits
    0, the wrong plan 1 (main.py reads each file by its content)."""
    from helpers import mlp_plan_files

    files = mlp_plan_files(tmp_path, Parallelism(dp=4, tp=2))
    for name, path in files.items():
        assert main.main(["--convert", str(path), str(path.with_suffix(".npz"))]) == 0
        files[name] = path.with_suffix(".npz")
    flags = ["--no_cache_stages", "--stats_dir", str(tmp_path / "stats"), "--cache_dir",
             str(tmp_path / "cache"), "--log_dir", str(tmp_path / "logs")]
    capsys.readouterr()
    assert main.main(["--sm", str(files["single"]), "--pm", str(files["parallel"]), *flags]) == 0
    assert "SUCCESS" in capsys.readouterr().out
    assert main.main(["--sm", str(files["single"]), "--pm", str(files["wrong"]), *flags]) == 1
    assert "FAIL" in capsys.readouterr().out


def scaled_plan():
    p = plan()
    tensors = list(p.tensors)
    tensors[3] = tensors[3]._replace(scale=(1, 2))
    tensors[7] = tensors[7]._replace(scale=(-3, 4))
    return replace(p, tensors=tensors)


def test_scales_round_trip_and_are_checked(tmp_path, capsys):
    p = scaled_plan()
    cols = Columns.from_plan(p)
    assert cols.to_plan() == p
    save_plan(p, tmp_path / "s.npz")
    assert load_plan(tmp_path / "s.npz") == p
    assert Columns.from_plan(plan()).tensors.scale is None
    arrays = members(cols)
    for bad_scale, name in (([0, 1], "zero"), ([1, -2], "negative")):
        scale = arrays["t_scale"].astype(np.int64)
        scale[3] = bad_scale
        _refused(write(tmp_path / f"{name}.npz", dict(arrays, t_scale=scale)), capsys,
                 "tensor 3: scale")


def test_a_node_writing_one_tensor_twice_is_refused(tmp_path, capsys):
    cols = Columns.from_plan(plan())
    arrays = members(cols)
    off = arrays["n_out_off"]
    i = int(np.flatnonzero(np.diff(off) >= 2)[0])
    outs = arrays["n_outputs"].copy()
    outs[off[i] + 1] = outs[off[i]]
    _refused(write(tmp_path / "same.npz", dict(arrays, n_outputs=outs)), capsys, "already written")


def test_trim_heap_keeps_live_arrays():
    """Giving the heap's free pages back leaves every live array as it was
    (BlockCheck.finish trims after the passes' temporaries are freed)."""
    kept = np.arange(1 << 16, dtype=np.int64)
    freed = [np.full(1 << 15, i, dtype=np.int64) for i in range(64)]
    del freed[::2]
    assert trim_heap() in (True, False)
    assert (kept == np.arange(1 << 16)).all()
    assert all((a == 2 * i + 1).all() for i, a in enumerate(freed))


def _world(data: dict, **extra) -> dict:
    return {**data["world"], **extra}


#: Defects of what both plan forms hold alike (the world, the logical tensors,
#: the loss and gradients), each made in the plan data and in a columnar header.
SHARED_DEFECTS = {
    "world value": lambda d: {"world": _world(d, dp=[1])},
    "fold keys": lambda d: {"world": _world(d, fold_dp=4)},
    "logical kind": lambda d: {"logical": [[*d["logical"][0][:2], "weird"], *d["logical"][1:]]},
    "loss": lambda d: {"loss": 10**6},
    "grads": lambda d: {"grads": [*d["grads"], d["grads"][0]]},
}


@pytest.mark.parametrize("defect", SHARED_DEFECTS)
def test_both_readers_refuse_a_shared_defect_alike(tmp_path, defect):
    """The plan-file and columnar readers check the world, the logical
    tensors, the loss and gradients through one code path
    (backends/plancheck.py): one defect, one message."""
    from backends.planfile import validate

    data = plan().to_data()
    change = SHARED_DEFECTS[defect](data)
    version = {"version": 2} if defect == "fold keys" else {}  # a pickled plan's fold keys need 2
    with pytest.raises(PlanError) as pickled:
        validate({**data, **change, **version})
    arrays = _header(members(Columns.from_plan(plan())), **change)
    with pytest.raises(PlanError) as columnar:
        load_columns_file(write(tmp_path / "bad.npz", arrays))
    assert pickled.value.problem == columnar.value.problem, (pickled.value, columnar.value)
