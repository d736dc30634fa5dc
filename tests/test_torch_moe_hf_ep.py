"""transformers' expert-parallel plan (``--hf FAMILY --ep N``): the flag,
the c10d all-to-all its dispatch calls (``alltoall_base_``: output, input,
group, output splits, input splits) answered from the members' sends, and
the step verified (docs/torch-backend.md, "Top-k mixtures of experts")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.errors import LoweringError
from backends.torch.tracer.exchange import Exchanges


def test_alltoall_base_reads_its_group_and_splits_where_its_schema_puts_them() -> None:
    out, x = torch.zeros(3, 2), torch.tensor([[1., 2.], [3., 4.], [5., 6.]])
    groups = []

    def group_of(g):
        groups.append(g)
        return (0, 1)

    sends = Exchanges(0, None)
    assert not sends.call("c10d.alltoall_base_.default", (out, x, "G", [3, 0], [1, 2]), {}, None,
                          group_of)
    assert groups == ["G"]
    assert sends.sent[0]["out_splits"] == [3, 0] and sends.sent[0]["in_splits"] == [1, 2]
    previous = {0: sends.sent, 1: [{"group": [0, 1], "k": 0, "in_splits": [2, 0],
                                    "out_splits": [2, 0], "input": np.array([[7., 8.], [9., 10.]])}]}
    again = Exchanges(0, previous)
    assert again.call("c10d.alltoall_base_.default", (out, x, "G", [3, 0], [1, 2]), {}, None,
                      group_of)
    assert out.tolist() == [[1., 2.], [7., 8.], [9., 10.]]  # block 0 of each member


def test_ep_flag() -> None:
    args = resolve(parser().parse_args(["--hf", "mixtral", "--dp", "2", "--tp", "1", "--ep", "2"]))
    assert args.recipe == "backends.torch.hf:ep_fsdp"
    with pytest.raises(LoweringError, match="ep = dp x tp"):
        resolve(parser().parse_args(["--hf", "mixtral", "--dp", "2", "--tp", "1", "--ep", "4"]))
    with pytest.raises(LoweringError, match="--ep is for --hf"):
        resolve(parser().parse_args(["--dp", "2", "--tp", "1", "--ep", "2"]))


def test_mixtral_ep2_verifies_for_the_routing_it_names() -> None:
    """The ranks run transformers' all-to-all dispatch (the token counts
    answered in passes), the experts loop over the received pairs and the
    combine (docs/soundness.md, "Plans traced from PyTorch", 54): a
    SUCCESS naming the routing."""
    pytest.importorskip("transformers")
    from main import verify

    args = parser().parse_args(["--hf", "mixtral", "--dp", "2", "--tp", "1", "--ep", "2"])
    (plan_s, plan_p), _ = trace_and_build(args)
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert "tokens per expert" in plan_s.world["routing"]


@pytest.mark.parametrize("family", ["glm4_moe", "jamba", "afmoe", "ernie4_5_moe", "beam",
                                    "deepseek_v3", "flint"])
def test_a_small_mixture_routes_at_its_one_layer(family: str) -> None:
    """Families that keep their first layers dense (``first_k_dense_replace``,
    ``mlp_layer_types``, ``expert_layer_offset``, ...) are configured so that
    the backend's one-layer model routes: its step calls ``topk``."""
    pytest.importorskip("transformers")
    from torch.utils._python_dispatch import TorchDispatchMode

    from backends.torch import hf

    calls = []

    class Topk(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) == "aten.topk.default":
                calls.append(func)
            return func(*args, **(kwargs or {}))

    model = hf.build(family, layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4).double()
    tokens = torch.randint(0, 16, (4, 4), generator=torch.Generator().manual_seed(0))
    with Topk():
        model(tokens, tokens)
    assert calls


@pytest.mark.parametrize("bug", ["ep_token_to_other_expert", "ep_wrong_split",
                                 "ep_combine_other_gate"])
def test_a_wrong_dispatch_fails_at_the_rank_that_made_it(bug: str) -> None:
    """Rank 0 sends a token's row to another expert, or counts one token of
    an expert as the next rank's: the receiver's masks are inputs of its
    own, aligned with the single-device mask they differ least from
    (docs/soundness.md, "Plans traced from PyTorch", 72); or it weighs its
    first two tokens with each other's gates: the gates' rows at the
    permutation stand in for the gates (83). The step FAILs with a
    counterexample on rank 0 in the experts module; the oracle, which
    trusts no claim, judges the plan wrong too."""
    pytest.importorskip("transformers")
    from harness.oracle import judge
    from main import verify
    from verdict.diagnosis import diagnose

    args = parser().parse_args(["--hf", "mixtral", "--recipe", f"harness.moe_bugs:{bug}",
                                "--dp", "2", "--tp", "1", "--ep", "2"])
    (plan_s, plan_p), _ = trace_and_build(args)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage", verdict.message
    lead = "\n".join(diagnose(verdict, plan_s, plan_p))
    assert "on rank 0" in lead and "mlp.experts" in lead, lead
    assert not judge(plan_s, plan_p).right


def test_a_mask_of_its_own_is_read_as_the_nearest_single_device_mask() -> None:
    """The fewest entries a rank's mask differs in from any block of its
    shape that tiles a single-device mask (docs/soundness.md, "Plans traced
    from PyTorch", 72); a shape that tiles nothing differs everywhere."""
    from backends.torch.tracer.align.inputs import _differences

    full = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    assert _differences(full, np.array([[1, 1], [0, 0]])) == 0
    assert _differences(full, np.array([[1, 0], [1, 1]])) == 1
    assert _differences(full, np.array([[1, 0, 1]])) == 3
