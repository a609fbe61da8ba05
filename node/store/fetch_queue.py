"""Single flight over a priority queue served by a pool of fetch workers.

There is one future per expert in flight: whoever asks for an expert that is already being
fetched waits for that fetch, and a demand for a queued guess moves it ahead. Entries are taken
demands first, then guesses (node/fetching.py); idle-link fill claims its experts outside the
queue, so a demand for one of them joins the fill instead of fetching it twice.

`changed` is notified whenever the demand work or the experts in flight change: idle-link fill
waits on it for the link to be free instead of polling.

A fetch nobody waits for gives its link up to demands: a guess the pass proved wrong (`stale`)
is abandoned mid-transfer, and so is a fill (store/fill.py) while a demand waits — unless a demand
has since come for that very expert, which is then fetched to the end. A guess does not even start
while demands are being fetched, unless guesses have proven right (`may_share`): the pool takes
demands first, but bytes in flight share the link, and a wrong guess started in a layer's tail
slows its last demanded pieces. Held back, it uses only the link the layer's compute leaves idle.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from expertmesh.node.errors import Abandoned, settled
from expertmesh.node.fetching import FetchContext, Priority
from expertmesh.node.store.stats import ExpertKey
from expertmesh.node.store.tier_chain import Fetched

DEMAND, PREFETCH = Priority.DEMAND, Priority.PREFETCH

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
# A guess held back while demands are fetched starts anyway after this long (a bound, not a policy).
GUESS_HOLD_MAX_S = 10.0


@dataclass(frozen=True)
class _Run:
    """Demanded experts lying back to back in a shard: one queue entry, one set of Hub requests."""

    keys: tuple[ExpertKey, ...]


class FetchQueue:
    """Fetches experts with `workers` threads, at most once each at a time.

    Args:
        fetch_one: fetches one expert (TierChain.fetch; it takes a `ctx`, node/fetching.py).
        fetch_run: fetches a run of adjacent experts, one result or exception each (TierChain.fetch_run).
        finished: called with (key, result or None) when a queued fetch ends, before its waiters
            wake: the prefetcher stages guesses that nobody demanded yet.
    """

    def __init__(
        self,
        fetch_one: Callable[..., Fetched],
        fetch_run: Callable[..., list[Fetched | BaseException]],
        workers: int,
        finished: Callable[[ExpertKey, Fetched | None], None] | None = None,
        stale: Callable[[ExpertKey], bool] | None = None,
        may_share: Callable[[], bool] | None = None,
    ):
        """`stale(key)`: a guess no pass wants any more (the prefetcher knows); `may_share()`: whether
        guesses may start while demands are being fetched (None: always)."""
        self._fetch_one = fetch_one
        self._stale = stale
        self._may_share = may_share
        self._fetch_run = fetch_run
        self._finished = finished
        self.workers = max(1, workers)
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        self._inflight: dict[ExpertKey, Future] = {}
        self._started: set[ExpertKey] = set()
        self._demanded: set[ExpertKey] = set()  # in flight, and a demand waits for it
        self._queued_demands = 0
        self._running_demands = 0
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._work, name=f"expert-fetch-{i}", daemon=True) for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    # -- what is going on ---------------------------------------------------------------------

    def in_flight(self, key: ExpertKey) -> bool:
        with self._lock:
            return key in self._inflight

    def in_flight_count(self) -> int:
        with self._lock:
            return len(self._inflight)

    def demanded(self, key: ExpertKey) -> bool:
        """Whether a demand waits for `key` (then its fetch is never abandoned)."""
        return key in self._demanded

    @property
    def queued_demands(self) -> int:
        return self._queued_demands

    @property
    def demand_busy(self) -> bool:
        """Whether any demand is queued or being fetched."""
        return bool(self._queued_demands or self._running_demands)

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # -- asking -------------------------------------------------------------------------------

    def submit(self, key: ExpertKey, priority: int) -> Future:
        """The future of `key`'s fetch, queued at `priority` unless it is in flight already."""
        with self._lock:
            if priority == DEMAND:
                self._demanded.add(key)
            fut = self._inflight.get(key)
            if fut is None:
                fut = Future()
                self._inflight[key] = fut
            elif priority == PREFETCH or key in self._started:
                return fut
            if priority == DEMAND:
                self._queued_demands += 1
            self._queue.put((priority, next(self._seq), key))
            self.changed.notify_all()
            return fut

    def submit_demands(
        self, keys: list[ExpertKey], plan: Callable[[list[ExpertKey]], list[list[ExpertKey]]] | None = None
    ) -> dict[ExpertKey, Future]:
        """Demand `keys`; `plan` groups those not in flight into runs (store/runs.py), each of two
        or more experts fetched as one queue entry. Every key's future is returned."""
        waiting: dict[ExpertKey, Future] = {}
        if plan is not None:
            with self._lock:
                for run in plan([k for k in sorted(keys) if k not in self._inflight]):
                    if len(run) < 2:
                        continue
                    for key in run:  # started at once: a later demand or guess for one of them joins its future
                        waiting[key] = self._inflight[key] = Future()
                        self._started.add(key)
                        self._demanded.add(key)
                    self._queued_demands += 1
                    self._queue.put((DEMAND, next(self._seq), _Run(tuple(run))))
                self.changed.notify_all()
        for key in keys:
            if key not in waiting:
                waiting[key] = self.submit(key, DEMAND)
        return waiting

    def claim(self, keys: Iterable[ExpertKey]) -> list[Future]:
        """Register `keys` as in flight for a fetch made outside the queue (idle-link fill)."""
        with self._lock:
            futs = []
            for key in keys:
                futs.append(self._inflight.setdefault(key, Future()))
                self._started.add(key)
            return futs

    def release(self, keys: Iterable[ExpertKey]) -> set[ExpertKey]:
        """The claimed fetch of `keys` is over (its futures are the caller's to resolve); returns
        those a demand waits for: from here on a new demand makes a new fetch, so this is final."""
        with self._lock:
            demanded = set()
            for key in keys:
                self._inflight.pop(key, None)
                self._started.discard(key)
                if key in self._demanded:
                    demanded.add(key)
                    self._demanded.discard(key)
            self.changed.notify_all()
            return demanded

    def release_unless_demanded(self, key: ExpertKey) -> bool:
        """Give up a claimed fetch that no demand waits for (its future is the caller's to fail);
        False, and the claim kept, when one does."""
        with self._lock:
            if key in self._demanded:
                return False
            self._inflight.pop(key, None)
            self._started.discard(key)
            self.changed.notify_all()
            return True

    # -- the workers --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            priority, _, key = self._queue.get()
            if key is None:
                return
            if isinstance(key, _Run):
                self._work_run(key.keys)
                continue
            with self._lock:
                if priority == DEMAND:
                    self._queued_demands -= 1
                if key in self._started or key not in self._inflight:
                    self.changed.notify_all()
                    continue  # a duplicate entry of a guess that a demand moved up
                if priority == PREFETCH and (
                    self._hold_guess(key) or key in self._started or key not in self._inflight
                ):
                    continue  # put back behind a demand, or left to its demand's own entry (or fetched by it already)
                self._started.add(key)
                fut = self._inflight[key]
                self._running_demands += priority == DEMAND
            fetched, error = self._fetch_guarded(key, priority)
            while isinstance(error, Abandoned):
                with self._lock:
                    if key not in self._demanded:  # decided under the lock: a later demand makes a new fetch
                        self._leave(key, priority)
                        break
                    self._running_demands += priority != DEMAND
                    priority = DEMAND  # a demand joined after the guess gave up: fetch it for the demand
                fetched, error = self._fetch_guarded(key, priority)
            else:
                if self._finished is not None:
                    self._finished(key, fetched)
                with self._lock:
                    self._leave(key, priority)
            if error is not None:
                if self._finished is not None and isinstance(error, Abandoned):
                    self._finished(key, None)
                fut.set_exception(error)
            else:
                fut.set_result(fetched)

    def _hold_guess(self, key: ExpertKey) -> bool:
        """Under the lock: wait while demands are being fetched, unless guesses may share the link
        or this guess's pass has come (then the fetch gives up at once). True when this entry is
        done with: a demand was queued meanwhile (the guess went back in the queue behind it), or
        one came for this very expert (its own queue entry fetches it, as a demand)."""
        deadline = time.monotonic() + GUESS_HOLD_MAX_S
        while self._running_demands or self._queued_demands:
            if key in self._demanded:
                return True
            if self._queued_demands:  # this worker is wanted for a demand
                self._queue.put((PREFETCH, next(self._seq), key))
                self.changed.notify_all()
                return True
            if self._asks_to_go(key):
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.wait(left)
        return False

    def _asks_to_go(self, key: ExpertKey) -> bool:
        """Whether guesses may share the link, or this one's pass has come. The callbacks run on a
        fetch worker under the queue's lock: if one fails the guess goes, rather than the worker
        dying and leaving every later demand waiting for a future nobody resolves."""
        try:
            return bool(self._may_share is None or self._may_share() or (self._stale and self._stale(key)))
        except Exception:  # logged; the fetch itself decides the rest
            logger.exception("a held guess's check failed; fetching it")
            return True

    def _leave(self, key: ExpertKey, priority: int) -> None:
        """`key` is no longer in flight (called under the lock)."""
        self._running_demands -= priority == DEMAND
        self._inflight.pop(key, None)
        self._started.discard(key)
        self._demanded.discard(key)
        self.changed.notify_all()

    def _fetch_guarded(self, key: ExpertKey, priority: int) -> tuple[Fetched | None, BaseException | None]:
        """Fetch `key`; a guess gives its link up once it proves wrong and no demand waits for it."""
        abandon = None
        if priority == PREFETCH and self._stale is not None:

            def abandon(key=key) -> bool:
                return key not in self._demanded and self._stale(key)

        try:
            return self._fetch_one(key, ctx=FetchContext(Priority(priority), abandon)), None
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            return None, settled(e)

    def _work_run(self, keys: tuple[ExpertKey, ...]) -> None:
        with self._lock:
            self._queued_demands -= 1
            self._running_demands += 1
            futs = [self._inflight[key] for key in keys]
        try:
            results = self._fetch_run(list(keys), ctx=FetchContext(Priority.DEMAND))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            results = [settled(e)] * len(keys)
        with self._lock:
            self._running_demands -= 1
            for key in keys:
                self._inflight.pop(key, None)
                self._started.discard(key)
                self._demanded.discard(key)
            self.changed.notify_all()
        for fut, result in zip(futs, results):
            if isinstance(result, BaseException):
                fut.set_exception(settled(result))
            else:
                fut.set_result(result)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the workers before any queued fetch; join them, bounded (one may be mid-fetch)."""
        for _ in self._threads:
            self._queue.put((-1, -1, None))
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.notify()
