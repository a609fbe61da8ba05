"""The fetch queue's rules, with a scripted tier: one fetch per expert however many ask, demands
before guesses, and a guess that proved wrong gives its link up unless a demand came for it."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from expertmesh.node.errors import Abandoned, DownloadError
from expertmesh.node.fetching import DEMAND as DEMAND_CTX
from expertmesh.node.fetching import FetchContext, Priority
from expertmesh.node.store.fetch_queue import FetchQueue
from expertmesh.node.store.tier_chain import Fetched

DEMAND, PREFETCH = Priority.DEMAND, Priority.PREFETCH


class _SlowTier:
    """Takes `steps` x 5 ms per expert, asking `ctx.abandon` between steps, as the Hub tier does between chunks."""

    def __init__(self, steps: int = 40):
        self.steps = steps
        self.started: list = []
        self.lock = threading.Lock()

    def fetch(self, key, keep_now: bool = False, ctx: FetchContext = DEMAND_CTX) -> Fetched:
        with self.lock:
            self.started.append(key)
        for _ in range(self.steps):
            if ctx.should_abandon():
                raise Abandoned(f"{key} gave up")
            time.sleep(0.005)
        return Fetched(weights=None, source="hub", seconds=0.0)

    def fetch_run(self, keys, keep_now: bool = False, ctx: FetchContext = DEMAND_CTX) -> list:
        return [self.fetch(k, keep_now, ctx) for k in keys]


def _queue(tier: _SlowTier, stale: set, workers: int = 1) -> FetchQueue:
    q = FetchQueue(tier.fetch, tier.fetch_run, workers, stale=lambda key: key in stale)
    q.start()
    return q


def test_a_wrong_guess_gives_its_link_up_and_a_wanted_one_does_not() -> None:
    tier, stale = _SlowTier(), set()
    q = _queue(tier, stale)
    try:
        wrong = q.submit((1, 1), PREFETCH)
        stale.add((1, 1))  # its pass came and did not want it
        with pytest.raises(Abandoned):
            wrong.result(timeout=10)
        guess = q.submit((1, 2), PREFETCH)
        assert q.submit((1, 2), DEMAND) is guess  # the demand joins the guess's fetch
        stale.add((1, 2))  # settled: no longer a pending guess, but a demand waits for it
        assert guess.result(timeout=10).source == "hub"
        assert not q.demanded((1, 2)) and q.in_flight_count() == 0
    finally:
        q.close()


def test_demands_go_before_queued_guesses_and_each_expert_is_fetched_once() -> None:
    tier, stale = _SlowTier(steps=4), set()
    q = _queue(tier, stale)
    try:
        first = q.submit((1, 0), DEMAND)  # occupies the one worker
        guesses = [q.submit((2, e), PREFETCH) for e in range(3)]
        demands = [q.submit((3, e), DEMAND) for e in range(3)]
        again = q.submit((3, 0), DEMAND)
        assert again is demands[0]
        for f in [first, *demands, *guesses]:
            f.result(timeout=10)
        order = tier.started
        assert order[0] == (1, 0) and order[1:4] == [(3, 0), (3, 1), (3, 2)]  # demands, then guesses
        assert len(order) == len(set(order)) == 7
    finally:
        q.close()


def test_a_demand_that_comes_as_a_guess_gives_up_gets_the_expert_not_the_give_up() -> None:
    # the demand arrives after the guess's fetch decided to give up but before the guess left the
    # queue's books (here: while its ending is reported): it must never wait for the give-up
    tier, stale, asked = _SlowTier(steps=4), {(1, 1)}, {}
    q: FetchQueue

    def finished(key, fetched) -> None:
        if fetched is None and key not in asked:
            asked[key] = q.submit(key, DEMAND)

    q = FetchQueue(tier.fetch, tier.fetch_run, 1, finished=finished, stale=lambda key: key in stale)
    q.start()
    try:
        with pytest.raises(Abandoned):
            q.submit((1, 1), PREFETCH).result(timeout=10)
        stale.clear()
        assert asked[(1, 1)].result(timeout=10).source == "hub"
        assert tier.started == [(1, 1), (1, 1)]  # the demand made a fetch of its own
    finally:
        q.close()


class _Bytes:
    """Stands in for an expert's buffer: what a failed fetch must not keep alive."""


def test_a_failed_fetch_keeps_no_buffer_alive_once_its_waiter_has_the_error() -> None:
    # a fetch that re-raises an error it kept in a local (as a piece's error is re-raised) puts its
    # frame, and the buffer in it, in a cycle with the error: alive until a full garbage collection
    freed: list = []

    def failing(key, keep_now: bool = False, ctx: FetchContext = DEMAND_CTX) -> Fetched:
        buffer = _Bytes()
        freed.append(weakref.ref(buffer))
        errors = [DownloadError(f"{key}: the Hub said no")]
        for error in errors:
            raise error
        return Fetched(weights=buffer, source="hub", seconds=0.0)

    gc.collect()
    gc.disable()
    try:
        q = FetchQueue(failing, lambda keys: [], 1)
        q.start()
        fut = q.submit((1, 1), DEMAND)
        with pytest.raises(DownloadError, match="the Hub said no"):
            fut.result(timeout=10)
        q.close()  # the worker's own reference to the future goes with it
        del fut
        assert freed and freed[0]() is None, "the failed fetch's buffer outlived every reference to it"
    finally:
        gc.enable()


def _started_while(tier: _SlowTier, key, fut, other) -> bool:
    """Whether `key` started before `other` (a future) was done."""
    while not other.done():
        with tier.lock:
            if key in tier.started:
                return True
        time.sleep(0.002)
    return False


def _guess_beside_a_demand(tier: _SlowTier, workers: int, may_share) -> tuple[FetchQueue, object, object]:
    """A started queue with demand (1, 0) being fetched and then guess (2, 0) submitted."""
    q = FetchQueue(tier.fetch, tier.fetch_run, workers, stale=lambda key: False, may_share=may_share)
    q.start()
    demand = q.submit((1, 0), DEMAND)  # one worker fetches it; the others are free
    time.sleep(0.01)
    return q, demand, q.submit((2, 0), PREFETCH)


@pytest.mark.parametrize("proven", [False, True, None])
def test_a_guess_starts_beside_demands_in_flight_only_once_guesses_have_proven_right(proven: bool | None) -> None:
    """Bytes in flight share the link: a wrong guess started in a layer's tail slows its last
    demanded pieces. So while guesses are unproven, a free worker holds its guess until the
    demands in flight are done, and then fetches it (the link a layer's compute leaves idle).
    A queue not told whether guesses have proven right (None) never holds one."""
    tier = _SlowTier(steps=20)
    q, demand, guess = _guess_beside_a_demand(tier, 2, None if proven is None else (lambda: proven))
    try:
        assert _started_while(tier, (2, 0), guess, demand) is (proven is not False)
        guess.result(timeout=10)  # held back, not dropped
    finally:
        q.close()


def test_a_held_guess_gives_its_worker_to_a_demand_that_comes_meanwhile() -> None:
    tier = _SlowTier(steps=20)
    q, first, guess = _guess_beside_a_demand(tier, 2, lambda: False)  # the free worker holds the guess
    try:
        time.sleep(0.02)
        second = q.submit((1, 1), DEMAND)
        assert _started_while(tier, (1, 1), second, first)  # not behind the held guess
        for f in (first, second, guess):
            f.result(timeout=10)
        assert tier.started.index((2, 0)) == 2  # the guess went last
    finally:
        q.close()


def test_a_held_guess_that_a_demand_comes_for_is_fetched_once_as_the_demand() -> None:
    tier = _SlowTier(steps=10)
    q, first, guess = _guess_beside_a_demand(tier, 3, lambda: False)  # held while (1, 0) is fetched
    try:
        time.sleep(0.01)
        demand = q.submit((2, 0), DEMAND)  # the third worker takes the demand's own entry
        assert demand is guess
        assert demand.result(timeout=10).source == "hub"
        first.result(timeout=10)
        time.sleep(0.1)  # a second fetch of (2, 0), if the held entry made one, starts by now
        assert tier.started.count((2, 0)) == 1
        assert q.in_flight_count() == 0
    finally:
        q.close()


def test_a_held_guess_whose_expert_a_demand_fetched_meanwhile_is_dropped() -> None:
    """The scheduler may wake a held guess's worker only after a demand for its very expert came,
    was fetched by another worker and left the books: the entry must then be dropped, not started
    (an expert no longer in flight), which would kill the worker and leave the expert marked as
    started, so that a later demand for it waits forever."""
    gate = threading.Event()
    demand_done, hold_over = threading.Event(), threading.Event()

    def fetch(key, keep_now: bool = False, ctx: FetchContext = DEMAND_CTX) -> Fetched:
        if key == (1, 0):
            gate.wait(10)  # keeps a demand running while the guess is held
        return Fetched(weights=None, source="hub", seconds=0.0)

    q = FetchQueue(fetch, lambda keys: [fetch(k) for k in keys], 3, stale=lambda key: False, may_share=lambda: False)
    real_wait, real_hold, late = q.changed.wait, q._hold_guess, []

    def late_wake(timeout=None) -> bool:  # Condition.wait, woken after the demand came and went
        if late:
            return real_wait(timeout)
        late.append(True)
        q._lock.release()
        try:
            demand_done.wait(10)
        finally:
            q._lock.acquire()
        return True

    def hold(key) -> bool:
        try:
            return real_hold(key)
        finally:
            hold_over.set()

    q.changed.wait, q._hold_guess = late_wake, hold
    q.start()
    try:
        first = q.submit((1, 0), DEMAND)
        q.submit((2, 0), PREFETCH)
        for _ in range(1000):  # until the guess's worker holds it
            if late:
                break
            time.sleep(0.01)
        assert late, "the guess was never held"
        q.submit((2, 0), DEMAND).result(timeout=10)  # fetched by the third worker
        demand_done.set()
        gate.set()
        first.result(timeout=10)
        assert hold_over.wait(10)
        assert q.submit((2, 0), DEMAND).result(timeout=10).source == "hub"  # a new fetch, not a lost one
        assert q.in_flight_count() == 0 and all(t.is_alive() for t in q._threads)
    finally:
        gate.set()
        demand_done.set()
        q.close()
