"""Megatron-Core's distributed optimizer (docs/soundness.md, "Plans traced from
PyTorch", 56 to 59): a flat range of a tensor as blocks, a view of a flat
range read back as a block, and Megatron's own step at dp 2, where a rank's
range cuts ``linear_qkv.weight`` inside a row and holds no element of other
parameters: it verifies, its final gradients are exactly the blocks of the
ranges Megatron's range map gives, a rank's block left out breaks the final
contract's coverage, and a plan reading the next rank's ranges FAILs."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from backends.torch.lowering.flat_ranges import block_of, flat_blocks

ROOT = Path(__file__).resolve().parent.parent


def _elements(full: tuple[int, ...], blocks: list) -> list[int]:
    """The flat indices the blocks hold, in the blocks' order, each row-major."""
    index = np.arange(math.prod(full)).reshape(full)
    return [int(i) for starts, shape in blocks
            for i in index[tuple(slice(s, s + n) for s, n in zip(starts, shape))].ravel()]


@pytest.mark.parametrize("full", [(7,), (4, 5), (2, 3, 4), (3, 1, 2)])
def test_every_flat_range_is_its_blocks_in_memory_order(full):
    n = math.prod(full)
    for a, b in itertools.combinations(range(n + 1), 2):
        blocks = flat_blocks(full, a, b)
        assert _elements(full, blocks) == list(range(a, b)), (full, a, b, blocks)
        assert len(blocks) <= 2 * len(full) - 1, (full, a, b, blocks)
        for starts, shape in blocks:  # each block is found again from its flat bounds
            lo = int(np.ravel_multi_index(starts, full))
            assert block_of(full, lo, lo + math.prod(shape), shape) == starts


def test_a_range_cut_inside_a_row():
    """Megatron's rank 0 range of linear_qkv.weight [72, 24] at hidden 24:
    elements [0, 512), whole rows 0-20 and 8 columns of row 21."""
    assert flat_blocks((72, 24), 0, 512) == [((0, 0), (21, 24)), ((21, 0), (1, 8))]
    assert flat_blocks((72, 24), 512, 1728) == [((21, 8), (1, 16)), ((22, 0), (50, 24))]
    assert flat_blocks((72, 24), 5, 5) == []


def test_elements_that_are_no_block_are_not_taken_for_one():
    assert block_of((4, 5), 3, 8, (1, 5)) is None  # across a row boundary
    assert block_of((4, 5), 5, 15, (2, 5)) == (1, 0)
    assert block_of((4, 5), 6, 8, (2, 1)) is None  # a column piece is not contiguous
    assert block_of((4, 5), 0, 20, (4, 5)) == (0, 0)
    assert block_of((4, 5), 18, 22, (1, 4)) is None  # past the end


pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")

ARGS = ["--model", "backends.torch.megatron:gpt", "--dp", "2", "--tp", "1", "--batch", "8",
        "--hidden", "24"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": ""})


def _trace(tmp_path: Path, recipe: str) -> tuple[Path, Path]:
    run = _run("-m", "backends.torch", *ARGS, "--recipe", f"backends.torch.megatron:{recipe}",
               "-o", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    stem = f"{recipe}_dp2_tp1_ly1_b8"
    return tmp_path / f"{stem}_single.pkl", tmp_path / f"{stem}_parallel.pkl"


def _final_blocks(plan) -> dict[tuple[int, str], list]:
    out: dict[tuple[int, str], list] = {}
    for node in plan.nodes:
        if node.op == "local_grad_accumulation":
            t = plan.tensors[node.outputs[0]]
            name = plan.logical[t.tid].name.removesuffix(".grad_buffer").removeprefix("model.")
            out.setdefault((t.rank, name), []).append(t.slices)
    return out


def test_dist_opt_verifies_with_megatrons_ranges_and_a_missing_block_fails(tmp_path):
    from backends.planfile import load_plan
    from verdict.final import check_final, rank_states
    sm, pm = _trace(tmp_path, "dist_opt")
    plan = load_plan(pm)
    assert plan.world.get("grad_blocks") == 1
    blocks = _final_blocks(plan)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert blocks[(0, qkv)] == [((0, 21), (0, 24)), ((21, 22), (0, 8))]
    assert blocks[(1, qkv)] == [((21, 22), (8, 24)), ((22, 72), (0, 24))]
    assert (0, "embedding.word_embeddings.weight") not in blocks  # rank 0 reads none of it
    assert (1, "decoder.final_layernorm.weight") not in blocks
    run = _run("main.py", "--sm", str(sm), "--pm", str(pm))
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout[-2000:]

    # rank 0's part of row 21 left out: no rank ends with those 8 elements
    single = load_plan(sm)
    states = rank_states(single, plan)
    qkv_tid = next(t for t, lg in enumerate(single.logical) if lg.name == f"model.{qkv}")
    del states[0].grad_blocks[qkv_tid][((21, 22), (0, 8))]
    everything = [SimpleNamespace(id=0, groups=[])]
    problems = check_final(single, plan, states, everything, [0] * len(plan.tensors), {0})
    grads = [p for p in problems if not p.startswith("the loss")]  # the loss: not proved here
    assert grads == [f"the blocks of the gradient of model.{qkv} the ranks end with do not "
                     f"cover it"], problems


def test_the_next_ranks_ranges_fail_at_a_local_gradient(tmp_path):
    sm, pm = _trace(tmp_path, "dist_opt_range_shifted")
    run = _run("main.py", "--sm", str(sm), "--pm", str(pm))
    assert run.returncode == 1, run.stdout[-2000:]
    assert "which is not the fully accumulated and reduced gradient" in run.stdout
