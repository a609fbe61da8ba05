"""How long a node waits for an expert's owner to fetch it from the Hub.

The owner fetches a missing expert for the household (its duty), and a node that gives up on it
too soon fetches the same expert from the Hub itself: on a household's one internet link, the
expert crosses it twice. Waiting too long is the other failure: an owner whose fetch is stuck
while its health check answers holds every token that needs one of its experts.

An owner that reports progress (FetchExpert's `progress`, node/rpc/fetch_progress.py) is waited
for while it moves: while this call waits behind the owner's other fetches for peers, and then
for at most `bound_s` once its own fetch has begun; but not for `stall_s` in which the owner's
links received nothing. An owner that reports nothing (an older node) is waited for `bound_s`
from the ask, as before progress existed.
"""

from __future__ import annotations

import time

from expertmesh.v1 import node_pb2

STALLED = "stalled"  # why a wait ended: the owner's links received nothing for `stall_s`
DEADLINE_EXCEEDED = "deadline_exceeded"  # or its fetch ran past `bound_s`


class OwnerWait:
    """One call's wait on an owner: `heard` each progress message, `give_up_at` when to stop."""

    def __init__(self, bound_s: float, stall_s: float, now: float | None = None):
        """`bound_s`: the longest the owner's own fetch of the expert may run, and what a silent
        owner gets; `stall_s`: how long its links may receive nothing."""
        now = time.monotonic() if now is None else now
        self.bound_s, self.stall_s = bound_s, stall_s
        self._cap = now + bound_s
        self._moved_at: float | None = None  # set by the first progress message
        self._received: int | None = None
        self.fetching = False

    @property
    def give_up_at(self) -> float:
        """When the wait ends if nothing more is heard (monotonic seconds)."""
        if self._moved_at is None:
            return self._cap
        return min(self._cap, self._moved_at + self.stall_s)

    def why(self, now: float | None = None) -> str:
        """Why the wait ended at `now` (STALLED or DEADLINE_EXCEEDED)."""
        now = time.monotonic() if now is None else now
        if self._moved_at is None:
            return DEADLINE_EXCEEDED  # it said nothing: only the bound applies
        stall_ends = self._moved_at + self.stall_s
        return STALLED if now >= stall_ends and stall_ends <= self._cap else DEADLINE_EXCEEDED

    def heard(self, progress: node_pb2.FetchProgress, now: float | None = None) -> float:
        """Take in one progress message; returns the new `give_up_at`."""
        now = time.monotonic() if now is None else now
        if self._moved_at is None:
            self._moved_at = now  # the stall counts from the first word
        if progress.fetching and not self.fetching:
            self.fetching = True  # its fetch begins: its bound counts from here, not from the ask
            self._cap, self._moved_at = now + self.bound_s, now
        elif not self.fetching:
            # behind the owner's other fetches for peers, which are bounded each, and only a few
            # run at once (rpc/admission.py): the stall rule still ends a queue that does not move
            self._cap = max(self._cap, now + self.bound_s)
        if progress.received_bytes != self._received:
            self._received, self._moved_at = progress.received_bytes, now
        return self.give_up_at
