"""cp: the sequence cut over a "cp" mesh dim (backends/torch/rank.py,
``sequence_chunk``; docs/soundness.md, "Plans traced from PyTorch", the
sequence split): each rank's tokens and labels are its chunk of the
sequence, claimed as that chunk, on a model that computes each position on
its own. Summed gradients verify; the gradients left unreduced over cp, or
averaged over it (torchtitan 3280's loss aggregated over two axes), FAIL
at the gradient; positions not shifted per context-parallel rank FAIL at
the position embedding; a module buffer cut along the sequence (as
``context_parallel`` cuts its buffers) is claimed as the rank's chunk, and
a chunk cut at the wrong place is caught by the loaded-value check."""

from __future__ import annotations

import pytest

import verdict_cli
from backends.torch.__main__ import parser, trace_and_build

SIZES = ["--layers", "1", "--hidden", "8", "--seqlen", "4", "--vocab", "10", "--batch", "2"]


MLP = "backends.torch.stock_models:mlp"
POSITIONS = "tests.cp_split_models:position_tagger"
TABLE = "tests.cp_split_models:table_position_tagger"


def _verify(model: str, recipe: str, mesh: str) -> int:
    return verdict_cli.torch(["--model", model, "--recipe", f"tests.cp_split_recipes:{recipe}",
                              "--mesh", mesh, *SIZES])


@pytest.mark.parametrize(("model", "recipe", "mesh", "code", "says"), [
    (MLP, "cp_sum", "cp=2", 0, "SUCCESS"),
    (MLP, "cp_unreduced", "cp=2", 1, "not the fully accumulated and reduced gradient"),
    (MLP, "cp_averaged", "dp=2,cp=2", 1, "1/2 x the gradient"),
    (POSITIONS, "cp_positions", "cp=2", 0, "SUCCESS"),
    (POSITIONS, "cp_positions_unshifted", "cp=2", 1,
     "where: module PositionTagger.positions, operator embedding"),
    (TABLE, "cp_table", "dp=2,cp=2", 0, "SUCCESS"),
    (TABLE, "cp_table_other_chunk", "cp=2", 1, "rank 1 holds rows 0:2 of table, not its claimed rows 2:4"),
])
def test_the_sequence_split_over_cp(model, recipe, mesh, code, says, capsys) -> None:
    assert _verify(model, recipe, mesh) == code
    assert says in capsys.readouterr().out


def test_each_rank_claims_its_chunk_of_the_sequence() -> None:
    args = parser().parse_args(["--model", "backends.torch.stock_models:mlp", "--recipe",
                                "tests.cp_split_recipes:cp_sum", "--mesh", "dp=2,cp=2", *SIZES])
    (_, parallel), _ = trace_and_build(args)
    producer = parallel.producers()
    boxes = {}
    for i, t in enumerate(parallel.tensors):
        if producer[i] < 0 and parallel.logical[t.tid].kind == "tokens":
            boxes.setdefault(parallel.logical[t.tid].name, {})[t.rank] = t.slices[:2]
    # rank (d * cp + c): batch row d, sequence positions [2c, 2c + 2)
    want = {r: ((r // 2, r // 2 + 1), (2 * (r % 2), 2 * (r % 2) + 2)) for r in range(4)}
    assert boxes and all(b == want for b in boxes.values())
