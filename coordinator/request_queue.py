"""A bounded, first-come-first-served queue in front of the household's generation slots.

A household has few generation slots (one per full node), and a request that waits minutes for
one is worse than a prompt 429 the client can retry. So at most `max_waiting` requests wait, in
arrival order; beyond that the API answers 429 with Retry-After.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager


class QueueFull(Exception):
    pass


class LeftQueue(Exception):
    """The request was cancelled (its client left) while it waited: it gave its place up."""


# How often a waiting request looks again without being woken: whether its client left, and how
# many slots there are (a full node that joins adds slots without notifying the queue).
RECHECK_S = 0.25


class RequestQueue:
    def __init__(self, slots: Callable[[], int], max_waiting: int = 16):
        self._slots = slots  # how many generations may run at once now (full nodes known)
        self.max_waiting = max_waiting
        self._running = 0
        self._waiting: deque[int] = deque()
        self._tickets = itertools.count()
        self._cond = threading.Condition()

    @contextmanager
    def slot(self, timeout_s: float | None = None, cancelled: Callable[[], bool] = lambda: False):
        """Hold one generation slot for the block.

        Raises QueueFull when too many already wait (or none came within `timeout_s`), LeftQueue
        when `cancelled()` turns true while waiting: a client that left must not keep a place
        that a client still there would get a 429 for."""
        with self._cond:
            if self._running < max(1, self._slots()) and not self._waiting:
                self._running += 1
            else:
                if len(self._waiting) >= self.max_waiting:
                    raise QueueFull(f"{len(self._waiting)} requests are already waiting")
                ticket = next(self._tickets)
                self._waiting.append(ticket)
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                try:
                    while not (self._waiting[0] == ticket and self._running < max(1, self._slots())):
                        if cancelled():
                            raise LeftQueue("the request was cancelled while it waited for a slot")
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise QueueFull(f"no generation slot within {timeout_s:.0f} s")
                        self._cond.wait(RECHECK_S if left is None else min(RECHECK_S, left))
                finally:
                    self._waiting.remove(ticket)
                    self._cond.notify_all()
                self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def depth(self) -> tuple[int, int]:
        """(running, waiting) now."""
        with self._cond:
            return self._running, len(self._waiting)
