"""The torch suite's case selection: -k, --exact and --shard pick each case
once, so that shards run side by side cover the suite exactly."""

import runpy
from pathlib import Path

import pytest

SUITE = runpy.run_path(str(Path(__file__).parent.parent / "scripts" / "torch_suite.py"))


def listed(capsys, *argv: str) -> list[str]:
    assert SUITE["main"](["--list", *argv]) == 0
    return [line.split(" exit ")[0].strip() for line in capsys.readouterr().out.splitlines()]


def test_shards_cover_the_suite_once(capsys) -> None:
    everything = listed(capsys)
    shards = [listed(capsys, "--shard", f"{i}/3") for i in range(3)]
    assert sorted(sum(shards, [])) == sorted(everything)


def test_exact_picks_one_name_that_k_would_widen(capsys) -> None:
    name = SUITE["CASES"][0][0]
    assert listed(capsys, "--exact", name) == [name]
    assert set(listed(capsys, "-k", name)) >= {name}


def test_bad_shard_is_refused() -> None:
    with pytest.raises(SystemExit) as e:
        SUITE["main"](["--list", "--shard", "2/2"])
    assert e.value.code == 2
