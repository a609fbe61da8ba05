"""How long a node waits for an owner fetching an expert for it (node/household/owner_wait.py).

An owner that says how its fetch goes is waited for while it moves, however long that is, and
given up soon once its links receive nothing; one that says nothing (an older node) gets the
longest its fetch may run, as before. Time is passed in, so nothing here sleeps.
"""

from __future__ import annotations

from expertmesh.node.household.owner_wait import DEADLINE_EXCEEDED, STALLED, OwnerWait
from expertmesh.v1 import node_pb2

BOUND_S, STALL_S = 100.0, 10.0


def _progress(fetching: bool, received: int) -> node_pb2.FetchProgress:
    return node_pb2.FetchProgress(fetching=fetching, received_bytes=received)


def test_a_silent_owner_gets_the_bound_from_the_ask() -> None:
    wait = OwnerWait(BOUND_S, STALL_S, now=0.0)
    assert wait.give_up_at == BOUND_S
    assert wait.why(now=BOUND_S) == DEADLINE_EXCEEDED


def test_an_owner_whose_fetch_moves_is_waited_for_its_bound_from_when_it_began() -> None:
    wait = OwnerWait(BOUND_S, STALL_S, now=0.0)
    wait.heard(_progress(False, 0), now=0.0)
    t, received = 0.0, 0
    while t < 300:  # behind other peers' fetches for 300 s, which keep its link busy
        t, received = t + 2, received + 1000
        assert wait.heard(_progress(False, received), now=t) == t + STALL_S
    assert wait.heard(_progress(True, received), now=t) == t + STALL_S  # its own fetch begins
    began = t
    while t < began + BOUND_S - 2:
        t, received = t + 2, received + 1000
        wait.heard(_progress(True, received), now=t)
    assert wait.give_up_at == began + BOUND_S  # moving, but never past its own fetch's bound
    assert wait.why(now=began + BOUND_S) == DEADLINE_EXCEEDED


def test_an_owner_whose_links_receive_nothing_is_given_up_after_the_stall() -> None:
    wait = OwnerWait(BOUND_S, STALL_S, now=0.0)
    wait.heard(_progress(True, 5000), now=1.0)
    for t in (3.0, 5.0, 7.0, 9.0):  # it answers, but its link carries nothing
        assert wait.heard(_progress(True, 5000), now=t) == 1.0 + STALL_S
    assert wait.why(now=1.0 + STALL_S) == STALLED


def test_an_owner_queued_behind_a_stuck_fetch_is_given_up_after_the_stall() -> None:
    wait = OwnerWait(BOUND_S, STALL_S, now=0.0)
    for t in range(0, 30, 2):
        wait.heard(_progress(False, 7), now=float(t))
    assert wait.give_up_at == STALL_S
    assert wait.why(now=STALL_S) == STALLED


def test_an_owner_that_says_its_fetch_stopped_after_it_began_does_not_extend_its_bound() -> None:
    wait = OwnerWait(BOUND_S, STALL_S, now=0.0)
    wait.heard(_progress(True, 1), now=0.0)
    for t in range(2, 200, 2):  # a node that lies "not begun" once begun gains nothing by it
        wait.heard(_progress(False, 1 + t), now=float(t))
    assert wait.give_up_at == BOUND_S
