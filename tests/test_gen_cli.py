"""python -m gen_model: plan files named as DESIGN.md says, a JSON world spec
beside each, loadable by backends.planfile; bad flags exit 2 with one line."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backends.planfile import load_plan, load_world
from gen_model.__main__ import DEFAULT_HEADS, DEFAULT_SEQLEN, main, parser
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from verdict.numeric import execute, final_values

ROOT = Path(__file__).resolve().parents[1]

# {model}_{variant}_dp{D}_pp{P}_tp{T}_nm{M}_gbs{G}_ly{L}_h{H}_hi{I}_sq{S}[_ep{E}_a{A}_r{R}]
NAME = re.compile(
    r"^(?P<model>[a-z0-9]+)_(?P<variant>default|br\d+)_dp(?P<dp>\d+)_pp(?P<pp>\d+)_tp(?P<tp>\d+)"
    r"_nm(?P<nm>\d+)_gbs(?P<gbs>\d+)_ly(?P<layers>\d+)_h(?P<heads>\d+)_hi(?P<hidden>\d+)"
    r"_sq(?P<seqlen>\d+)(?:_ep(?P<ep>\d+)_a(?P<topk>\d+)_r(?P<experts>\d+))?\.pkl$"
)

MLP = ["--model", "mlp", "--layers", "2", "--hidden", "8"]
LLAMA = ["--model", "llama3", "--layers", "1", "--hidden", "16", "--heads", "4",
         "--kv_heads", "2", "--ffn", "24", "--vocab", "12", "--seqlen", "4"]
MOE = ["--model", "moe", "--layers", "2", "--hidden", "16", "--heads", "4", "--kv_heads", "2",
       "--ffn", "24", "--vocab", "12", "--seqlen", "4", "--experts", "4", "--topk", "2",
       "--moe_ffn", "8", "--first_dense", "1"]


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str, str]:
    """Exit code, stdout and stderr of ``main(argv)`` run in-process.

    An exception escaping main() is what the real CLI would print as a
    traceback; it is reported as such instead of erroring the test.
    """
    try:
        code: object = main(argv)
    except SystemExit as e:
        code = e.code
    except Exception as e:  # the CLI would die with a traceback
        code = f"uncaught {type(e).__name__}: {e}"
        out, err = capsys.readouterr()
        return code, out, err + "\nTraceback (uncaught exception in main)"
    out, err = capsys.readouterr()
    return code, out, err


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def expected_name(model: str, d: int, p: int, t: int, m: int, g: int, ly: int, h: int, hi: int,
                  sq: int, moe: tuple[int, int, int] | None = None) -> str:
    name = f"{model}_default_dp{d}_pp{p}_tp{t}_nm{m}_gbs{g}_ly{ly}_h{h}_hi{hi}_sq{sq}"
    if moe is not None:
        name += "_ep{}_a{}_r{}".format(*moe)
    return name + ".pkl"


def check_written(out_dir: Path, name: str, stdout: str, world: dict) -> None:
    """Exactly the plan and its JSON world spec, named ``name``, loadable."""
    pkl = out_dir / name
    spec = pkl.with_suffix(".json")
    assert files_under(out_dir) == sorted([pkl, spec])
    m = NAME.match(name)
    assert m, name
    assert str(pkl) in stdout and str(spec) in stdout
    on_disk = json.loads(spec.read_text())
    assert load_world(pkl) == on_disk
    for key, value in world.items():
        assert on_disk[key] == value, (key, on_disk[key], value)
    # the name's fields agree with the world spec
    for key in ("dp", "pp", "tp", "nm", "gbs", "layers", "heads", "hidden", "seqlen"):
        assert int(m[key]) == on_disk[key], key
    if on_disk["model"] == "moe":
        assert (int(m["ep"]), int(m["topk"]), int(m["experts"])) == (
            on_disk["ep"], on_disk["topk"], on_disk["experts"])
    else:
        assert m["ep"] is None
    plan = load_plan(pkl)
    assert plan.world == on_disk
    ranks = {n.rank for n in plan.nodes}
    assert ranks == set(range(on_disk["dp"] * on_disk["tp"] * on_disk["pp"]))
    assert plan.logical[plan.loss].kind == "loss"
    assert plan.grads


# ---------------------------------------------------------------- single-device plans


def test_mlp_single(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([*MLP, "--gbs", "2", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    name = expected_name("mlp", 1, 1, 1, 1, 2, 2, 0, 8, 0)
    world = {"model": "mlp", "variant": "default", "dp": 1, "tp": 1, "pp": 1, "ep": 1, "nm": 1,
             "gbs": 2, "layers": 2, "hidden": 8}
    check_written(tmp_path, name, out, world)
    # the file holds the same plan as make_plan: same numbers when executed
    loaded = load_plan(tmp_path / name)
    fresh = make_plan(ModelConfig("mlp", layers=2, hidden=8), Parallelism(), 2)
    assert loaded.to_data() == fresh.to_data()
    a = final_values(loaded, execute(loaded, 3))
    b = final_values(fresh, execute(fresh, 3))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_llama3_single(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([*LLAMA, "--gbs", "2", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    name = expected_name("llama3", 1, 1, 1, 1, 2, 1, 4, 16, 4)
    world = {"model": "llama3", "dp": 1, "tp": 1, "pp": 1, "ep": 1, "nm": 1, "gbs": 2,
             "layers": 1, "heads": 4, "kv_heads": 2, "hidden": 16, "seqlen": 4, "vocab": 12,
             "ffn": 24, "experts": 0}
    check_written(tmp_path, name, out, world)


def test_moe_single(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([*MOE, "--gbs", "2", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    name = expected_name("moe", 1, 1, 1, 1, 2, 2, 4, 16, 4, moe=(1, 2, 4))
    capacity = math.ceil(4 * 2 / 4)
    world = {"model": "moe", "dp": 1, "tp": 1, "pp": 1, "ep": 1, "nm": 1, "gbs": 2,
             "layers": 2, "heads": 4, "hidden": 16, "seqlen": 4, "experts": 4, "topk": 2,
             "moe_ffn": 8, "first_dense": 1, "capacity": capacity}
    check_written(tmp_path, name, out, world)
    plan = load_plan(tmp_path / name)
    assert sum(n.op == "route" for n in plan.nodes) == 1  # one dense layer, one MoE layer


def test_defaults_fill_kv_heads_and_ffn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama3", "--layers", "1", "--hidden", "32", "--heads", "8",
            "--vocab", "12", "--seqlen", "2", "--gbs", "1", "-o", str(tmp_path)]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    name = expected_name("llama3", 1, 1, 1, 1, 1, 1, 8, 32, 2)
    spec = json.loads((tmp_path / name).with_suffix(".json").read_text())
    assert spec["kv_heads"] == 2 and spec["ffn"] == 112


# ---------------------------------------------------------------- parallel plans


def test_mlp_parallel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*MLP, "--gbs", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--nm", "2",
            "-o", str(tmp_path)]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    name = expected_name("mlp", 2, 2, 2, 2, 8, 2, 0, 8, 0)
    world = {"model": "mlp", "dp": 2, "tp": 2, "pp": 2, "ep": 1, "nm": 2, "gbs": 8}
    check_written(tmp_path, name, out, world)
    plan = load_plan(tmp_path / name)
    assert {n.mb for n in plan.nodes} >= {0, 1}
    assert len(plan.nodes) > len(make_plan(ModelConfig("mlp", layers=2, hidden=8),
                                           Parallelism(), 8).nodes)


def test_moe_parallel_with_ep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*MOE, "--gbs", "4", "--dp", "2", "--ep", "2", "--tp", "2", "--pp", "2", "--nm", "2",
            "-o", str(tmp_path)]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    name = expected_name("moe", 2, 2, 2, 2, 4, 2, 4, 16, 4, moe=(2, 2, 4))
    world = {"model": "moe", "dp": 2, "tp": 2, "pp": 2, "ep": 2, "nm": 2, "gbs": 4}
    check_written(tmp_path, name, out, world)


def test_variant_in_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([*MLP, "--gbs", "2", "--variant", "br3", "-o", str(tmp_path)],
                              capsys)
    assert code == 0, err
    name = "mlp_br3_dp1_pp1_tp1_nm1_gbs2_ly2_h0_hi8_sq0.pkl"
    assert NAME.match(name)
    assert files_under(tmp_path) == sorted([tmp_path / name, tmp_path / (name[:-4] + ".json")])
    assert load_plan(tmp_path / name).world["variant"] == "br3"


# ---------------------------------------------------------------- bad flags


BAD: dict[str, tuple[list[str], str | None]] = {
    "unknown_model": (["--model", "gpt", "--gbs", "2"], "gpt"),
    "hidden_not_div_heads": ([*LLAMA, "--hidden", "10", "--gbs", "2"], "--hidden"),
    "tp_not_div_heads": ([*LLAMA, "--tp", "3", "--gbs", "2"], "--tp"),
    "gbs_not_div_dp_nm": ([*MLP, "--gbs", "6", "--dp", "2", "--nm", "2"], "--gbs"),
    "pp_more_than_layers": ([*MLP, "--gbs", "2", "--pp", "3"], "--pp"),
    "ep_without_moe": ([*MLP, "--gbs", "2", "--dp", "2", "--ep", "2"], "--ep"),
    "layers_not_int": (["--model", "mlp", "--layers", "two", "--gbs", "2"], "--layers"),
    "missing_gbs": (["--model", "mlp", "--hidden", "8"], "--gbs"),
    "kv_heads_not_div": ([*LLAMA, "--kv_heads", "3", "--gbs", "2"], "--kv_heads"),
    "odd_head_dim": ([*LLAMA, "--hidden", "12", "--gbs", "2"], "head dim"),
    "topk_more_than_experts": ([*MOE, "--topk", "5", "--gbs", "2"], "--topk"),
    "experts_not_div_ep": ([*MOE, "--experts", "3", "--gbs", "4", "--dp", "2", "--ep", "2"],
                           "--ep"),
    "dp_zero": ([*MLP, "--gbs", "2", "--dp", "0"], "--dp"),
    # a global batch must hold at least one sample
    "gbs_zero": ([*MLP, "--gbs", "0"], "--gbs"),
    "gbs_negative": ([*MLP, "--gbs", "-2"], "--gbs"),
    # a capacity factor must be a positive finite number
    "capacity_factor_nan": ([*MOE, "--gbs", "2", "--capacity_factor", "nan"], "capacity"),
    "capacity_factor_negative": ([*MOE, "--gbs", "2", "--capacity_factor", "-1"], "capacity"),
    # the variant is a name part ('default' or br{N}), never a path
    "variant_with_slash": ([*MLP, "--gbs", "2", "--variant", "a/b"], "variant"),
    "cp_balance_without_cp": ([*LLAMA, "--gbs", "2", "--cp_balance"], "--cp_balance"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_flags_exit_2_with_one_line(case: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv, mentions = BAD[case]
    out_dir = tmp_path / "out"
    code, out, err = run_main([*argv, "-o", str(out_dir)], capsys)
    written = files_under(tmp_path)
    assert "Traceback" not in err, f"{case}: {code}"
    assert code == 2, f"{case}: exit {code!r}, stderr {err!r}, wrote {written}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "error" in lines[0]
    if mentions:
        assert mentions in lines[0], lines[0]
    assert written == []


# ---------------------------------------------------------------- the real process


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gen_model", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_subprocess_writes_plan(tmp_path: Path) -> None:
    r = run_cli(*MLP, "--gbs", "4", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    name = expected_name("mlp", 1, 1, 1, 1, 4, 2, 0, 8, 0)
    check_written(tmp_path, name, r.stdout, {"model": "mlp", "gbs": 4})


@pytest.mark.parametrize(
    "args,mentions",
    [
        (["--model", "gpt", "--gbs", "2"], "gpt"),
        ([*LLAMA, "--hidden", "10", "--gbs", "2"], "--hidden"),
        (["--model", "mlp", "--hidden", "8"], "--gbs"),
    ],
    ids=["unknown_model", "hidden_not_div_heads", "missing_gbs"],
)
def test_subprocess_bad_flags(args: list[str], mentions: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    r = run_cli(*args, "-o", str(out_dir))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and mentions in lines[0], r.stderr
    assert r.stdout == ""
    assert files_under(tmp_path) == []


@pytest.mark.parametrize(("argv", "hint"), [
    (["--heads", "4", "--hidden", "128", "--tp", "2"], "pass --kv_heads 2 "),
    (["--heads", "2", "--hidden", "4", "--tp", "4", "--kv_heads", "4"], None),
])
def test_a_default_tp_does_not_divide_names_the_value_to_pass(argv, hint, tmp_path, capsys):
    """The README's first example once failed on its default KV heads; the
    message now says which flag to pass and with what value."""
    base = ["--model", "llama3", "--layers", "1", "--vocab", "12", "--seqlen", "2", "--gbs", "2",
            "-o", str(tmp_path)]
    code, out, err = run_main([*base, *argv], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    if hint:
        assert hint in err and "single-device plan" in err


def test_help_gives_every_flag_a_help_and_its_default(capsys) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for action in parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
        takes_value = action.nargs != 0 and not action.required and action.dest != "help"
        if takes_value and action.default not in (None, 0) and "%(default)" not in action.help:
            assert "default" in action.help, f"{action.option_strings} shows no default"
    assert "microbatches" in text and "(default: 1)" in text


def test_llama3_without_heads_takes_the_documented_default(tmp_path: Path, capsys) -> None:
    code, out, err = run_main(["--model", "llama3", "--layers", "1", "--hidden", "16",
                               "--vocab", "12", "--gbs", "1", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    spec = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert spec["heads"] == DEFAULT_HEADS and spec["seqlen"] == DEFAULT_SEQLEN
