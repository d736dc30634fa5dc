"""Messages a rank received, and a message read where the schedule
delivered another: a pipeline's batched sends and receives at pipeline
size 2 matched in another order on each side (Megatron-LM issues 750 and
1450), so that a chunk reads a gradient as its input activation.

A received value is claimed to be the value its sender sent
(``Collectives.receive``). When a node reading it matches no single-device
node, but does with the value of another message the same peer sent this
rank in its place, the received value is claimed to be that other
message's value, the one the schedule should have delivered, and the
writer gives it a producer of its own: a message of a fresh input of the
sender, of which nothing is known. Its claim is proved like any by the
stage of that value, for every value of the fresh input, so it is refuted
there (docs/soundness.md, "Plans traced from PyTorch", 102).
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import Claim, Pieces, key_kwargs, scope


@dataclass
class Sent:
    """A received value as its sender sent it: the peer, the single-device
    value and claim it stands for on this rank, its microbatch, its place
    among the messages this rank received."""
    peer: int
    sv: int
    claim: Claim
    mb: int
    order: int


class Messages(Pieces):
    """The messages a rank received (``sent``) and those it reads as
    another message (``misdelivered``, rewritten by the writer)."""

    sent: dict[int, Sent]
    misdelivered: list[int]
    read_at: dict[int, str]  # a misdelivered value -> the module of the reader that shows it

    def received_as(self, out: int, peer: int) -> None:
        """Keep what the received value ``out`` was sent as (its claim
        just made by ``receive``)."""
        c = self.claim[out]
        self.sent[out] = Sent(peer, self.sv[out], Claim([list(d) for d in c.dims], c.partial,
                                                        c.mbs, c.scale, c.at, c.steps, c.loose),
                              self.mb.get(out, -1), len(self.sent))

    def delivered_instead(self, node: LNode) -> list[int]:
        """The single-device nodes ``node`` matches when one received value
        it reads is claimed to be another message of the same peer (of the
        node's microbatch first, then the nearest received); that value
        then takes the other message's claim and is marked misdelivered.
        Empty when no such message makes it match."""
        for i, v in enumerate(node.ins):
            mine = self.sent.get(v)
            if mine is None or v in self.misdelivered or mine.claim.loose:
                continue
            others = [s for u, s in self.sent.items()
                      if u != v and s.peer == mine.peer and s.sv != mine.sv and not s.claim.loose]
            others.sort(key=lambda s: (s.mb != node.mb, abs(s.order - mine.order)))
            for s in others:
                ins = tuple(s.sv if k == i else (-1 if u < 0 else self.sv[u])
                            for k, u in enumerate(node.ins))
                cands = self.b.s.by_key.get((node.op, node.dir, ins, key_kwargs(node.kwargs)))
                if cands:
                    c = s.claim
                    self.sv[v], self.mb[v] = s.sv, s.mb
                    self.claim[v] = Claim([list(d) for d in c.dims], c.partial, c.mbs, c.scale,
                                          c.at, c.steps)
                    self.misdelivered.append(v)
                    self.read_at[v] = scope(node.name) or "step"
                    return list(cands)
        return []
