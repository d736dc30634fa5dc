"""A received message read as another (docs/soundness.md, "Plans traced from
PyTorch", 102): the alignment's choice of the message the reader reads it
as (``align/messages.py``), and the verifier's judgment of a plan whose
``send_recv`` reads a fresh input of the sender, of which nothing is known:
a counterexample at the claimed value's stage, never a SUCCESS."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import Claim, key_kwargs
from backends.torch.tracer.align.messages import Messages
from gen_model.config import Parallelism
from main import verify
from tests.helpers import MLP, plan_pair
from verdict.diagnosis import diagnose
from verdict.plan import Logical, Tensor


class _Rank(Messages):
    """The state ``Messages`` reads: single-device node keys and one rank's
    values, claims and microbatches."""

    def __init__(self, by_key: dict):
        self.b = SimpleNamespace(s=SimpleNamespace(by_key=by_key))
        self.sv, self.claim, self.mb = {}, {}, {}
        self.sent, self.misdelivered, self.read_at = {}, [], {}

    def receive_as(self, v: int, sv: int, mb: int, peer: int = 0) -> None:
        self.sv[v], self.mb[v] = sv, mb
        self.claim[v] = Claim([[], ["mb"], []])
        self.received_as(v, peer)


def _mean(v: int, mb: int) -> LNode:
    return LNode("mean", "fw", [v], [99], {"dim": -1}, "M.decoder.layers.0.input_layernorm", mb=mb)


def test_a_message_read_as_another_takes_that_message_s_value():
    """Rank 1 received a gradient (single-device value 7) where its layer
    norm reads an activation (value 3, which the same peer sent it in the
    same batch): the value is claimed as the activation, at its microbatch."""
    mean = ("mean", "fw", (3,), key_kwargs({"dim": -1}))
    r = _Rank({mean: [12]})
    r.receive_as(10, 7, 0)  # the gradient, read as the activation
    r.receive_as(11, 3, 2)  # the activation, in the gradient's place
    r.receive_as(12, 3, 1)  # an earlier microbatch's activation
    assert r.delivered_instead(_mean(10, mb=2)) == [12]
    assert (r.sv[10], r.mb[10], r.misdelivered) == (3, 2, [10])
    assert r.read_at[10] == "M.decoder.layers.0.input_layernorm"
    assert r.sent[10].sv == 7  # what was sent is kept


def test_no_message_of_the_peer_makes_the_reader_match():
    """Nothing is claimed when no other message of the same peer makes the
    reader match (the node is refused as before); a message of another peer
    is not taken."""
    mean = ("mean", "fw", (3,), key_kwargs({"dim": -1}))
    r = _Rank({mean: [12]})
    r.receive_as(10, 7, 0)
    r.receive_as(11, 3, 0, peer=2)
    assert r.delivered_instead(_mean(10, mb=0)) == []
    assert r.misdelivered == [] and r.sv[10] == 7


def _fresh_message(single, parallel):
    """The pair with the first received activation's ``send_recv`` reading a
    fresh input of the sender instead (an input of the ranks only: written
    into the single-device plan, which no node reads)."""
    i = next(i for i, n in enumerate(parallel.nodes) if n.op == "send_recv" and n.dir == "fw")
    node = parallel.nodes[i]
    got = parallel.tensors[node.outputs[0]]
    full = parallel.logical[got.tid].shape
    logical = [*single.logical, Logical("a fresh message", full, "buffer")]
    tid = len(logical) - 1
    whole = tuple((0, n) for n in full)
    s = replace(single, logical=logical,
                tensors=[*single.tensors, Tensor(0, -1, tid, 0, full, 0, whole, (0, 1, 1))])
    sent = Tensor(node.kwargs["src"], -1, tid, 0, got.shape, 0, got.slices, (0, 1, 1))
    p = replace(parallel, logical=list(logical), tensors=[*parallel.tensors, sent],
                nodes=list(parallel.nodes))
    p.nodes[i] = node._replace(inputs=(len(p.tensors) - 1,))
    return s, p


def test_a_fresh_message_read_as_an_activation_fails_with_a_counterexample():
    single, parallel = plan_pair(MLP, Parallelism(pp=2, nm=2), 4)
    assert verify(single, parallel).success
    s, p = _fresh_message(single, parallel)
    verdict = verify(s, p)
    assert not verdict.success and verdict.kind == "stage", verdict.kind
    why = next(line for line in diagnose(verdict, s, p) if line.startswith("   why: "))
    assert "a message of no single-device value" in why and "a fresh message" in why
