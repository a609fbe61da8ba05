"""The book of experts in flight, step by step on one thread: what each record says and what each
change may do (the workers that make the fetches are tests/test_fetch_queue.py's)."""

from __future__ import annotations

import random
import threading
import time

from waiting import wait_until

from expertmesh.node.errors import Abandoned, DownloadError
from expertmesh.node.fetching import Priority
from expertmesh.node.store import flights as flights_module
from expertmesh.node.store.flights import Flights, Guessed, State, Work
from expertmesh.node.store.tier_chain import Fetched

ARRIVED = Fetched(weights=None, source="hub", seconds=0.0)


def _start(flights: Flights) -> tuple:
    """The next fetch a worker would make (something must be queued: the call waits otherwise)."""
    work = flights.next_work()
    assert work is not None
    return work.keys


def _fetch_next(flights: Flights) -> tuple:
    keys = _start(flights)
    if len(keys) > 1:
        flights.fetched_run(keys, [ARRIVED] * len(keys))
    else:
        assert flights.fetched(keys[0], ARRIVED, None)
    return keys


def test_one_record_and_one_future_per_expert_however_many_ask() -> None:
    flights = Flights()
    first = flights.demand([(1, 0)])[(1, 0)]
    assert flights.demand([(1, 0), (1, 1)])[(1, 0)] is first
    assert flights.guess((1, 0), budget=8) is Guessed.HELD_ALREADY
    assert flights.in_flight_count() == 2
    assert _fetch_next(flights) == ((1, 0),)
    assert first.result(timeout=0).source == "hub" and not flights.holds((1, 0))


def test_demands_go_first_in_the_order_they_came_and_a_demand_moves_its_guess_ahead() -> None:
    flights = Flights()
    for e in range(3):
        assert flights.guess((2, e), budget=8) is Guessed.ISSUED
    flights.demand([(1, 5)])
    flights.demand([(2, 2)])  # a demand for the last guess queued
    assert [_fetch_next(flights) for _ in range(4)] == [((1, 5),), ((2, 2),), ((2, 0),), ((2, 1),)]


def test_adjacent_demands_planned_as_a_run_are_one_fetch() -> None:
    flights = Flights()
    futs = flights.demand([(1, e) for e in range(4)], plan=lambda keys: [keys[:3], keys[3:]])
    assert flights.demand([(1, 1)])[(1, 1)] is futs[(1, 1)]  # joins the run
    assert _fetch_next(flights) == ((1, 0), (1, 1), (1, 2))
    assert _fetch_next(flights) == ((1, 3),)
    assert all(f.result(timeout=0).source == "hub" for f in futs.values())


def test_guesses_outstanding_stay_within_the_budget_until_taken() -> None:
    flights = Flights()
    assert [flights.guess((3, e), budget=2) for e in range(3)] == [Guessed.ISSUED, Guessed.ISSUED, Guessed.NO_ROOM]
    _fetch_next(flights)
    assert flights.guesses_in_flight() == 1 and flights.state((3, 0)) is State.ARRIVED
    assert flights.guess((3, 2), budget=2) is Guessed.NO_ROOM  # an arrived guess holds memory too
    assert flights.judge_guesses(3, {0, 1}) == (2, 0)
    assert flights.take((3, 0)) is ARRIVED and not flights.holds((3, 0))  # judged and taken: let go
    assert flights.guess((3, 2), budget=2) is Guessed.ISSUED


def test_a_guess_its_pass_did_not_want_gives_up_unless_a_demand_waits() -> None:
    flights = Flights()
    for e in range(3):
        flights.guess((4, e), budget=8)
    assert _start(flights) == ((4, 0),)
    assert not flights.stale((4, 0))  # its pass has not come
    _fetch_next(flights)  # (4, 1) arrives
    assert flights.judge_guesses(4, {2}) == (1, 2)
    assert flights.stale((4, 0))  # being fetched: it may give its link up
    assert not flights.holds((4, 1))  # arrived: let go
    assert flights.state((4, 2)) is State.QUEUED  # wanted: fetched on for its demand
    flights.demand([(4, 0)])
    assert not flights.stale((4, 0))  # a demand came: fetched to the end for it
    assert not flights.fetched((4, 0), None, Abandoned("gave up just before"))  # fetched again, for the demand


def test_a_held_guess_its_pass_did_not_want_goes_at_once(monkeypatch) -> None:
    """It gives its link up as soon as it starts (or, small, costs less fetched than fetched again
    later): it does not wait for the demands to end."""
    monkeypatch.setattr(flights_module, "GUESS_HOLD_MAX_S", 1e9)  # held means held until the demands end
    flights = Flights()
    flights.demand([(1, 0)])
    assert _start(flights) == ((1, 0),)  # a demand being fetched
    flights.guess((5, 0), budget=8)
    taken: list = []
    worker = threading.Thread(target=lambda: taken.append(flights.next_work(may_share=lambda: False)), daemon=True)
    worker.start()
    assert wait_until(lambda: flights.state((5, 0)) is State.HELD)
    assert flights.judge_guesses(5, {1}) == (0, 1)
    worker.join(10)
    assert not worker.is_alive(), "the guess its pass did not want was still held"
    assert taken[0].keys == ((5, 0),) and flights.stale((5, 0))
    flights.close()


def test_a_held_guess_its_pass_wanted_waits_for_its_demand_and_goes_as_a_demand(monkeypatch) -> None:
    """Its demand comes right after the pass judged it: started before, it would be fetched at a
    guess's priority, behind every demanded piece, while a token waits for it."""
    monkeypatch.setattr(flights_module, "GUESS_HOLD_MAX_S", 1e9)
    flights = Flights()
    flights.demand([(1, 0)])
    assert _start(flights) == ((1, 0),)
    flights.guess((5, 1), budget=8)
    taken: list = []
    asked = threading.Semaphore(0)  # released each time the worker weighs holding the guess

    def may_share() -> bool:
        asked.release()
        return False

    worker = threading.Thread(target=lambda: taken.append(flights.next_work(may_share)), daemon=True)
    worker.start()
    assert asked.acquire(timeout=10) and flights.state((5, 1)) is State.HELD
    assert flights.judge_guesses(5, {1}) == (1, 0)
    assert asked.acquire(timeout=10), "the worker did not weigh the guess again once its pass came"
    assert flights.state((5, 1)) is State.HELD
    flights.demand([(5, 1)])
    worker.join(10)
    assert not worker.is_alive() and taken[0].keys == ((5, 1),) and taken[0].priority is Priority.DEMAND
    flights.close()


def test_a_guess_whose_pass_wanted_it_stays_staged_until_taken() -> None:
    """The pass judges its guesses before it asks for its experts: a guess that arrives in
    between is kept for the asking, not let go."""
    flights = Flights()
    flights.guess((6, 0), budget=8)
    assert _start(flights) == ((6, 0),)
    assert flights.judge_guesses(6, {0}) == (1, 0)
    assert not flights.stale((6, 0))
    assert flights.fetched((6, 0), ARRIVED, None)
    assert flights.take((6, 0)) is ARRIVED and not flights.holds((6, 0))


def test_fills_go_only_while_the_link_is_idle_and_give_it_to_other_experts_demands() -> None:
    flights = Flights()
    flights.demand([(7, 0)])
    assert flights.claim_fill([(8, 0)], [10], cap_bytes=100) == []  # a demand is queued
    _fetch_next(flights)
    flights.guess((7, 1), budget=8)
    assert flights.claim_fill([(8, 0)], [10], cap_bytes=100) == []  # a guess is in flight
    _fetch_next(flights)
    futs = flights.claim_fill([(8, 0), (8, 1), (7, 1), (8, 3)], [10] * 4, cap_bytes=100)
    assert len(futs) == 2  # up to the first expert someone else holds
    assert flights.fill_bytes() == 20
    assert flights.claim_fill([(8, 2)], [10], cap_bytes=20) == []  # the fills' reservation is full
    assert flights.guess((8, 0), budget=8) is Guessed.HELD_ALREADY  # a guess never joins a fill
    assert flights.guesses_in_flight() == 0  # (so no fill ever waits for a guess that is a fill)
    assert not flights.fill_yields([(8, 0), (8, 1)])
    other = flights.demand([(9, 0)])
    assert flights.fill_yields([(8, 0), (8, 1)])  # a demand waits, for another expert
    assert flights.demand([(8, 1)])[(8, 1)] is futs[1]  # a demand for a filled expert joins the fill
    assert not flights.fill_yields([(8, 0), (8, 1)])
    assert flights.release_fill_unless_demanded((8, 0))
    assert not flights.release_fill_unless_demanded((8, 1))
    assert flights.release_fill([(8, 1)]) == {(8, 1)} and flights.fill_bytes() == 0
    assert not other[(9, 0)].done()


def test_a_guess_beside_a_demand_being_fetched_is_held_unless_guesses_may_share() -> None:
    flights = Flights()
    flights.demand([(1, 0)])
    assert _start(flights) == ((1, 0),)  # a demand being fetched
    flights.guess((2, 0), budget=8)
    assert flights.next_work(may_share=lambda: True).keys == ((2, 0),)  # proven: it shares the link
    flights.guess((2, 1), budget=8)
    taken: list = []
    worker = threading.Thread(target=lambda: taken.append(flights.next_work(may_share=lambda: False)))
    worker.start()
    assert wait_until(lambda: flights.state((2, 1)) is State.HELD)
    assert not taken
    assert flights.fetched((1, 0), ARRIVED, None)  # the demand is over: the held guess goes
    worker.join(10)
    assert taken[0].keys == ((2, 1),) and flights.state((2, 1)) is State.FETCHING


def test_settling_is_per_layer_and_demands_are_never_guesses() -> None:
    flights = Flights()
    flights.guess((1, 0), budget=8)
    flights.demand([(2, 0)])
    assert flights.judge_guesses(2, set()) == (0, 0)
    assert flights.state((1, 0)) is State.QUEUED and flights.state((2, 0)) is State.QUEUED
    work = flights.next_work()
    assert work is not None and work.priority is Priority.DEMAND


def _next(flights: Flights) -> Work:
    work = flights.next_work(may_share=lambda: True)
    assert work is not None
    return work


def test_the_counts_the_waiters_read_come_back_to_nothing_after_any_mix_of_changes() -> None:
    """A random walk through every change the book allows (demands, guesses, runs, fills, give-ups,
    failures, passes), then everything drained: every count the fill and the workers wait on must
    be back to nothing, or a fill would never start again, or a guess never be issued."""
    rng = random.Random(35)
    flights = Flights()
    keys = [(layer, e) for layer in range(3) for e in range(6)]
    fetching: list[Work] = []  # what "workers" have started
    filling: list = []

    def queued() -> bool:
        return any(flights.state(k) in (State.QUEUED, State.HELD) for k in keys)

    def finish(work: Work) -> None:
        if work.is_run:
            flights.fetched_run(work.keys, [ARRIVED] * len(work.keys))
            return
        key = work.keys[0]
        if work.priority is Priority.PREFETCH and flights.stale(key):  # gives up
            if rng.random() < 0.5:
                flights.demand([key])  # as a demand comes for it
            if not flights.fetched(key, None, Abandoned("gave up")):
                assert flights.fetched(key, ARRIVED, None)  # fetched again, for that demand
            return
        outcome = rng.choice([ARRIVED, ARRIVED, DownloadError("no")])
        fetched, error = (outcome, None) if isinstance(outcome, Fetched) else (None, outcome)
        assert flights.fetched(key, fetched, error)

    for _ in range(3000):
        op = rng.choices(range(9), weights=[10, 2, 20, 30, 30, 15, 15, 5, 15])[0]
        key = rng.choice(keys)
        if op == 0:
            flights.demand([key])
        elif op == 1:
            flights.demand(keys[6:10], plan=lambda free: [free])
        elif op == 2:
            flights.guess(key, budget=4)
        elif op == 3 and queued():
            fetching.append(_next(flights))
        elif op == 4 and fetching:
            finish(fetching.pop(rng.randrange(len(fetching))))
        elif op == 5:
            futs = flights.claim_fill([key], [7], cap_bytes=50)
            filling += [key] if futs else []
        elif op == 6 and filling:
            k = filling.pop(rng.randrange(len(filling)))
            if rng.random() < 0.5 or not flights.release_fill_unless_demanded(k):
                flights.release_fill([k])
        elif op == 7:
            flights.judge_guesses(key[0], {e for e in range(6) if rng.random() < 0.5})
        elif op == 8:
            flights.take(key)
        assert flights.guesses_in_flight() <= flights.in_flight_count()
    while fetching or queued():
        finish(fetching.pop() if fetching else _next(flights))
    flights.release_fill(filling)
    for layer in range(3):
        flights.judge_guesses(layer, set())
    assert flights.in_flight_count() == 0 and not any(flights.holds(k) for k in keys)
    assert flights.guesses_in_flight() == 0 and flights.fill_bytes() == 0 and not flights.demand_busy
    assert flights.claim_fill([(9, 9)], [7], cap_bytes=50)  # the link is idle again
    flights.release_fill([(9, 9)])
    assert all(flights.guess((8, e), budget=4) is Guessed.ISSUED for e in range(4))  # the budget is whole again


def test_a_waiter_with_a_busy_bound_goes_after_it_while_generations_keep_the_link_busy() -> None:
    """A household's decode keeps a demand in flight at every layer, so the link is never idle:
    the peer audit's wait must end after its bound, and the fill's (no bound) must not."""
    flights = Flights()
    flights.demand([(7, 0)])  # queued and never fetched: the link stays busy
    active = lambda: time.monotonic() + 10.0  # noqa: E731 - a generation that goes on
    stop = threading.Event()
    ended: dict[str, bool] = {}

    def wait(name: str, bound: float | None) -> None:
        ended[name] = flights.wait_for_idle_link(1, active, stop.is_set, bound)

    waiters = [threading.Thread(target=wait, args=("audit", 0.2)), threading.Thread(target=wait, args=("fill", None))]
    for t in waiters:
        t.start()
    waiters[0].join(timeout=10.0)
    assert ended.get("audit") is True  # after its bound of busy link
    assert "fill" not in ended  # still waiting for an idle link
    stop.set()
    flights.notify()
    waiters[1].join(timeout=10.0)
    assert ended.get("fill") is False

    no_generation = {}
    gone = lambda: time.monotonic() - 1.0  # noqa: E731 - no generation: nothing runs, bound or not
    stop2 = threading.Event()
    t = threading.Thread(target=lambda: no_generation.update(r=flights.wait_for_idle_link(1, gone, stop2.is_set, 0.05)))
    t.start()
    t.join(timeout=0.5)
    assert t.is_alive()  # waiting: the bound counts busy generations only
    stop2.set()
    flights.notify()
    t.join(timeout=10.0)
    assert no_generation["r"] is False
