"""The order the ranks' nodes are written in: every collective after all its
group's members reached it, every receive after its send."""

from __future__ import annotations

from backends.torch.lowering import LNode, Lowered, LoweringError

P2P = ("send", "send_recv")


def joint_order(ranks: list[Lowered]) -> list[tuple[int, int, int]]:
    """(rank position, node index, collective number) in an order where every
    collective runs after all its group members reached it, and every
    receive after its send (the k-th receive from a rank matches the k-th
    send to it: a pipeline's sends carry no microbatch id)."""
    pos = [0] * len(ranks)
    count: list[dict[tuple, int]] = [dict() for _ in ranks]
    sent: dict[tuple, int] = {}
    index = {low.rank: i for i, low in enumerate(ranks)}
    out = []

    def local(i: int) -> bool:
        """Run rank i up to its next collective (or a receive not sent yet)."""
        moved = False
        nodes = ranks[i].nodes
        while pos[i] < len(nodes):
            node = nodes[pos[i]]
            k = count[i].get(channel(node), 0) if node.group is not None else -1
            if node.op == "send":
                sent[node.group] = sent.get(node.group, 0) + 1
            elif (node.op == "send_recv" and sent.get(node.group, 0) <= k) or \
                    (node.group is not None and node.op not in P2P):
                return moved
            if node.group is not None:
                count[i][channel(node)] = k + 1
            out.append((i, pos[i], k))
            pos[i] += 1
            moved = True
        return moved

    while True:
        progressed = False
        for i in range(len(ranks)):
            progressed |= local(i)
        waiting = [i for i, low in enumerate(ranks) if pos[i] < len(low.nodes)]
        if not waiting:
            return out
        for i in waiting:
            node = ranks[i].nodes[pos[i]]
            if node.op in P2P:
                continue
            k = count[i].get(node.group, 0)
            members = [index[r] for r in node.group]
            if all(pos[j] < len(ranks[j].nodes) and ranks[j].nodes[pos[j]].group == node.group
                   and count[j].get(node.group, 0) == k for j in members):
                for j in members:
                    out.append((j, pos[j], k))
                    pos[j] += 1
                    count[j][node.group] = k + 1
                progressed = True
                break
        if not progressed:
            raise LoweringError("the ranks' collectives do not match in order within their "
                                "groups, or a receive has no send")


def channel(node: LNode) -> tuple:
    """What a node's number k counts along: its group's collectives, or
    (a send or a receive) the messages from one rank to another, which are
    matched apart from the collectives of a group of the same two ranks."""
    return ("p2p", *node.group) if node.op in P2P else node.group


class Channels:
    """Each rank's collective nodes by channel, indexed once: the k-th node
    of a channel is looked up for every member of every collective."""

    def __init__(self, ranks: list[Lowered]):
        self.of: dict[int, dict[tuple, list[int]]] = {}
        for low in ranks:
            index: dict[tuple, list[int]] = {}
            for i, node in enumerate(low.nodes):
                if node.group is not None:
                    index.setdefault(channel(node), []).append(i)
            self.of[low.rank] = index

    def nth(self, low: Lowered, like: LNode, k: int) -> int:
        """The index of ``low``'s k-th node on the channel of ``like``."""
        found = self.of[low.rank].get(channel(like), [])
        if 0 <= k < len(found):
            return found[k]
        raise LoweringError(f"rank {low.rank} has no collective {k} in group {list(like.group)}")
