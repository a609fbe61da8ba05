"""Guesses of the next layer's experts, fetched behind the demands and staged until they are used.

While a layer's experts arrive, the engine applies the next MoE layer's router to this layer's
input and hands the store its guess. Guesses are queued behind every demand (the fetch queue and
the Hub's connection pool take demands first), so a worker starts a guess only when no demand
waits, and they are staged beside the RAM tier (not in its policy) until the pass they were for
demands or drops them. Staged guesses are decoded experts, so they count against the RAM budget:
at most as many guesses are outstanding (in flight or staged) as the RAM tier holds experts, never
fewer than one per fetch worker nor more than MAX_GUESSES_PER_WORKER per worker.

A guess must never delay a demand, and it is only worth its bytes while guesses are mostly right.
Every guess is judged by its pass whether it was fetched or not, so the prefetcher always knows
how good its guesses are now without paying for a wrong one to find out. Over the last
PREFETCH_WINDOW guessed experts (at least MIN_JUDGED of them): below PREFETCH_MIN_ACCURACY
nothing is fetched; from it, guesses are fetched on the link a layer's compute leaves idle; from
SHARE_MIN_ACCURACY, they may also start while a layer's last demanded pieces are still arriving
(fetch_queue.py's `may_share`). Measured on K3-sized experts with a random model's guesses (17%
right), fetching them anyway cost a cold decode 0.79 of the link's use against 0.95 without.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from expertmesh.node.fetching import Priority
from expertmesh.node.store.fetch_queue import FetchQueue
from expertmesh.node.store.stats import ExpertKey, StoreStats
from expertmesh.node.store.tier_chain import Fetched
from expertmesh.node.store.tiers.ram import RamCache

PREFETCH_WINDOW = 64  # guessed experts the accuracy is judged over
MIN_JUDGED = 16  # fewer judged guesses say nothing yet (K3: one layer's top-k): none fetched
PREFETCH_MIN_ACCURACY = 0.25
# Below this, the bytes a wrong guess takes from a layer's last demanded pieces cost more than a
# right one saves (each right guess is bytes the next layer demands anyway).
SHARE_MIN_ACCURACY = 0.5
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
        self._judged: deque[bool] = deque(maxlen=PREFETCH_WINDOW)  # the last guessed experts: demanded?
        self._judged_right = 0  # how many of them were: read without the lock by fetch workers
        self._pending: dict[int, set[int]] = {}  # layer -> its last guess, fetched or not, to be judged

    def budget(self) -> int:
        """Guesses in flight or staged at most: as many as the RAM tier holds (staged guesses
        are decoded experts too), at least one per fetch worker, at most two."""
        slots = self.ram.slots(self.expert_bytes)
        return min(MAX_GUESSES_PER_WORKER * self.fetches.workers, max(self.fetches.workers, slots))

    def _accuracy_at_least(self, share: float) -> bool:
        """Without the lock (fetch workers ask under the queue's): two reads of counts that settle
        keeps, rather than a walk over the window another thread may be extending."""
        judged, right = len(self._judged), self._judged_right
        return judged >= MIN_JUDGED and right >= share * judged

    def proven(self) -> bool:
        """Whether guesses are right often enough to share the link with demands in flight
        (FetchQueue's `may_share`); until then a fetched guess waits for the demands to end."""
        return self._accuracy_at_least(SHARE_MIN_ACCURACY)

    def wants_guesses(self) -> bool:
        """Whether the engine should guess the next layer: always when enabled, since guesses that
        are not fetched are still judged (that is how poor guesses learn they got better)."""
        return self.enabled

    @property
    def in_flight(self) -> int:
        """Guesses whose fetch has not finished (idle-link fill waits for them)."""
        return len(self._prefetching)

    def guess(self, layer: int, experts: Iterable[int]) -> None:
        """Judge this guess at `layer`'s pass; fetch it at low priority if guesses are good enough
        and the workers have room."""
        if not self.enabled:
            return
        experts = [int(e) for e in experts]
        with self._lock:
            self._pending[layer] = set(experts)
        if not self._accuracy_at_least(PREFETCH_MIN_ACCURACY):
            return
        budget = self.budget()
        for e in experts:
            key = (layer, e)
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
            self.fetches.submit(key, Priority.PREFETCH)

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
        """This layer's pass is here: its guess is judged, and its fetched guesses were used or wasted."""
        with self._lock:
            for e in self._pending.pop(layer, ()):
                if len(self._judged) == self._judged.maxlen:
                    self._judged_right -= self._judged[0]
                self._judged.append(e in demanded)
                self._judged_right += e in demanded
            mine = [k for k in self._guessed if k[0] == layer]
            used = [k for k in mine if k[1] in demanded]
            wasted = [k for k in mine if k[1] not in demanded]
            for k in mine:
                self._guessed.discard(k)
            for k in wasted:
                self._staged.pop(k, None)
        if used:
            self.stats.record_prefetch("used", len(used))
        if wasted:
            self.stats.record_prefetch("wasted", len(wasted))
