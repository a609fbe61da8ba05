"""The fetch workers: a pool of threads that fetch what the book of experts in flight gives them.

What to fetch next, and for whom, is the book's (store/flights.py: demands before guesses, a guess
held back while demands are fetched until guesses have proven right); a worker asks it for the
next fetch, makes it through the tier chain with a FetchContext (node/fetching.py) saying whom it
serves, and hands the result back. A guess's fetch asks the book between chunks whether its pass
has proven it wrong (`abandon`), and gives its link up if so and no demand has come for it; if one
came just as it gave up, the book says so and the worker fetches it again, for that demand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from expertmesh.node.errors import without_locals
from expertmesh.node.fetching import FetchContext, Priority
from expertmesh.node.store.flights import Flights
from expertmesh.node.store.stats import ExpertKey
from expertmesh.node.store.tier_chain import Fetched

CLOSE_TIMEOUT_S = 10.0


class FetchQueue:
    """`workers` threads fetching the experts `flights` has queued, at most once each at a time.

    Args:
        flights: the book of experts in flight, which demands and guesses are queued in.
        fetch_one: fetches one expert (TierChain.fetch; it takes a `ctx`).
        fetch_run: fetches a run of adjacent experts, one result or exception each (TierChain.fetch_run).
        may_share: whether a guess may start while demands are being fetched (the prefetcher's
            `proven`); None: always.
    """

    def __init__(
        self,
        flights: Flights,
        fetch_one: Callable[..., Fetched],
        fetch_run: Callable[..., list[Fetched | BaseException]],
        workers: int,
        may_share: Callable[[], bool] | None = None,
    ):
        self.flights = flights
        self._fetch_one = fetch_one
        self._fetch_run = fetch_run
        self._may_share = may_share
        self.workers = max(1, workers)
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._work, name=f"expert-fetch-{i}", daemon=True) for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    def alive(self) -> int:
        """Workers still running (each one lost would leave queued fetches waiting longer)."""
        return sum(t.is_alive() for t in self._threads)

    def _work(self) -> None:
        while True:
            work = self.flights.next_work(self._may_share)
            if work is None:
                return
            if work.is_run:
                self._fetch_adjacent(work.keys)
            else:
                self._fetch(work.keys[0], work.priority)
            del work  # nothing of this fetch stays referenced while the worker waits for the next

    def _fetch(self, key: ExpertKey, priority: Priority) -> None:
        while True:
            abandon = None
            if priority == Priority.PREFETCH:

                def abandon(key: ExpertKey = key) -> bool:
                    return self.flights.stale(key)

            try:
                fetched, error = self._fetch_one(key, ctx=FetchContext(priority, abandon)), None
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                fetched, error = None, without_locals(e)
            if self.flights.fetched(key, fetched, error):
                return
            priority = Priority.DEMAND  # a demand came as the guess gave up: fetched to the end for it

    def _fetch_adjacent(self, keys: tuple[ExpertKey, ...]) -> None:
        try:
            results = self._fetch_run(list(keys), ctx=FetchContext(Priority.DEMAND))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            results = [without_locals(e)] * len(keys)
        self.flights.fetched_run(keys, results)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Close the book (queued fetches fail at once) and join the workers, bounded: one may be
        mid-fetch until its tier closes."""
        self.flights.close()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
