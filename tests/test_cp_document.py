"""cp: a document mask under PyTorch's per-document head-tail load balancer
(docs/soundness.md, "Plans traced from PyTorch", 127): the balancer is one
order of the positions, the single-device step's mask (a recorded
constant read along the sequence) is laid out in that order on its rows
and columns, and each rank's mask is matched as its block. The step
all-gathers the keys and values over "cp" and runs SDPA with the mask at
the rank's positions (what context_parallel's flex path computes;
flex_attention has no backward on the CPU). A mask not shifted to the
rank's chunk, or one rank reading the gathered keys in the single-device
order, fails naming the rank. Real gloo runs agree (the suite's ``cp
document mask`` cases, scripts/gloo_truth.py)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import verdict_cli
from backends.torch.tracer.rank import sequence_order
from tests.cp_doc_models import document_lengths, document_mask
from tests.cp_doc_recipes import per_document

ARGS = ["--model", "tests.cp_doc_models:doc_tagger", "--heads", "2", "--mesh", "cp=2",
        "--layers", "1", "--hidden", "8", "--seqlen", "16", "--vocab", "10", "--batch", "2"]
#: the per-document balancer's order at sequence 16, cp 2, documents 4 and 12, as torch
#: 2.13 generates it: document by document, each rank's head and tail chunks of it
#: (so that, cut into cp equal pieces, rank 0 holds [0, 3, 1, 2, 4, 5, 6, 13])
ORDER = [0, 3, 1, 2, 4, 5, 6, 13, 14, 15, 7, 8, 9, 10, 11, 12]


def test_the_per_document_balancer_is_one_order_of_every_row() -> None:
    class Model(torch.nn.Module):
        pass

    model = Model()
    model.cp_load_balancer = per_document(document_lengths(16))
    assert sequence_order(model, 16, 2) == ORDER


def test_the_single_device_mask_is_laid_out_in_the_order() -> None:
    from backends.torch.__main__ import parser, trace_and_build

    args = parser().parse_args([*ARGS, "--recipe", "tests.cp_doc_recipes:doc_allgather"])
    (plan_s, _), _ = trace_and_build(args)
    names = {t.name for t in plan_s.logical if t.name.startswith("const.16x16.")}
    order = torch.tensor(ORDER)
    want = np.ascontiguousarray(document_mask(document_lengths(16), order, order).numpy()
                                .astype(np.float64))
    digest = hashlib.sha1(repr(want.shape).encode() + want.tobytes()).hexdigest()[:16]
    assert names == {f"const.16x16.{digest}"}


def _run(recipe: str, capsys) -> tuple[int, str]:
    code = verdict_cli.torch([*ARGS, "--recipe", f"tests.cp_doc_recipes:{recipe}"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_document_mask_verifies_under_the_per_document_balancer(capsys) -> None:
    code, out = _run("doc_allgather", capsys)
    assert code == 0, out
    assert "SUCCESS" in out


def test_a_mask_not_shifted_per_rank_fails_naming_the_rank(capsys) -> None:
    code, out = _run("doc_mask_unshifted", capsys)
    assert code == 1, out
    assert "rank 1" in out and "expand" in out


def test_keys_read_in_the_single_device_order_on_one_rank_fail(capsys) -> None:
    code, out = _run("doc_keys_unordered", capsys)
    assert code == 1, out
    assert "rank 1" in out and "expand" in out


def _check(nodes: list[tuple], constants: set[int]):
    """``SequenceConstants`` run to a fixed point on a small trace: tokens
    0 [2, 4, 10] (sequence 4), an embedding table 1, a constant 3 [4, 8]."""
    from types import SimpleNamespace

    from backends.torch.tracer.seq_constants import SequenceConstants

    shapes = {0: (2, 4, 10), 1: (10, 8), 2: (2, 4, 8), 3: (4, 8), 4: (2, 4, 8), 5: (2, 4, 8),
              6: (4, 8), 7: (4, 8)}
    plan = SimpleNamespace(
        tensors={v: SimpleNamespace(shape=s) for v, s in shapes.items()},
        nodes=[SimpleNamespace(op=op, dir="fw", inputs=ins, outputs=outs, kwargs=kw, name="m")
               for op, ins, outs, kw in nodes])
    check = SequenceConstants(plan, 4, [0], constants)
    found = -1
    while found != len(check.seq):
        found = len(check.seq)
        for index in range(len(nodes)):
            check.node(index)
    return check.relabel


BROADCAST = [("embedding", [0, 1], [2], {}), ("expand", [3], [4], {"shape": [2, 4, 8]}),
             ("add", [2, 4], [5], {})]


def test_a_constant_broadcast_along_the_sequence_is_relabelled_on_that_dim() -> None:
    assert _check(BROADCAST, {3}) == {(3, 0): (1, 1)}


def test_a_relabelled_constant_read_against_a_value_of_no_sequence_is_refused() -> None:
    from backends.torch.errors import LoweringError

    with pytest.raises(LoweringError, match="does not carry the sequence"):
        _check([*BROADCAST, ("add", [3, 6], [7], {})], {3})
