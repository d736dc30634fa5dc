"""A block shared by several layers, as the family builds it: Zamba's one
attention block in each hybrid layer (its ``_tied_weights_keys``), which
transformers 5.23 ties only with ``tie_word_embeddings`` on
(``hf.tie_shared`` ties it with the head left untied). PyTorch's FSDP2
refuses to shard the shared block in two groups, so transformers' own
per-layer FSDP2 plan does not run (the real run raises the same);
``fsdp_grouped`` shards the sharing layers as one group and verifies,
DDP verifies, and summing the gradients layer by layer (the shared
block's twice) FAILs (gloo: ``same``, ``same``, ``differs``). At 8
layers Zamba has two hybrid layers; the suite runs the same at its
cases ``hf zamba ... ly8``."""

from __future__ import annotations

import shlex
import warnings

import pytest

pytest.importorskip("transformers")

from backends.torch.__main__ import parser, resolve, trace_and_build  # noqa: E402
from backends.torch.zoo import hf  # noqa: E402
from main import verify  # noqa: E402

SIZES = dict(hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)


def test_the_shared_block_is_one_module_and_the_head_stays_untied() -> None:
    warnings.filterwarnings("ignore")
    model = hf.build("zamba", layers=8, **SIZES).hf
    layers = model.model.layers
    hybrid = [k for k, t in enumerate(model.config.layers_block_type) if t == "hybrid"]
    assert len(hybrid) == 2
    a, b = (layers[k].shared_transf for k in hybrid)
    assert all(p is q for p, q in zip(a.parameters(), b.parameters()))
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_layers_sharing_parameters_are_grouped() -> None:
    warnings.filterwarnings("ignore")
    layers = list(hf.build("zamba", layers=8, **SIZES).hf.model.layers)
    groups = hf._sharing(layers)
    assert [len(g) for g in groups] == [1, 1, 2, 1, 1, 1, 1]
    assert groups[2] == [layers[2], layers[7]]


def test_fsdp_over_the_sharing_layers_as_one_group_verifies() -> None:
    argv = "--hf zamba --recipe fsdp_grouped --dp 2 --tp 1 --layers 8"
    (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(shlex.split(argv))))
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
