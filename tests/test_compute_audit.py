"""The compute audit's rules (node/household/compute_audit.py), without a model: which calls it
samples, how it judges an answer against this node's own, and what a wrong one does to its peer.
Real nodes with a peer whose answers are wrong are in tests/test_remote_experts.py."""

from __future__ import annotations

import random

import numpy as np

from expertmesh.node.errors import DownloadError
from expertmesh.node.household.compute_audit import MAX_PENDING, TOLERANCE, ComputeAudit
from expertmesh.node.household.membership import Peer
from expertmesh.node.store.stats import StoreStats
from expertmesh.v1 import node_pb2


def _rows(values: np.ndarray) -> node_pb2.Tensor:
    x = np.ascontiguousarray(values, dtype=np.float32)
    return node_pb2.Tensor(shape=list(x.shape), dtype="float32", data=x.tobytes())


class _Here:
    """This node's own computation: the rows times two, or a failure to get the expert."""

    def __init__(self) -> None:
        self.fails = False

    def recompute(self, layer: int, expert: int, rows: node_pb2.Tensor) -> node_pb2.Tensor:
        if self.fails:
            raise DownloadError("the Hub is down")
        x = np.frombuffer(rows.data, dtype=np.float32).reshape(tuple(rows.shape))
        return _rows(x * 2)


def _audit(every: int = 4) -> tuple[ComputeAudit, _Here, list[str]]:
    here, distrusted = _Here(), []
    audit = ComputeAudit(
        here,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        lambda peer: distrusted.append(peer.node_id),
        StoreStats(),
        every,
        random.Random(3),
        background=False,
    )
    return audit, here, distrusted


PEER = Peer("p1", "10.0.0.2:1", weight=1.0)


def test_a_peers_first_call_is_sampled_until_an_answer_of_it_is_offered_then_one_in_every() -> None:
    audit, _, _ = _audit(every=4)
    assert [audit.sample(PEER) for _ in range(3)] == ["first"] * 3  # calls in flight before its first answer
    x = _rows(np.ones((2, 3)))
    audit.offer(PEER, 1, 5, x, _rows(np.ones((2, 3)) * 2), first=True)
    audit.offer(PEER, 1, 6, x, _rows(np.ones((2, 3)) * 2), first=True)  # another first call's: now a sample
    assert audit.run_pending() == ["confirmed", "confirmed"]
    picks = [audit.sample(PEER) for _ in range(4000)]
    assert set(picks) == {"sampled", None} and 800 < picks.count("sampled") < 1200  # one in 4
    assert audit.sample(Peer("p2", "10.0.0.3:1", weight=1.0)) == "first"  # another peer's own first


def test_a_peer_shown_wrong_is_audited_at_its_first_answer_again_when_it_is_back() -> None:
    audit, _, distrusted = _audit(every=1 << 30)
    x = _rows(np.ones((1, 3)))
    audit.offer(PEER, 1, 5, x, x, first=True)  # not twice x: wrong
    assert audit.run_pending() == ["wrong"] and distrusted == ["p1"]
    assert audit.sample(PEER) == "first"  # distrusted for an hour, then checked from its first again


def test_no_more_than_a_few_sampled_answers_wait() -> None:
    audit, _, _ = _audit(every=1)
    x, twice = _rows(np.ones((1, 3))), _rows(np.ones((1, 3)) * 2)
    audit.offer(PEER, 1, 0, x, twice, first=True)
    for e in range(1, MAX_PENDING + 3):
        audit.offer(PEER, 1, e, x, twice, first=False)
    # a sample waits for an idle link, but memory may not grow with it: the excess is dropped
    assert len(audit.run_pending()) == MAX_PENDING


def test_an_answer_is_judged_against_this_nodes_own_within_the_tolerance() -> None:
    audit, here, distrusted = _audit(every=1 << 30)
    asked = _rows(np.arange(12.0).reshape(3, 4) + 1)
    mine = np.frombuffer(asked.data, dtype=np.float32).reshape(3, 4) * 2
    audit.offer(PEER, 1, 5, asked, _rows(mine * (1 + TOLERANCE / 4)), first=True)
    assert audit.run_pending() == ["confirmed"] and distrusted == []  # a few low bits apart: the same answer
    here.fails = True
    audit.offer(PEER, 1, 5, asked, _rows(mine * 1.5), first=True)
    assert audit.run_pending() == ["failed"] and distrusted == []  # nothing decided without its own result
