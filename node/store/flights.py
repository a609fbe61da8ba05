"""The experts in flight: one record per expert, kept by one owner under one lock.

An expert is in flight from the moment a demand, a guess or idle-link fill wants it fetched until
that fetch is over; a guess's record stays a little longer, until the pass it was made for has
judged it and taken it if it arrived in time. The record holds all there is to know about the
expert: where its fetch is (`State`), whom it serves (`priority`: the queue's order and the Hub's),
who wants it (a demand waits, a guess was made for its layer's next pass, a fill claimed it) and
the one future everyone who wants it waits on. The fetch queue's workers, the prefetcher and
idle-link fill read and change records only through the methods below, each one step under the
one lock: no thread can act between a check and the change it decides.

The rules kept here:
- single flight: one record, so one fetch and one future, per expert however many ask;
- demands are taken before guesses, each in the order they came; a demand for a queued guess moves
  it ahead, and one for an expert being fetched (a guess, a run, a fill) joins that fetch;
- while demands are being fetched, a guess is held back unless guesses may share the link (they
  have proven right) or its pass did not want it, or until GUESS_HOLD_MAX_S; a demand that comes
  meanwhile gets the worker;
- a guess its pass did not want gives its link up (`stale`) unless a demand came for it, which it
  is then fetched to the end for;
- guesses outstanding (in flight, or arrived and waiting for their pass) stay within the budget
  the prefetcher gives;
- fills start only while the link is idle (no demand queued or fetched, no guess in flight) and
  their reserved bytes within a cap; they give the link up to any demand but one for their own
  experts, and a demand for a fill's expert waits for that fill.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from expertmesh.node.errors import Abandoned, DownloadError, without_locals
from expertmesh.node.fetching import Priority
from expertmesh.node.store.stats import ExpertKey
from expertmesh.node.store.tier_chain import Fetched

logger = logging.getLogger(__name__)

# A guess held back while demands are fetched starts anyway after this long (a bound, not a policy).
GUESS_HOLD_MAX_S = 10.0


class State(Enum):
    QUEUED = "queued"  # waits for a fetch worker
    HELD = "held"  # a guess next in line, held back while demands are fetched
    FETCHING = "fetching"  # a worker, or a fill, is fetching it
    ARRIVED = "arrived"  # a guess's fetch ended: it waits for its pass to judge and take it


class Guess(Enum):
    PENDING = "pending"  # made for its layer's next pass, which has not come yet
    USED = "used"  # its pass wanted it
    WASTED = "wasted"  # its pass did not want it


IN_FLIGHT = (State.QUEUED, State.HELD, State.FETCHING)
WAITING = (State.QUEUED, State.HELD)


class Guessed(Enum):
    """What `Flights.guess` did."""

    ISSUED = "issued"
    HELD_ALREADY = "held already"  # in flight, or arrived and waiting for its pass
    NO_ROOM = "no room"  # the guesses' budget is spent


@dataclass(eq=False)
class Flight:
    """One expert in flight (fields are the owner's to change, under its lock)."""

    key: ExpertKey
    state: State
    priority: Priority
    seq: int  # its place in the queue, among entries of its priority
    future: Future = field(default_factory=Future)
    demanded: bool = False  # a demand waits for this fetch
    guess: Guess | None = None  # a guess asked for it
    fill_bytes: int = 0  # a fill claimed it: the bytes reserved for it on disk and in memory
    run: tuple[ExpertKey, ...] = ()  # queued with adjacent demanded experts as one entry
    staged: Fetched | None = None  # an arrived guess, not yet taken
    held_since: float | None = None

    @property
    def stale(self) -> bool:
        """A guess its pass did not want, that no demand waits for: its fetch may give up."""
        return self.guess is Guess.WASTED and not self.demanded


@dataclass
class _Tally:
    """Counts over the records that the waiters' conditions read, kept as records change (each
    condition is then one look, not a walk over every record)."""

    demands: int = 0  # in flight for a demand, queued or being fetched by the queue
    demands_fetching: int = 0
    guesses_in_flight: int = 0
    staged: int = 0  # arrived guesses not yet taken
    fill_bytes: int = 0

    def add(self, rec: Flight, sign: int) -> None:
        flying, demand = rec.state in IN_FLIGHT, rec.priority is Priority.DEMAND
        self.demands += sign * (flying and demand)
        self.demands_fetching += sign * (rec.state is State.FETCHING and demand)
        self.guesses_in_flight += sign * (flying and rec.guess is not None)
        self.staged += sign * (rec.staged is not None)
        self.fill_bytes += sign * rec.fill_bytes


@dataclass(frozen=True)
class Work:
    """What a fetch worker is given: one expert, or a run of adjacent demanded experts."""

    keys: tuple[ExpertKey, ...]
    priority: Priority

    @property
    def is_run(self) -> bool:
        return len(self.keys) > 1


class Flights:
    """The records of the experts in flight, and every change to them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)  # fetch workers wait here for work
        # idle-link fill waits here for the link; notified when it may have become idle
        self._changed = threading.Condition(self._lock)
        self._records: dict[ExpertKey, Flight] = {}
        self._tally = _Tally()
        self._queue: list[tuple[int, int, tuple[ExpertKey, ...]]] = []  # (priority, seq, keys)
        self._seq = itertools.count()
        self._closed = False

    # -- what is going on (each read under the lock) ------------------------------------------

    def state(self, key: ExpertKey) -> State | None:
        with self._lock:
            rec = self._records.get(key)
            return None if rec is None else rec.state

    def holds(self, key: ExpertKey) -> bool:
        """Whether `key` has a record: in flight, or a guess that arrived for a pass to come."""
        with self._lock:
            return key in self._records

    def in_flight_count(self) -> int:
        with self._lock:
            return sum(rec.state in IN_FLIGHT for rec in self._records.values())

    def guesses_in_flight(self) -> int:
        with self._lock:
            return self._tally.guesses_in_flight

    def fill_bytes(self) -> int:
        """Bytes reserved by the fills in flight."""
        with self._lock:
            return self._tally.fill_bytes

    @property
    def demand_busy(self) -> bool:
        """Whether any demand is queued or being fetched by the queue."""
        with self._lock:
            return bool(self._tally.demands)

    def stale(self, key: ExpertKey) -> bool:
        """Whether `key`'s guess may give its link up (the queue's `abandon` for a guess)."""
        with self._lock:
            rec = self._records.get(key)
            return rec is not None and rec.stale

    def notify(self) -> None:
        """Something the waiters' conditions read changed outside the book (a generation began, fill stops)."""
        with self._lock:
            self._changed.notify_all()

    # -- demands ------------------------------------------------------------------------------

    def demand(
        self, keys: Iterable[ExpertKey], plan: Callable[[list[ExpertKey]], list[list[ExpertKey]]] | None = None
    ) -> dict[ExpertKey, Future]:
        """The future of each of `keys`, queued as demands where no fetch of it is going on.

        `plan` groups the experts not yet in flight into runs (store/runs.py): each of two or more
        is one queue entry, fetched by one worker. It runs under the lock, so it must not call back.
        """
        keys = list(keys)
        closed: list[Future] = []
        out: dict[ExpertKey, Future] = {}
        with self._lock:
            if self._closed:
                out = {key: Future() for key in keys}
                closed = list(out.values())
            else:
                if plan is not None:
                    for run in plan([k for k in sorted(keys) if k not in self._records]):
                        if len(run) < 2:
                            continue
                        seq = next(self._seq)
                        for key in run:
                            out[key] = self._add(
                                key, State.QUEUED, Priority.DEMAND, seq, demanded=True, run=tuple(run)
                            ).future
                        self._push(Priority.DEMAND, seq, tuple(run))
                for key in keys:
                    if key not in out:
                        out[key] = self._demand_one(key)
        for fut in closed:
            fut.set_exception(DownloadError("the expert store is closed: nothing fetches any more"))
        return out

    def _demand_one(self, key: ExpertKey) -> Future:
        rec = self._records.get(key)
        if rec is None:
            rec = self._add(key, State.QUEUED, Priority.DEMAND, next(self._seq), demanded=True)
            self._push(Priority.DEMAND, rec.seq, (key,))
            return rec.future
        if rec.state is State.ARRIVED:
            if rec.staged is not None:  # arrived since the caller looked: its future holds it
                self._set(rec, staged=None)
                self._forget_if_over(rec)
                return rec.future
            rec.future = Future()  # a guess whose fetch failed: fetched anew
            self._set(rec, state=State.QUEUED)
        rec.demanded = True
        if rec.state in WAITING and rec.priority is not Priority.DEMAND:  # a queued guess moves ahead
            self._set(rec, state=State.QUEUED, priority=Priority.DEMAND, seq=next(self._seq), held_since=None)
            self._push(Priority.DEMAND, rec.seq, (key,))
        return rec.future

    # -- guesses ------------------------------------------------------------------------------

    def guess(self, key: ExpertKey, budget: int) -> Guessed:
        """Queue a guess of `key` for its layer's next pass, unless it is held already or the
        guesses outstanding (in flight, or arrived and not yet taken) reach `budget`."""
        with self._lock:
            if self._closed or key in self._records:
                return Guessed.HELD_ALREADY
            if self._tally.guesses_in_flight + self._tally.staged >= budget:
                return Guessed.NO_ROOM
            rec = self._add(key, State.QUEUED, Priority.PREFETCH, next(self._seq), guess=Guess.PENDING)
            self._push(Priority.PREFETCH, rec.seq, (key,))
            return Guessed.ISSUED

    def take(self, key: ExpertKey) -> Fetched | None:
        """The arrived guess of `key`, if there is one (then it is used without waiting)."""
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.staged is None:
                return None
            fetched = rec.staged
            self._set(rec, staged=None)
            self._forget_if_over(rec)
            return fetched

    def judge_guesses(self, layer: int, demanded: set[int]) -> tuple[int, int]:
        """`layer`'s pass has come and wants `demanded`: its pending guesses are used or wasted.
        A wasted guess that arrived is let go; one in flight gives its link up when it can (a
        queued one is no longer held back, so it starts and gives up at once, or is fetched
        where finishing costs less than fetching again). Returns (used, wasted)."""
        used = wasted = 0
        with self._lock:
            for rec in [r for r in self._records.values() if r.key[0] == layer and r.guess is not None]:
                if rec.guess is not Guess.PENDING:  # judged by an earlier pass: wanted, never taken
                    if rec.state is State.ARRIVED:
                        self._forget(rec)
                    continue
                if rec.key[1] in demanded:
                    self._set(rec, guess=Guess.USED)
                    used += 1
                    self._forget_if_over(rec)
                    continue
                self._set(rec, guess=Guess.WASTED, staged=None)
                wasted += 1
                if rec.state is State.ARRIVED:
                    self._forget(rec)
            if self._queue:  # a held guess may go now
                self._work_ready.notify()
        return used, wasted

    # -- the fetch workers --------------------------------------------------------------------

    def next_work(self, may_share: Callable[[], bool] | None = None) -> Work | None:
        """Wait for the next fetch to make and mark it started; None once the book is closed.

        `may_share()`: whether a guess may start while demands are being fetched (None: always).
        It is asked under the lock, so it must not call back.
        """
        with self._lock:
            while not self._closed:
                entry = self._head()
                if entry is None:
                    self._work_ready.wait()
                    continue
                priority, _, keys = entry
                if priority == Priority.PREFETCH:
                    hold_s = self._hold(self._records[keys[0]], may_share)
                    if hold_s > 0:
                        self._work_ready.wait(hold_s)
                        continue
                heapq.heappop(self._queue)
                if self._queue:  # the next entry may be for another worker: one more looks
                    self._work_ready.notify()
                for key in keys:
                    self._set(self._records[key], state=State.FETCHING, held_since=None)
                return Work(keys, Priority(priority))
            return None

    def _hold(self, rec: Flight, may_share: Callable[[], bool] | None) -> float:
        """Seconds the guess `rec` is to wait yet (0: it starts). One its pass did not want is not
        held: it gives up as soon as it starts (a wanted one waits for its demand to move it ahead,
        so that it is fetched at a demand's priority)."""
        if rec.guess is Guess.WASTED or not self._tally.demands_fetching or _shares(may_share):
            return 0.0
        now = held_since = time.monotonic()
        if rec.held_since is None:
            self._set(rec, state=State.HELD, held_since=now)
        else:
            held_since = rec.held_since
        return max(0.0, held_since + GUESS_HOLD_MAX_S - now)

    def fetched(self, key: ExpertKey, fetched: Fetched | None, error: BaseException | None) -> bool:
        """`key`'s fetch by a worker ended. False when it is to be fetched again, for a demand that
        came after its guess gave up (it now serves that demand); True when it is over: a guess
        whose pass has not taken it yet stays staged, and its waiters wake."""
        with self._lock:
            rec = self._records[key]
            if isinstance(error, Abandoned) and rec.demanded:
                self._set(rec, priority=Priority.DEMAND)
                return False
            fut = rec.future
            wanted_later = rec.guess is Guess.PENDING or (rec.guess is Guess.USED and not rec.demanded)
            if wanted_later and (error is None or rec.guess is Guess.PENDING):
                self._set(rec, state=State.ARRIVED, staged=fetched, demanded=False, priority=Priority.PREFETCH)
            else:
                self._forget(rec)
            self._fetch_ended()
        _resolve(fut, fetched, error)
        return True

    def fetched_run(self, keys: tuple[ExpertKey, ...], results: list[Fetched | BaseException]) -> None:
        """A run's fetch ended: one result or error per expert, handed to its waiters."""
        with self._lock:
            recs = [self._records[key] for key in keys]
            for rec in recs:
                self._forget(rec)
            self._fetch_ended()
        for rec, result in zip(recs, results):
            if isinstance(result, BaseException):
                _resolve(rec.future, None, result)
            else:
                _resolve(rec.future, result, None)

    def _fetch_ended(self) -> None:
        if self._queue:  # a held guess may start now (the worker that takes it wakes the next)
            self._work_ready.notify()
        self._changed.notify_all()

    # -- idle-link fill -----------------------------------------------------------------------

    def wait_for_idle_link(
        self,
        cap_bytes: int,
        active_until: Callable[[], float],
        stopping: Callable[[], bool],
        busy_bound_s: float | None = None,
    ) -> bool:
        """Wait until a generation is going on (`active_until()`, monotonic seconds), no demand is
        queued or fetched, no guess is in flight and fills reserve under `cap_bytes`; False once
        the book closes or `stopping()`. Both callables are read under the lock.

        `busy_bound_s`: True also once generations have kept the link busy that long without a
        break, for a waiter that must not starve under continuous use (a household's decode asks
        its peers at every layer, so its link is never idle)."""
        busy_since: float | None = None
        with self._lock:
            while not self._closed and not stopping():
                now = time.monotonic()
                left = active_until() - now
                if left <= 0:
                    busy_since = None
                    self._changed.wait(None)
                    continue
                if self._link_idle(cap_bytes):
                    return True
                if busy_bound_s is None:
                    self._changed.wait(left)
                    continue
                busy_since = now if busy_since is None else busy_since
                bound_left = busy_since + busy_bound_s - now
                if bound_left <= 0:
                    return True
                self._changed.wait(min(left, bound_left))
            return False

    def claim_fill(self, keys: list[ExpertKey], nbytes: list[int], cap_bytes: int) -> list[Future]:
        """Mark the longest head of `keys` that nobody holds as being fetched by a fill, if the link
        is still idle; their futures, for the fill to resolve (a demand for one of them waits)."""
        futs: list[Future] = []
        with self._lock:
            if self._closed or not self._link_idle(cap_bytes):
                return futs
            for key, n in zip(keys, nbytes):
                if key in self._records:
                    break
                futs.append(self._add(key, State.FETCHING, Priority.FILL, next(self._seq), fill_bytes=max(1, n)).future)
        return futs

    def fill_yields(self, keys: list[ExpertKey]) -> bool:
        """Whether a fill of `keys` should give its link up: a demand waits, and not for one of them."""
        with self._lock:
            return bool(self._tally.demands) and not any(self._records[k].demanded for k in keys if k in self._records)

    def release_fill(self, keys: list[ExpertKey]) -> set[ExpertKey]:
        """The fill of `keys` is over (its futures are the fill's to resolve); returns those a
        demand waits for. Final: from here on a demand makes a fetch of its own."""
        with self._lock:
            recs = [self._records[key] for key in keys]
            for rec in recs:
                self._forget(rec)
            demanded = {rec.key for rec in recs if rec.demanded}
            self._changed.notify_all()
            return demanded

    def release_fill_unless_demanded(self, key: ExpertKey) -> bool:
        """Let go of a fill that gave its link up, unless a demand came for it meanwhile (then the
        fill keeps it and fetches it for that demand)."""
        with self._lock:
            rec = self._records[key]
            if rec.demanded:
                return False
            self._forget(rec)
            self._changed.notify_all()
            return True

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Take no more work: queued fetches fail at once (their waiters wake with an error),
        fetches under way end as their tiers close, and every waiting thread wakes."""
        with self._lock:
            self._closed = True
            queued = [rec for rec in self._records.values() if rec.state in WAITING]
            for rec in queued:
                self._forget(rec)
            self._queue.clear()
            self._work_ready.notify_all()
            self._changed.notify_all()
        for rec in queued:
            _resolve(rec.future, None, DownloadError(f"the expert store closed before expert {rec.key} was fetched"))

    # -- under the lock -----------------------------------------------------------------------

    def _add(self, key: ExpertKey, state: State, priority: Priority, seq: int, **fields) -> Flight:
        rec = Flight(key, state, priority, seq, **fields)
        self._records[key] = rec
        self._tally.add(rec, 1)
        return rec

    def _set(self, rec: Flight, **fields) -> None:
        """Change `rec`'s fields: every change a count depends on goes through here."""
        self._tally.add(rec, -1)
        for name, value in fields.items():
            setattr(rec, name, value)
        self._tally.add(rec, 1)

    def _forget(self, rec: Flight) -> None:
        del self._records[rec.key]
        self._tally.add(rec, -1)

    def _forget_if_over(self, rec: Flight) -> None:
        """An arrived guess that is judged and taken (or let go) needs no record."""
        if rec.state is State.ARRIVED and rec.guess is not Guess.PENDING and rec.staged is None:
            self._forget(rec)

    def _push(self, priority: Priority, seq: int, keys: tuple[ExpertKey, ...]) -> None:
        heapq.heappush(self._queue, (int(priority), seq, keys))
        self._work_ready.notify()

    def _head(self) -> tuple[int, int, tuple[ExpertKey, ...]] | None:
        """The first queue entry whose experts still wait for it; entries of records that moved
        ahead, were dropped or were fetched are let go here."""
        while self._queue:
            _, seq, keys = self._queue[0]
            recs = [self._records.get(k) for k in keys]
            if all(r is not None and r.state in WAITING and r.seq == seq for r in recs):
                return self._queue[0]
            heapq.heappop(self._queue)
        return None

    def _link_idle(self, cap_bytes: int) -> bool:
        t = self._tally
        return not t.demands and not t.guesses_in_flight and t.fill_bytes < cap_bytes


def _shares(may_share: Callable[[], bool] | None) -> bool:
    """Asked on a fetch worker under the book's lock: if it fails the guess goes, rather than the
    worker dying and leaving every later demand waiting for a future nobody resolves."""
    try:
        return may_share is None or bool(may_share())
    except Exception:  # logged; the fetch itself decides the rest
        logger.exception("asking whether guesses may share the link failed; fetching the guess")
        return True


def _resolve(fut: Future, fetched: Fetched | None, error: BaseException | None) -> None:
    if error is not None:
        fut.set_exception(without_locals(error))
    else:
        fut.set_result(fetched)
