"""Guesses of the next layer's experts, fetched behind the demands and staged until they are used.

While a layer's experts arrive, the engine applies the next MoE layer's router to this layer's
input and hands the store its guess. Guesses are queued behind every demand (the fetch queue and
the Hub's connection pool take demands first), so a worker starts a guess only when no demand
waits, and they are staged beside the RAM tier (not in its policy) until the pass they were for
demands or drops them. Staged guesses are decoded experts, so they count against the RAM budget:
at most as many guesses are outstanding (in flight or staged) as the RAM tier holds experts, never
fewer than one per fetch worker nor more than MAX_GUESSES_PER_WORKER per worker. A guess must never delay a demand, and it is only worth its
compute while guesses are mostly right: below PREFETCH_MIN_ACCURACY over the last
PREFETCH_WINDOW guesses, prefetch pauses for PREFETCH_PAUSE_CALLS layer calls, then tries again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from expertmesh.node.store.fetch_queue import FetchQueue
from expertmesh.node.store.priority import PREFETCH
from expertmesh.node.store.stats import ExpertKey, StoreStats
from expertmesh.node.store.tier_chain import Fetched
from expertmesh.node.store.tiers.ram import RamCache

PREFETCH_WINDOW = 64
PREFETCH_MIN_ACCURACY = 0.25
PREFETCH_PAUSE_CALLS = 512
MAX_GUESSES_PER_WORKER = 2  # K3: 16 guesses (one layer's top-k) with 8 fetch workers


class Prefetcher:
    def __init__(
        self, fetches: FetchQueue, ram: RamCache, stats: StoreStats, enabled: bool = True, expert_bytes: int = 1
    ):
        self.fetches = fetches
        self.expert_bytes = expert_bytes
        self.ram = ram
        self.stats = stats
        self.enabled = enabled
        self._lock = threading.Lock()
        self._guessed: set[ExpertKey] = set()  # prefetched, not yet used or wasted
        self._staged: dict[ExpertKey, Fetched] = {}  # prefetched and arrived
        self._prefetching: set[ExpertKey] = set()  # guesses whose fetch has not finished
        self._window = [0, 0]  # used, wasted since the last accuracy check
        self._paused_calls = 0  # prefetch pauses for this many layer calls after poor guesses

    def budget(self) -> int:
        """Guesses in flight or staged at most: as many as the RAM tier holds (staged guesses
        are decoded experts too), at least one per fetch worker, at most two."""
        slots = self.ram.slots(self.expert_bytes)
        return min(MAX_GUESSES_PER_WORKER * self.fetches.workers, max(self.fetches.workers, slots))

    def wants_guesses(self) -> bool:
        """Whether guessing the next layer is worth its (small) compute right now."""
        return self.enabled and self._paused_calls == 0

    @property
    def in_flight(self) -> int:
        """Guesses whose fetch has not finished (idle-link fill waits for them)."""
        return len(self._prefetching)

    def guess(self, layer: int, experts: Iterable[int]) -> None:
        """Fetch likely experts of `layer` at low priority, if the workers have room and guesses pay."""
        if not self.wants_guesses():
            return
        budget = self.budget()
        for e in experts:
            key = (layer, int(e))
            if key in self.ram:
                continue
            in_flight = self.fetches.in_flight(key)
            with self._lock:
                if len(self._prefetching) + len(self._staged) >= budget:
                    return  # enough guesses are in flight or waiting for their pass
                if in_flight or key in self._staged:
                    continue
                self._guessed.add(key)
                self._prefetching.add(key)
            self.stats.record_prefetch("issued")
            self.fetches.submit(key, PREFETCH)

    def stale(self, key: ExpertKey) -> bool:
        """A guess whose pass has come and did not want it: its fetch may give the link up."""
        return key not in self._guessed

    def arrived(self, key: ExpertKey, fetched: Fetched | None) -> None:
        """A queued fetch ended (FetchQueue's `finished`): stage it if it is a guess not yet used."""
        with self._lock:
            self._prefetching.discard(key)
            if key in self._guessed and fetched is not None:
                self._staged[key] = fetched

    def take(self, key: ExpertKey) -> Fetched | None:
        """The staged guess for `key`, if it arrived (it is a use answered without waiting)."""
        with self._lock:
            fetched = self._staged.pop(key, None)
        if fetched is not None:
            self.stats.record_prefetch("ready")
        return fetched

    def settle(self, layer: int, demanded: set[int]) -> None:
        """This layer's pass is here: its guesses were used or wasted."""
        with self._lock:
            if self._paused_calls:
                self._paused_calls -= 1
            mine = [k for k in self._guessed if k[0] == layer]
            used = [k for k in mine if k[1] in demanded]
            wasted = [k for k in mine if k[1] not in demanded]
            for k in mine:
                self._guessed.discard(k)
            for k in wasted:
                self._staged.pop(k, None)
            self._window[0] += len(used)
            self._window[1] += len(wasted)
            if sum(self._window) >= PREFETCH_WINDOW:
                if self._window[0] < PREFETCH_MIN_ACCURACY * sum(self._window):
                    self._paused_calls = PREFETCH_PAUSE_CALLS  # poor guesses: stop, then try again
                self._window = [0, 0]
        if used:
            self.stats.record_prefetch("used", len(used))
        if wasted:
            self.stats.record_prefetch("wasted", len(wasted))
