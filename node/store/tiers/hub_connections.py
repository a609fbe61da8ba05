"""How many Hub connections carry pieces at once: grown while more connections carry more.

A home link fills when connections × what each connection carries ≥ the link. What a connection
carries is the CDN's choice, not the link's: 12.5 of 100 MB/s is typical, some Xet bridge edges
cap a connection near 8.7 MB/s, others give 50 (issue 36). A fixed count is either too few for
the slow edges or more than the fast ones need, and the link's rate is not known in advance.

So the count is measured, not assumed. It starts at the configured count (`--hub-connections`)
and every finished piece is noted with how many pieces were in flight when it started. Once
enough pieces have finished with (nearly) every allowed connection busy, what the connections
carried together — the bytes of those pieces over the time from the first one's end to the last
one's, first bytes' waits included (a connection waiting for one carries nothing either) — is
compared with what they carried at the count before: while a count half again as large (`GROW`)
carries at least `GAIN` more, the link had room, and the next is tried, up to `most`; the first
that does not goes back to the count before, which filled the link (more pieces in flight would only share
it with the demands': a guess's or a fill's bytes slow a demand's whatever the pool's order).
The count then stays: a CDN's per-connection share is a property of its edge, not of the moment.

What they carried together is the bytes over the window's time, not the median piece's rate times
the count: on a link that is full, pieces share it unevenly (some wait longer for their share), and
the median of such rates times a larger count read as a gain that the link did not give, so the
count climbed to its most however full the link already was; each connection more costs the
fetch path CPU for the same bytes (issue 44).
"""

from __future__ import annotations

import math
import threading
import time

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
        self._pieces = 0  # pieces finished with the allowed connections busy, in this window
        self._bytes = 0  # their bytes, the first one's excepted (the window starts at its end)
        self._since: float | None = None  # when the window's first piece ended
        self._last = 0.0  # when its last piece ended
        self._before: float | None = None  # what the connections carried together at the count before
        self._previous = self.start  # the count before
        self.converged = self.most == self.start  # no larger count left to try

    @property
    def allowed(self) -> int:
        return self._allowed

    def record(self, nbytes: int, seconds: float, busy_at_start: int, ended_at: float | None = None) -> int | None:
        """A piece of `nbytes` finished in `seconds` at `ended_at` (monotonic; default now),
        `busy_at_start` pieces in flight (itself included) when it started. Returns the new count
        when it changes, else None."""
        if self.converged or seconds <= 0 or nbytes <= 0:
            return None
        ended_at = time.monotonic() if ended_at is None else ended_at
        with self._lock:
            if busy_at_start < SATURATED * self._allowed:
                return None  # too few pieces to fill the connections: says nothing of the link
            self._pieces += 1
            if self._since is None:
                self._since = ended_at
            else:
                self._bytes += nbytes
                self._last = max(self._last, ended_at)
            if self._pieces < PIECES_PER_CONNECTION * self._allowed or self._last <= self._since:
                return None
            total = self._bytes / (self._last - self._since)
            self._pieces, self._bytes, self._since, self._last = 0, 0, None, 0.0
            if self._before is not None and total < (1 + GAIN) * self._before:
                self.converged = True  # the link was full at the count before
                self._allowed = self._previous
                return self._allowed
            self._before, self._previous = total, self._allowed
            self._allowed = min(self.most, math.ceil(self._allowed * GROW))
            self.converged = self._allowed == self.most
            return self._allowed
