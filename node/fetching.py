"""What one fetch of an expert is for, passed from the store down the tiers to the range reader.

A fetch is made for a demand (a token waits for it), a guess of the next layer, or idle-link fill,
and the parts below the store treat them differently: the Hub's connection pool serves demands'
pieces first, a guess or a fill gives its connection up when a demand needs the link
(`abandon`), and every request of one Hub fetch shares one time budget (`Deadline`). The store
says so once, in a `FetchContext`, and each layer passes it on as an argument; nothing is read
from the thread a fetch happens to run on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from expertmesh.node import constants


class Priority(IntEnum):
    """Lower is served first."""

    DEMAND = 0  # a token waits for it
    PREFETCH = 1  # a guess of the next layer's experts
    FILL = 2  # idle-link fill onto the disk


class Deadline:
    """The time one fetch may spend asking the Hub, shared by all its requests: its pieces on
    separate connections and every retry of each.

    The clock starts with the fetch's first request, not when the fetch is queued: a guess that
    waits behind demands for a connection must not spend its budget waiting. Every byte that
    arrives adds the time it takes at `earned_bytes_per_s` to the budget: a fetch that keeps
    receiving at least that fast never runs out, however slow a full link makes it, while one
    that stalls or drips (or keeps failing) spends its `seconds` and ends.
    """

    def __init__(self, seconds: float, earned_bytes_per_s: float = 0.0):
        self.seconds = seconds
        self.earned_bytes_per_s = earned_bytes_per_s
        self._ends: float | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the clock, if no request of this fetch started it yet."""
        with self._lock:
            if self._ends is None:
                self._ends = time.monotonic() + self.seconds

    def received(self, nbytes: int) -> None:
        """`nbytes` of the fetch arrived: they earn their time at `earned_bytes_per_s` (not once
        the deadline passed: a fetch that ended for it stays ended)."""
        if self.earned_bytes_per_s > 0:
            with self._lock:
                if self._ends is not None and time.monotonic() < self._ends:
                    self._ends += nbytes / self.earned_bytes_per_s

    def left(self) -> float:
        """Seconds left (the whole budget before the first request)."""
        ends = self._ends
        return self.seconds if ends is None else max(0.0, ends - time.monotonic())

    def passed(self) -> bool:
        ends = self._ends
        return ends is not None and time.monotonic() >= ends


@dataclass(frozen=True)
class FetchContext:
    """What a fetch is for and what bounds it.

    Attributes:
        priority: whom the fetch serves; the Hub's pool takes pieces in this order.
        abandon: asked between the chunks of a transfer; True gives the link up (`Abandoned`).
            None: the fetch runs to its end (a demand's).
        deadline: the budget every request of this fetch shares; the Hub tier sets it per fetch.
    """

    priority: Priority = Priority.DEMAND
    abandon: Callable[[], bool] | None = None
    deadline: Deadline | None = None

    def should_abandon(self) -> bool:
        return self.abandon is not None and self.abandon()

    def with_deadline(self, deadline: Deadline) -> FetchContext:
        return dataclasses.replace(self, deadline=deadline)

    def time_left(self, seconds: float) -> float:
        """`seconds`, cut to what the deadline leaves (never 0: httpx2 reads 0 as no wait)."""
        return seconds if self.deadline is None else max(0.001, min(seconds, self.deadline.left()))


def fetch_bound_s(nbytes: int, budget_s: float, floor_bytes_per_s: float, read_timeout_s: float) -> float:
    """The longest a Hub fetch of `nbytes` with a `Deadline(budget_s, floor_bytes_per_s)` runs: the
    budget, the time its bytes earn at the floor (none arrive on a Hub that stalls), plus one read
    that was in progress when it passed (a read cannot be interrupted, only not followed by another)."""
    earned = nbytes / floor_bytes_per_s if floor_bytes_per_s > 0 else 0.0
    return budget_s + earned + read_timeout_s


def hub_fetch_bound_s(nbytes: int) -> float:
    """`fetch_bound_s` at the default settings (`RangeReader`'s): what an owner fetching an expert
    for a peer may take before it gives up itself."""
    read_s = min(constants.HTTP_TIMEOUT_S, constants.HUB_SPEED_WINDOW_S)
    return fetch_bound_s(nbytes, constants.HUB_FETCH_DEADLINE_S, constants.HUB_MIN_BYTES_PER_S, read_s)


DEMAND = FetchContext()  # a demanded fetch with no bound of its own: what a plain call makes
