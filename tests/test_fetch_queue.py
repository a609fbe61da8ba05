"""The fetch workers over the book of experts in flight, with a scripted tier: one fetch per expert
however many ask, demands before guesses, a guess its pass proved wrong gives its link up unless a
demand came for it, and a guess held back while demands are fetched gives its worker to a demand."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import pytest
from waiting import wait_until

from expertmesh.node.errors import Abandoned, DownloadError
from expertmesh.node.fetching import DEMAND as DEMAND_CTX
from expertmesh.node.fetching import FetchContext
from expertmesh.node.store.fetch_queue import FetchQueue
from expertmesh.node.store.flights import Flights, Guessed, State
from expertmesh.node.store.tier_chain import Fetched

BUDGET = 64  # guesses outstanding at most: more than any test makes


class _Tier:
    """Fetches an expert in `steps` steps, asking `ctx.abandon` between them as the Hub tier does
    between chunks. An expert given a gate (`gate(key)`) waits for it first, asking all the while."""

    def __init__(self, steps: int = 4):
        self.steps = steps
        self.started: list = []
        self.gave_up: list = []
        self.gates: dict = {}
        self.on_give_up: Callable | None = None  # called as a fetch gives up, before it raises
        self.lock = threading.Lock()

    def gate(self, key) -> threading.Event:
        self.gates[key] = threading.Event()
        return self.gates[key]

    def fetch(self, key, keep_now: bool = False, ctx: FetchContext = DEMAND_CTX) -> Fetched:
        with self.lock:
            self.started.append(key)
        gate, steps = self.gates.get(key), 0
        while steps < self.steps or (gate is not None and not gate.is_set()):
            if ctx.should_abandon():
                self.gave_up.append(key)
                if self.on_give_up is not None:
                    self.on_give_up(key)
                raise Abandoned(f"{key} gave up")
            if gate is not None and not gate.is_set():
                gate.wait(0.005)
            else:
                steps += 1
        return Fetched(weights=None, source="hub", seconds=0.0)

    def fetch_run(self, keys, keep_now: bool = False, ctx: FetchContext = DEMAND_CTX) -> list:
        return [self.fetch(k, keep_now, ctx) for k in keys]

    def has_started(self, key, times: int = 1) -> bool:
        with self.lock:
            return self.started.count(key) >= times


def _queue(tier: _Tier, workers: int = 1, may_share=None) -> tuple[Flights, FetchQueue]:
    flights = Flights()
    q = FetchQueue(flights, tier.fetch, tier.fetch_run, workers, may_share=may_share)
    q.start()
    return flights, q


def _demand(flights: Flights, key):
    return flights.demand([key])[key]


def _guess(flights: Flights, key) -> None:
    assert flights.guess(key, BUDGET) is Guessed.ISSUED


def test_a_wrong_guess_gives_its_link_up_and_a_wanted_one_does_not() -> None:
    tier = _Tier()
    flights, q = _queue(tier)
    try:
        tier.gate((1, 1))
        _guess(flights, (1, 1))
        assert wait_until(lambda: tier.has_started((1, 1)))
        flights.judge_guesses(1, set())  # its pass came and did not want it
        assert wait_until(lambda: not flights.holds((1, 1)))
        assert tier.gave_up == [(1, 1)]

        gate = tier.gate((1, 2))
        _guess(flights, (1, 2))
        assert wait_until(lambda: tier.has_started((1, 2)))
        demand = _demand(flights, (1, 2))  # the demand joins the guess's fetch
        flights.judge_guesses(1, set())  # judged wrong, but a demand waits for it
        gate.set()
        assert demand.result(timeout=10).source == "hub"
        assert (1, 2) not in tier.gave_up and flights.in_flight_count() == 0
    finally:
        q.close()


def test_a_held_guess_its_pass_did_not_want_starts_at_once_and_gives_up() -> None:
    tier = _Tier()
    flights, q, first = _guess_beside_a_demand(tier, 2, lambda: False)
    try:
        assert wait_until(lambda: flights.state((2, 0)) is State.HELD)
        flights.judge_guesses(2, {5})
        assert wait_until(lambda: (2, 0) in tier.gave_up)  # not held until the demand is over
        assert not first.done()
        assert wait_until(lambda: not flights.holds((2, 0)))
    finally:
        tier.gates[(1, 0)].set()
        q.close()


def test_demands_go_before_queued_guesses_and_each_expert_is_fetched_once() -> None:
    tier = _Tier()
    flights, q = _queue(tier)
    try:
        gate = tier.gate((1, 0))
        first = _demand(flights, (1, 0))  # occupies the one worker
        for e in range(3):
            _guess(flights, (2, e))
        demands = flights.demand([(3, e) for e in range(3)])
        assert _demand(flights, (3, 0)) is demands[(3, 0)]
        assert flights.guess((3, 1), BUDGET) is Guessed.HELD_ALREADY  # a guess never fetches twice either
        gate.set()
        for f in [first, *demands.values()]:
            f.result(timeout=10)
        assert wait_until(lambda: flights.in_flight_count() == 0)
        order = tier.started
        assert order[0] == (1, 0) and order[1:4] == [(3, 0), (3, 1), (3, 2)]  # demands, then guesses
        assert len(order) == len(set(order)) == 7
        assert all(flights.state((2, e)) is State.ARRIVED for e in range(3))  # staged for their pass
    finally:
        q.close()


def test_a_demand_that_comes_as_a_guess_gives_up_gets_the_expert_not_the_give_up() -> None:
    # the demand arrives after the guess's fetch decided to give up but before it left the book:
    # it must never wait for the give-up
    tier, asked = _Tier(), {}
    flights, q = _queue(tier)
    gate = tier.gate((1, 1))

    def demand_it(key) -> None:
        asked[key] = _demand(flights, key)
        gate.set()

    tier.on_give_up = demand_it
    try:
        _guess(flights, (1, 1))
        assert wait_until(lambda: tier.has_started((1, 1)))
        flights.judge_guesses(1, set())
        assert wait_until(lambda: (1, 1) in asked), "the guess never gave up"
        assert asked[(1, 1)].result(timeout=10).source == "hub"
        assert tier.started == [(1, 1), (1, 1)]  # fetched again, for the demand
    finally:
        gate.set()
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
        flights = Flights()
        q = FetchQueue(flights, failing, lambda keys: [], 1)
        q.start()
        fut = _demand(flights, (1, 1))
        with pytest.raises(DownloadError, match="the Hub said no"):
            fut.result(timeout=10)
        q.close()  # the worker's own reference to the future goes with it
        del fut
        assert freed and freed[0]() is None, "the failed fetch's buffer outlived every reference to it"
    finally:
        gc.enable()


def test_a_demand_queued_when_the_queue_closes_fails_at_once() -> None:
    """Closing stops the workers before any queued fetch; a demand still queued must wake with an
    error, or whoever waits for it (a generation, a peer's call) waits forever."""
    tier = _Tier()
    flights, q = _queue(tier)
    gate = tier.gate((1, 0))
    try:
        first = _demand(flights, (1, 0))
        assert wait_until(lambda: tier.has_started((1, 0)))  # the one worker waits at the gate
        queued = _demand(flights, (1, 1))
        closing = threading.Thread(target=q.close)
        closing.start()
        with pytest.raises(DownloadError, match="closed"):
            queued.result(timeout=10)
        gate.set()  # the fetch under way ends, as its tier closing would end it
        first.result(timeout=10)
        closing.join(10)
        assert not closing.is_alive() and q.alive() == 0
        with pytest.raises(DownloadError, match="closed"):
            _demand(flights, (1, 2)).result(timeout=10)  # nothing would fetch it
    finally:
        gate.set()
        q.close()


def _guess_beside_a_demand(tier: _Tier, workers: int, may_share) -> tuple[Flights, FetchQueue, object]:
    """A started queue fetching demand (1, 0) (held at its gate) with guess (2, 0) queued after it."""
    tier.gate((1, 0))
    flights, q = _queue(tier, workers, may_share)
    demand = _demand(flights, (1, 0))
    assert wait_until(lambda: tier.has_started((1, 0)))
    _guess(flights, (2, 0))
    return flights, q, demand


@pytest.mark.parametrize("proven", [False, True, None])
def test_a_guess_starts_beside_demands_in_flight_only_once_guesses_have_proven_right(proven: bool | None) -> None:
    """Bytes in flight share the link: a wrong guess started in a layer's tail slows its last
    demanded pieces. So while guesses are unproven, a free worker holds its guess until the
    demands in flight are done, and then fetches it (the link a layer's compute leaves idle).
    A queue not told whether guesses have proven right (None) never holds one."""
    tier = _Tier()
    flights, q, demand = _guess_beside_a_demand(tier, 2, None if proven is None else (lambda: proven))
    try:
        if proven is False:
            assert wait_until(lambda: flights.state((2, 0)) is State.HELD)
            assert not tier.has_started((2, 0))  # held while the demand is fetched
        else:
            assert wait_until(lambda: tier.has_started((2, 0)))  # beside the demand
            assert not demand.done()
        tier.gates[(1, 0)].set()
        demand.result(timeout=10)
        assert wait_until(lambda: flights.state((2, 0)) is State.ARRIVED)  # held back, not dropped
    finally:
        q.close()


def test_a_held_guess_gives_its_worker_to_a_demand_that_comes_meanwhile() -> None:
    tier = _Tier()
    flights, q, first = _guess_beside_a_demand(tier, 2, lambda: False)
    try:
        assert wait_until(lambda: flights.state((2, 0)) is State.HELD)
        second = _demand(flights, (1, 1))
        assert second.result(timeout=10).source == "hub"  # fetched by the free worker, not behind the guess
        assert not first.done() and not tier.has_started((2, 0))
        tier.gates[(1, 0)].set()
        first.result(timeout=10)
        assert wait_until(lambda: flights.in_flight_count() == 0)
        assert tier.started.index((2, 0)) == 2  # the guess went last
    finally:
        q.close()


def test_a_held_guess_that_a_demand_comes_for_is_fetched_once_as_the_demand() -> None:
    """The demand moves the held guess ahead: one fetch, for the demand, and no worker is left
    holding a guess whose expert is no longer in flight (each worker lives on)."""
    tier = _Tier()
    flights, q, first = _guess_beside_a_demand(tier, 3, lambda: False)
    try:
        assert wait_until(lambda: flights.state((2, 0)) is State.HELD)
        demand = _demand(flights, (2, 0))
        assert demand.result(timeout=10).source == "hub"
        assert not first.done()  # fetched while the first demand still runs
        tier.gates[(1, 0)].set()
        first.result(timeout=10)
        assert wait_until(lambda: flights.in_flight_count() == 0)
        assert tier.started.count((2, 0)) == 1  # and no record is left in flight to fetch it again
        assert flights.state((2, 0)) is State.ARRIVED  # still staged for its pass, as a guess
        assert _demand(flights, (2, 0)).result(timeout=10).source == "hub"  # taken, not fetched again
        assert tier.started.count((2, 0)) == 1 and q.alive() == 3
    finally:
        q.close()
