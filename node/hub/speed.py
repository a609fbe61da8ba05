"""Telling a broken Hub connection from a full link.

A connection to a CDN edge that drips bytes would hold a fetch for good, so a response arriving
below a floor for a window is given up and asked again on another connection (curl's
--speed-limit/--speed-time). But a connection is also slow when the link it shares is full: a
node's dozen connections on a slow home link, or a household's nodes on one link, each get less
than the floor although nothing is broken, and giving them up only asks the same full link again.

So a window below the floor is judged against what the node's other connections carry in the
same window (`LinkMeter`, one per reader): the connection is given up when the node as a whole
receives less than the floor (the Hub, not the link, is what is slow: every connection drips),
or when it carries far less than its siblings' mean (a broken edge among working ones). A
connection slow only because it gets its share of a full link is kept. A stall is caught apart
from this: silence for a whole window ends a read (client.py's read timeout).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# A connection below the floor is given up when it carries less than this share of its siblings'
# mean: a link shared by fair TCP flows spreads them far less than that, a broken edge far more.
SHARE_FLOOR = 1 / 8


@dataclass(frozen=True)
class LinkTotals:
    """What a reader's responses received together up to `at` (monotonic): bytes, and seconds
    of responses open (the sum over responses of how long each was open)."""

    at: float
    nbytes: int
    open_s: float


class LinkMeter:
    """Counts the bytes every response of one reader receives, and how many are open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = time.monotonic()
        self._nbytes = 0
        self._open = 0
        self._open_s = 0.0

    def _advance(self, now: float) -> None:
        self._open_s += self._open * max(0.0, now - self._at)
        self._at = max(self._at, now)

    @contextlib.contextmanager
    def reading(self) -> Iterator[LinkTotals]:
        """One response open, from when it is asked (its first byte's wait shares the link too)
        until it ends; yields the totals when it was asked, where its first window starts."""
        with self._lock:
            self._advance(time.monotonic())
            self._open += 1
            asked = LinkTotals(self._at, self._nbytes, self._open_s)
        try:
            yield asked
        finally:
            with self._lock:
                self._advance(time.monotonic())
                self._open -= 1

    def received(self, nbytes: int) -> None:
        with self._lock:
            self._nbytes += nbytes

    def totals(self) -> LinkTotals:
        with self._lock:
            self._advance(time.monotonic())
            return LinkTotals(self._at, self._nbytes, self._open_s)


def too_slow(nbytes: int, seconds: float, link_bytes: int, link_open_s: float, floor_bytes_per_s: float) -> str | None:
    """Why a connection that received `nbytes` in `seconds` is given up, or None to keep it, given
    that every response of its reader received `link_bytes` in the same `seconds`, with
    `link_open_s` seconds of responses open (its own included)."""
    if floor_bytes_per_s <= 0 or seconds <= 0 or nbytes >= floor_bytes_per_s * seconds:
        return None
    rate = (
        f"{nbytes / seconds / 1024:.1f} kB/s for {seconds:.1f} s, below the floor of {floor_bytes_per_s / 1024:g} kB/s"
    )
    if link_bytes < floor_bytes_per_s * seconds:
        return f"{rate}, and all connections together were below it too; the connection was given up"
    mean = link_bytes / link_open_s if link_open_s > 0 else float("inf")
    if nbytes / seconds < SHARE_FLOOR * mean:
        return f"{rate}, its siblings' mean {mean / 1024:.1f} kB/s; the connection was given up"
    return None  # slow because the link it shares is full: asking again would ask the same link


class SpeedWindow:
    """One response's bytes, judged per window of `window_s` against its reader's link: `give_up`
    is called with the reason when a window is too slow (`too_slow`), and raises."""

    def __init__(
        self,
        asked: LinkTotals,
        window_s: float,
        floor_bytes_per_s: float,
        link: LinkMeter,
        give_up: Callable[[str], None],
    ):
        """`asked`: the link's totals when the response was asked for (`LinkMeter.reading`): the
        first window counts the wait for the first byte, as curl's."""
        self.window_s, self.floor_bytes_per_s = window_s, floor_bytes_per_s
        self.link, self.give_up = link, give_up
        self.started_at, self.bytes_before, self.link_before = asked.at, 0, asked

    def count(self, n: int) -> None:
        """`n` bytes have come in all."""
        now = time.monotonic()
        seconds = now - self.started_at
        if seconds < self.window_s:
            return
        link = self.link.totals()
        reason = too_slow(
            n - self.bytes_before,
            seconds,
            link.nbytes - self.link_before.nbytes,
            link.open_s - self.link_before.open_s,
            self.floor_bytes_per_s,
        )
        if reason is not None:
            self.give_up(reason)
        self.started_at, self.bytes_before, self.link_before = now, n, link
