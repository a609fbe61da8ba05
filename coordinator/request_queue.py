"""A bounded, first-come-first-served queue in front of the household's generation slots.

A household has few generation slots (one per full node), and a request that waits minutes for
one is worse than a prompt 429 the client can retry. So at most `max_waiting` requests wait, in
arrival order; beyond that the API answers 429 with Retry-After.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager


class QueueFull(Exception):
    pass


class RequestQueue:
    def __init__(self, slots: Callable[[], int], max_waiting: int = 16):
        self._slots = slots  # how many generations may run at once now (full nodes known)
        self.max_waiting = max_waiting
        self._running = 0
        self._waiting: deque[int] = deque()
        self._tickets = itertools.count()
        self._cond = threading.Condition()

    @contextmanager
    def slot(self, timeout_s: float | None = None):
        """Hold one generation slot for the block; raises QueueFull when too many already wait."""
        with self._cond:
            if self._running < max(1, self._slots()) and not self._waiting:
                self._running += 1
            else:
                if len(self._waiting) >= self.max_waiting:
                    raise QueueFull(f"{len(self._waiting)} requests are already waiting")
                ticket = next(self._tickets)
                self._waiting.append(ticket)
                try:
                    ok = self._cond.wait_for(
                        lambda: self._waiting[0] == ticket and self._running < max(1, self._slots()), timeout_s
                    )
                finally:
                    self._waiting.remove(ticket)
                    self._cond.notify_all()
                if not ok:
                    raise QueueFull(f"no generation slot within {timeout_s:.0f} s")
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
