"""Bounded waiting for things that happen in their own time in tests (fills, advertisements)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0, interval_s: float = 0.05) -> bool:
    """True once `condition()` holds, False after `timeout_s`: every test loop stays bounded in time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
