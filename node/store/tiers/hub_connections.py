"""How many Hub connections carry pieces at once: grown while more connections carry more.

A home link fills when connections × what each connection carries ≥ the link. What a connection
carries is the CDN's choice, not the link's: 12.5 of 100 MB/s is typical, some Xet bridge edges
cap a connection near 8.7 MB/s, others give 50 (issue 36). A fixed count is either too few for
the slow edges or more than the fast ones need, and the link's rate is not known in advance.

So the count is measured, not assumed. It starts at the configured count (`--hub-connections`)
and the rate of every finished piece (its bytes ÷ its time, first byte included: a connection
waiting for its first byte carries nothing either) is noted with how many pieces were in flight
when it started. Once enough pieces have finished with (nearly) every allowed connection busy,
what the connections carry together (the median rate of a piece × the count) is compared with
what they carried at the count before: while a count half again as large (`GROW`) carries at
least `GAIN` more, the link had room, and the next is tried, up to `most`; the first that does
not goes back to the count before, which filled the link (more pieces in flight would only share
it with the demands': a guess's or a fill's bytes slow a demand's whatever the pool's order).
The count then stays: a CDN's per-connection share is a property of its edge, not of the moment.
"""

from __future__ import annotations

import math
import statistics
import threading

GROW = 1.5  # the next count tried, as a multiple of the current one
GAIN = 0.05  # what a larger count must add to what the connections carry together to be kept
SATURATED = 0.75  # a piece counts when at least this share of the allowed connections was busy
PIECES_PER_CONNECTION = 2  # pieces measured per allowed connection before a count is judged


class AdaptiveConnections:
    """The allowed count of one Hub tier's connections, between `start` and `most`."""

    def __init__(self, start: int, most: int):
        self.start = max(1, start)
        self.most = max(self.start, most)
        self._allowed = self.start
        self._lock = threading.Lock()
        self._rates: list[float] = []  # bytes/s of pieces finished with the allowed connections busy
        self._before: float | None = None  # what the connections carried together at the count before
        self._previous = self.start  # the count before
        self.converged = self.most == self.start  # no larger count left to try

    @property
    def allowed(self) -> int:
        return self._allowed

    def record(self, nbytes: int, seconds: float, busy_at_start: int) -> int | None:
        """A piece of `nbytes` finished in `seconds`, `busy_at_start` pieces in flight (itself
        included) when it started. Returns the new count when it changes, else None."""
        if self.converged or seconds <= 0 or nbytes <= 0:
            return None
        with self._lock:
            if busy_at_start < SATURATED * self._allowed:
                return None  # too few pieces to fill the connections: says nothing of the link
            self._rates.append(nbytes / seconds)
            if len(self._rates) < PIECES_PER_CONNECTION * self._allowed:
                return None
            total = statistics.median(self._rates) * self._allowed
            self._rates = []
            if self._before is not None and total < (1 + GAIN) * self._before:
                self.converged = True  # the link was full at the count before
                self._allowed = self._previous
                return self._allowed
            self._before, self._previous = total, self._allowed
            self._allowed = min(self.most, math.ceil(self._allowed * GROW))
            self.converged = self._allowed == self.most
            return self._allowed
