"""Plans that are wrong on their face are findings (exit 1), not refusals
(tests/tp_plan_mistakes.py; ``backends.torch.errors.WrongStep``): a
sequence-parallel plan on rows every tp rank holds whole makes a value
longer than the single-device one; a tie TP broke leaves a parameter the
single-device model ties to another. The re-tied plan verifies.
scripts/gloo_truth.py: differs, differs, same."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import main, parser, resolve, trace_and_build
from backends.torch.errors import WrongStep
from main import verify

TPM = "tests.tp_plan_mistakes:"


def _build(model: str, recipe: str, dp: int, tp: int):
    args = resolve(parser().parse_args(["--model", model, "--recipe", TPM + recipe,
                                        "--dp", str(dp), "--tp", str(tp)]))
    return trace_and_build(args)[0]


def test_sequence_parallel_plan_on_whole_rows_is_a_finding() -> None:
    with pytest.raises(WrongStep) as e:
        _build("mlp", "sp_mlp_on_whole_rows", 1, 2)
    assert "blocks.0.gate" in str(e.value) and "rank 0" in str(e.value)


def test_broken_tie_is_a_finding_naming_the_untied_weight(tmp_path, capsys) -> None:
    with pytest.raises(WrongStep) as e:
        _build("gpt2", "tied_head_untied_by_tp", 2, 2)
    assert "lm_head.weight" in str(e.value) and "wte.weight" in str(e.value)
    code = main(["--model", "gpt2", "--recipe", TPM + "tied_head_untied_by_tp", "--dp", "2",
                 "--tp", "2", "-o", str(tmp_path)])
    assert code == 1 and capsys.readouterr().out.startswith("FAIL: rank")


def test_tie_made_again_verifies() -> None:
    plan_s, plan_p = _build("gpt2", "tied_head_retied", 2, 2)
    assert verify(plan_s, plan_p).success
