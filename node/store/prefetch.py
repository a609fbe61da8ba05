"""Guesses of the next layer's experts, fetched behind the demands and staged until they are used.

While a layer's experts arrive, the engine applies the next MoE layer's router to this layer's
input and hands the store its guess. Guesses are queued behind every demand (the fetch queue and
the Hub's connection pool take demands first), so a worker starts a guess only when no demand
waits, and one that arrives is staged in its record (store/flights.py), beside the RAM tier and
not in its policy, until the pass it was for takes or drops it. Staged guesses are decoded experts, so they count against the RAM budget:
at most as many guesses are outstanding (in flight or staged) as the RAM tier holds experts, never
fewer than one per fetch worker nor more than MAX_GUESSES_PER_WORKER per worker.

A guess must never delay a demand, and it is only worth its bytes while guesses are mostly right.
Every guess is judged by its pass whether it was fetched or not, so the prefetcher always knows
how good its guesses are now without paying for a wrong one to find out. Over the last
PREFETCH_WINDOW guessed experts (at least MIN_JUDGED of them): below PREFETCH_MIN_ACCURACY
nothing is fetched; from it, guesses are fetched on the link a layer's compute leaves idle; from
SHARE_MIN_ACCURACY, they may also start while a layer's last demanded pieces are still arriving
(the fetch queue's `may_share`). Why a wrong guess is not fetched to find out: docs/benchmarks.md,
"expertmesh bench --model k3-proportions" (guesses judged without being fetched).

A guess is judged among guesses for passes of its own width (`width_class`): one row (decode), a
few (a speculative draft's check), or many (a prompt). A prompt's guess is the union of its rows'
guesses and is judged against the union they route to, which covers most of a layer, so it is
right far more often than a one-row guess; judged together, a prompt would let decode fetch
guesses that are right one time in seven (docs/benchmarks.md, "Issue 44, second session").
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from expertmesh.node.store.flights import Flights, Guessed
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
FEW_ROWS = 16  # a pass of at most this many rows is judged with speculative checks, not prompts


class LayerGuess(NamedTuple):
    """The experts a layer's router would likely choose at the next MoE layer's pass."""

    layer: int  # the next MoE layer
    experts: list[int]
    rows: int = 1  # the rows of the pass that guessed: its guess is judged among guesses as wide


def width_class(rows: int) -> int:
    """0: a one-row pass (decode); 1: a few rows (a draft's check); 2: many (a prompt)."""
    return 0 if rows <= 1 else 1 if rows <= FEW_ROWS else 2


class GuessAccuracy:
    """How many of the last PREFETCH_WINDOW guessed experts their pass wanted, fetched or not, for
    passes of each width class.

    Not a record of anything in flight: windows of judgements and each layer's last guess, under
    a lock of its own that is taken last (fetch workers ask `at_least` under the book's lock).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._judged: dict[int, deque[bool]] = {}  # width class -> its last guessed experts: demanded?
        self._right: dict[int, int] = {}
        self._pending: dict[int, tuple[set[int], int]] = {}  # layer -> its last guess and its width class
        self._latest = 0  # the width class of the latest guess

    def expect(self, layer: int, experts: Iterable[int], width: int = 0) -> None:
        """`experts` is the guess for `layer`'s next pass (it replaces an earlier one)."""
        with self._lock:
            self._pending[layer] = (set(experts), width)
            self._latest = width

    def judge(self, layer: int, demanded: set[int]) -> None:
        with self._lock:
            guessed, width = self._pending.pop(layer, ((), 0))
            judged = self._judged.setdefault(width, deque(maxlen=PREFETCH_WINDOW))
            right = self._right.get(width, 0)
            for e in guessed:
                if len(judged) == judged.maxlen:
                    right -= judged[0]
                judged.append(e in demanded)
                right += e in demanded
            self._right[width] = right

    def at_least(self, share: float, width: int | None = None) -> bool:
        """Whether guesses of `width` (default: the latest guess's) are right at least `share` of the time."""
        with self._lock:
            width = self._latest if width is None else width
            judged = len(self._judged.get(width, ()))
            return judged >= MIN_JUDGED and self._right.get(width, 0) >= share * judged


class Prefetcher:
    """Guesses of the next layer for one store: judged here, queued and staged as records of the
    book of experts in flight (store/flights.py), used or wasted by their pass."""

    def __init__(
        self,
        flights: Flights,
        ram: RamCache,
        stats: StoreStats,
        workers: int,
        enabled: bool = True,
        expert_bytes: int = 1,
    ):
        self.flights = flights
        self.ram = ram
        self.stats = stats
        self.workers = max(1, workers)
        self.enabled = enabled
        self.expert_bytes = expert_bytes
        self.accuracy = GuessAccuracy()

    def budget(self) -> int:
        """Guesses in flight or staged at most: as many as the RAM tier holds (staged guesses
        are decoded experts too), at least one per fetch worker, at most two."""
        slots = self.ram.slots(self.expert_bytes)
        return min(MAX_GUESSES_PER_WORKER * self.workers, max(self.workers, slots))

    def proven(self) -> bool:
        """Whether guesses are right often enough to share the link with demands in flight
        (the fetch queue's `may_share`); until then a fetched guess waits for the demands to end."""
        return self.accuracy.at_least(SHARE_MIN_ACCURACY)

    def wants_guesses(self) -> bool:
        """Whether the engine should guess the next layer: always when enabled, since guesses that
        are not fetched are still judged (that is how poor guesses learn they got better)."""
        return self.enabled

    @property
    def in_flight(self) -> int:
        """Guesses whose fetch has not finished (idle-link fill waits for them)."""
        return self.flights.guesses_in_flight()

    def guess(self, layer: int, experts: Iterable[int], rows: int = 1) -> None:
        """Judge this guess at `layer`'s pass; fetch it at low priority if guesses made by passes
        of as many `rows` are good enough and the budget has room."""
        if not self.enabled:
            return
        experts = [int(e) for e in experts]
        width = width_class(rows)
        self.accuracy.expect(layer, experts, width)
        if not self.accuracy.at_least(PREFETCH_MIN_ACCURACY, width):
            return
        budget = self.budget()
        for e in experts:
            key = (layer, e)
            if key in self.ram:
                continue
            done = self.flights.guess(key, budget)
            if done is Guessed.NO_ROOM:
                return  # enough guesses are in flight or waiting for their pass
            if done is Guessed.ISSUED:
                self.stats.record_prefetch("issued")

    def take(self, key: ExpertKey) -> Fetched | None:
        """The staged guess for `key`, if it arrived (it is a use answered without waiting)."""
        fetched = self.flights.take(key)
        if fetched is not None:
            self.stats.record_prefetch("ready")
        return fetched

    def judge_guesses(self, layer: int, demanded: set[int]) -> None:
        """This layer's pass is here: its guess is judged, and its fetched guesses were used or wasted."""
        self.accuracy.judge(layer, demanded)
        used, wasted = self.flights.judge_guesses(layer, demanded)
        if used:
            self.stats.record_prefetch("used", used)
        if wasted:
            self.stats.record_prefetch("wasted", wasted)
