"""A constant of each microbatch that is the microbatch's piece of a
single-device constant, read alike in every microbatch
(``backends/torch/tracer/align/inputs.py`` ``_Rank.per_microbatch``; GPTModel's
all-ones loss mask, rolled, in Megatron's multi-token prediction with 2
microbatches); docs/soundness.md, "Plans traced from PyTorch",
49 (c). Here a Llama whose loss keeps every position but the
last of each row, by a mask made from the labels' shape, run through
PyTorch's 1F1B schedule at pp 2 with 2 microbatches."""

from __future__ import annotations

import shlex

import torch

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.zoo.models import Llama, LlamaArgs
from harness.oracle import judge
from main import verify


class LastPositionDropped(Llama):
    """A loss summed over every position but each row's last (a mask
    of the labels' shape: ones, rolled by one, the wrapped column zeroed),
    divided by the step's token count. ``wrong_column``: the mask zeroes
    the first column instead on the second microbatch's rows (a mask that
    is no piece of the single-device one)."""

    def __init__(self, args: LlamaArgs, wrong_column: bool = False):
        super().__init__(args)
        self.wrong_column = wrong_column
        self.seen = 0

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = torch.roll(torch.ones_like(labels, dtype=torch.float64), shifts=-1, dims=-1)
        column = 0 if self.wrong_column and self.seen % 2 == 1 else -1
        self.seen += 1
        mask.select(-1, column).fill_(0)
        per_token = torch.tanh(logits).sum(-1)
        return (per_token * mask).sum() / (self.global_tokens or labels.numel())


def last_dropped(**kw) -> LastPositionDropped:
    return LastPositionDropped(LlamaArgs(**kw))


def wrong_column(**kw) -> LastPositionDropped:
    return LastPositionDropped(LlamaArgs(**kw), wrong_column=True)


def _plans(model: str):
    argv = f"--model {__name__}:{model} --recipe pp_1f1b --pp 2 --dp 1 --tp 1 --layers 2"
    (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(shlex.split(argv))))
    return plan_s, plan_p


def test_a_constant_of_each_microbatch_is_claimed_as_its_piece() -> None:
    plan_s, plan_p = _plans("last_dropped")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    names = {plan_p.logical[t.tid].name for t in plan_p.tensors if t.mb >= 0}
    assert plan_p.world["nm"] == 2 and names


def test_a_mask_of_another_column_on_one_microbatch_fails() -> None:
    plan_s, plan_p = _plans("wrong_column")
    assert not judge(plan_s, plan_p).right
    assert not verify(plan_s, plan_p).success
