"""torchtitan's MoE families by name (``--model titan:qwen3_moe``,
``titan:gpt_oss``, each with ``_ep``) under the family's own parallelize
(``titan:parallelize``, ``titan:parallelize_ep``), and the CPU shim's eager
attention that gives gpt_oss's sinks the log-sum-exp they rescale by
(backends/torch/zoo/titan.py, titan_shim.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.torch.zoo import titan, titan_shim


def test_factories_by_family_are_top_level_functions() -> None:
    from backends.torch.api import reference
    for name in ("qwen3_moe", "qwen3_moe_ep", "gpt_oss", "gpt_oss_ep", "kimi_k2_7", "llama3", "qwen3"):
        factory = getattr(titan, name)
        assert reference(factory, "model") == f"backends.torch.zoo.titan:{name}"
    with pytest.raises(AttributeError):
        titan.no_such_family  # noqa: B018


def test_causal_attention_is_sdpa_and_gives_the_log_sum_exp() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 3, dtype=torch.float64)
    k, v = (torch.randn(2, 5, 2, 3, dtype=torch.float64) for _ in range(2))
    out, lse = titan_shim.causal_attention(q, k, v, None, -1)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want)
    # the sink rescale out * sigmoid(lse - sink) is a softmax with one more logit, the sink's
    sinks = torch.randn(4, dtype=torch.float64)
    scores = (q.transpose(1, 2) @ k.repeat_interleave(2, 2).permute(0, 2, 3, 1)) / 3 ** 0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 5, 1)], dim=-1)
    probs = torch.softmax(full, -1)[..., :-1]
    with_sink = (probs @ v.repeat_interleave(2, 2).transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out * torch.sigmoid(lse - sinks).unsqueeze(-1), with_sink)


def test_causal_attention_window() -> None:
    q, k, v = (torch.randn(1, 4, 1, 2, dtype=torch.float64) for _ in range(3))
    out, _ = titan_shim.causal_attention(q, k, v, 1.0, 0)  # each token only itself
    torch.testing.assert_close(out, v)


class _Dim:
    def size(self) -> int:
        return 1


class _Mesh:
    def __getitem__(self, name: str) -> _Dim:
        return _Dim()


def test_parallelize_ep_refuses_a_model_not_built_for_it() -> None:
    class NotEp:
        expert_parallel = False

    with pytest.raises(ValueError, match="titan:NAME_ep"):
        titan.parallelize_ep(NotEp(), _Mesh())


def test_addcmul_is_entrywise_on_grouped_rows() -> None:
    from backends.torch.lowering.grouped_rows import ELEMENTWISE
    assert "aten.addcmul.default" in ELEMENTWISE


def test_qwen3_moe_ep2_verifies_by_family() -> None:
    """Qwen3's ``debugmodel_moe`` (one block) under ``parallelize_qwen3``
    with expert parallelism over the two data-parallel ranks."""
    pytest.importorskip("torchtitan", reason="needs torchtitan")
    from backends.torch.__main__ import parser, resolve, trace_and_build
    from main import verify
    args = resolve(parser().parse_args(["--model", "titan:qwen3_moe_ep", "--recipe",
                                        "titan:parallelize_ep", "--vocab", "2048", "--layers",
                                        "1", "--dp", "2", "--tp", "1"]))
    (plan_s, plan_p), _ = trace_and_build(args)
    assert "router call 0" in plan_s.world["routing"]
    assert verify(plan_s, plan_p).success
