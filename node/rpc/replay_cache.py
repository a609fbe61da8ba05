"""The nonces of the call credentials a node accepted, so that none is accepted twice.

A credential (rpc/auth.py) is good while its time is within CALL_CREDENTIAL_WINDOW_S of the node's
clock. Someone who copies one off a plain-TCP LAN could send it again within that window; this
cache, as a Kerberos replay cache does, remembers every accepted credential's nonce until its time
leaves the window, and refuses a nonce it remembers.

Memory is bounded whatever the call rate: at `max_entries`, the oldest second of nonces is forgotten
and the window narrowed instead, so a credential stamped at or before the newest second ever
forgotten is refused. The invariant is simple: every accepted nonce stamped after `floor` is
remembered. Forgetting the nonces that left the window also raises the floor, so a node clock
stepped back (NTP) does not make them good again.

A restarted node has forgotten everything, so it refuses credentials stamped more than
START_MARGIN_S before its start: one copied before a restart cannot be replayed after it (but one of
the margin's few seconds just before it). The price: after a node starts, a caller whose clock is
more than the margin behind the node's is refused until its own clock passes the node's start (for
its lag less the margin), with a message that says its clock is behind; then it is served again
without anyone doing anything. We take it: the household's clocks are kept by NTP (well under a
second apart) and `expertmesh doctor` checks them, while the alternative — no floor at the start —
would leave every credential of the five minutes before a restart replayable once after it. (Kerberos,
in the same place, refuses every call for the whole window after a start; a stamp floor is the
cheaper form of the same rule.)

Nonces are kept in one set per second of stamp, and the seconds in a heap: admitting, finding and
forgetting cost O(1) amortised (the heap holds at most a few hundred seconds). One lock: gRPC
handlers run on a thread pool.
"""

from __future__ import annotations

import heapq
import threading

# The nonces a node remembers at most: at 115-145 bytes each (a nonce and its set slot), 30-40 MB.
# This holds the whole window up to ~870 calls a second (262,144 / 300 s); a node asked more (a K3
# household makes thousands of expert calls per token) keeps max_entries / rate seconds of them:
# about 90 s at 3,000 calls a second, which NTP-kept clocks still meet.
DEFAULT_MAX_ENTRIES = 262_144
# How far before this process's start a credential may be stamped (see the module's docstring).
START_MARGIN_S = 5

REPLAYED = "this credential was already used: a replayed call"


class ReplayCache:
    """Accepts each (stamp, nonce) once while the stamp is within `window_s` of the clock.

    `started`: the process's start (unix time); credentials stamped more than START_MARGIN_S
    before it are refused, since nonces seen before a restart are not remembered.
    """

    def __init__(self, window_s: int, started: float, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_entries < 1:
            raise ValueError("a replay cache must hold at least one nonce")
        self.window_s = window_s
        self.max_entries = max_entries
        self._start_floor = int(started) - START_MARGIN_S  # stamps at or below it: before the start
        self._floor = self._start_floor  # stamps at or below it are refused: their nonces may be forgotten
        self._nonces: dict[int, set[str]] = {}  # stamp -> the nonces accepted with it
        self._stamps: list[int] = []  # heap of _nonces' keys
        self._size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._size

    def admit(self, stamp: int, nonce: str, now: float) -> str | None:
        """Remember `nonce` and return None if it may be accepted; else why it is refused.

        `stamp` must already be checked to be within the window of `now` (auth.check_credential)."""
        with self._lock:
            self._forget_before(int(now) - self.window_s)
            if stamp <= self._floor:
                return self._too_old(stamp, now)
            seen = self._nonces.get(stamp)
            if seen is None:
                seen = self._nonces[stamp] = set()
                heapq.heappush(self._stamps, stamp)
            elif nonce in seen:
                return REPLAYED
            seen.add(nonce)
            self._size += 1
            while self._size > self.max_entries:  # full: narrow the window rather than forget a live nonce
                self._forget_oldest()
            return None

    def _forget_before(self, oldest_good: int) -> None:
        while self._stamps and self._stamps[0] < oldest_good:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        stamp = heapq.heappop(self._stamps)
        self._size -= len(self._nonces.pop(stamp))
        self._floor = max(self._floor, stamp)

    def _too_old(self, stamp: int, now: float) -> str:
        age = now - stamp
        if stamp <= self._start_floor:
            return (
                f"this credential was made {age:.0f} s ago, before this node started: a call copied before "
                "the restart, or the caller's clock is behind this node's (set both clocks right)"
            )
        return (
            f"this credential was made {age:.0f} s ago, and this node remembers the calls of the last "
            f"{max(0.0, now - self._floor - 1):.0f} s only (its memory of calls is full, or its clock was "
            "set back): a replayed call, or the caller's clock is behind this node's (set both clocks right)"
        )
