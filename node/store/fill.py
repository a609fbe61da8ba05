"""Idle-link fill: while a generation runs and no demand wants the link, fetch experts not yet held
onto free disk budget.

A fill is not a guess and never enters RAM: it turns a future Hub miss into a disk hit. It never
evicts (only free budget is filled), keeps to the experts this node owns in a household, and is
claimed in the book of experts in flight (store/flights.py), so a demand for the same expert waits
for it instead of fetching it twice; a demand that arrives while fills run gets every fetch
worker. Fill threads sleep in the book until the link is free, and while no generation has asked
for a layer within FILL_ACTIVE_S, until one does. What the fill itself keeps (its place in the
order, the fills to try again, how long its runs are) is under a lock of its own, taken before
the book's and never while waiting.

Experts lying back to back in a shard are filled as one Hub request (store/runs.py). Runs start
at one expert and double with every run the disk kept, up to FILL_RUN_MAX, so a disk that keeps
nothing (a full file system) costs at most one expert per fill thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from expertmesh.node.errors import Abandoned, without_locals
from expertmesh.node.fetching import FetchContext, Priority
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.store.flights import Flights
from expertmesh.node.store.runs import fill_run
from expertmesh.node.store.stats import ExpertKey, StoreStats
from expertmesh.node.store.tier_chain import Fetched, TierChain
from expertmesh.node.store.tiers.ram import RamCache

logger = logging.getLogger(__name__)

# A generation is going on while a layer was asked for within this many seconds.
FILL_ACTIVE_S = 2.0
# Runs of adjacent experts per fill request, at most (and the Hub's `run_bytes`).
FILL_RUN_MAX = 8


class IdleFill:
    """`threads` fill threads over `order` (most useful first), for one store.

    Args:
        owns: whether this node should hold an expert (in a household, the ones it owns);
            None: every expert.
    """

    def __init__(
        self,
        index: ExpertIndex,
        order: list[ExpertKey],
        flights: Flights,
        chain: TierChain,
        ram: RamCache,
        stats: StoreStats,
        threads: int,
        owns: Callable[[ExpertKey], bool] | None = None,
    ):
        self.index = index
        self.flights = flights
        self.chain = chain
        self.disk = chain.disk
        self.ram = ram
        self.stats = stats
        self.owns = owns
        self._lock = threading.Lock()
        self._order = list(order)
        self._next = 0
        self._retry: list[ExpertKey] = []  # fills that gave their link up to a demand, to try again
        self._run = 1  # experts per fill request: doubles with each run the disk kept
        # fills in flight hold at most one expert's bytes per fill thread
        self._memory_cap = max(1, threads) * max((loc.nbytes for loc in index.experts.values()), default=0)
        self._active_until = -1.0  # monotonic; one float, rebound whole by `touch`
        self._closing = threading.Event()
        self._exhausted = threading.Event()  # `done`, for whoever may not take the fill's lock
        self._threads = [
            threading.Thread(target=self._loop, name=f"expert-fill-{i}", daemon=True) for i in range(threads)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def touch(self) -> None:
        """A generation asked for a layer: the link may be filled while it is otherwise idle."""
        self._active_until = time.monotonic() + FILL_ACTIVE_S
        if not self._exhausted.is_set():
            self.flights.notify()

    @property
    def done(self) -> bool:
        """Whether nothing is left to fill (every expert held or tried, or the disk's budget full)."""
        with self._lock:
            return self._is_done()

    def _is_done(self) -> bool:
        return self._next >= len(self._order) and not self._retry

    def _active_until_s(self) -> float:
        return self._active_until

    def _stopping(self) -> bool:
        """Asked under the book's lock, so it reads events only: the fill's own lock is taken before
        the book's, never inside it."""
        return self._closing.is_set() or self._exhausted.is_set()

    def _note_done(self) -> None:
        """Under the fill's lock, after its order or retries changed."""
        if self._is_done():
            self._exhausted.set()
        else:
            self._exhausted.clear()

    def _wanted(self, key: ExpertKey) -> bool:
        """Neither held, nor being fetched, nor someone else's to hold."""
        if self.flights.holds(key) or key in self.ram or key in self.disk:
            return False
        return self.owns is None or self.owns(key)

    def _has_room(self, nbytes: int) -> bool:
        return self.disk.has_room(nbytes + self.flights.fill_bytes())

    def _next_run(self) -> list[ExpertKey]:
        """The next run to fill; [] when nothing is left or the budget is full (under the fill's lock)."""
        runs = self.chain.runs
        while self._retry or self._next < len(self._order):
            if self._retry:
                key = self._retry.pop(0)
            else:
                key = self._order[self._next]
                self._next += 1
            if not self._wanted(key):
                continue
            nbytes = self.index.expert(*key).nbytes
            if not self._has_room(nbytes):
                self._next, self._retry = len(self._order), []  # the disk budget is full: fill never evicts
                return []
            if runs is None:
                return [key]
            run_bytes = min(runs.run_bytes, max(nbytes, self._memory_cap - self.flights.fill_bytes()))
            return fill_run(self.index, key, self._run, run_bytes, self._wanted, self._has_room)
        return []

    def _claim(self) -> tuple[list[ExpertKey], list] | None:
        """The next run, claimed in the book: ([], []) when the link got busy or another fetch took
        it meanwhile (it is tried again later), None when nothing is left to fill."""
        with self._lock:
            run = self._next_run()
            futs = (
                self.flights.claim_fill(run, [self.index.expert(*k).nbytes for k in run], self._memory_cap)
                if run
                else []
            )
            self._retry[:0] = run[len(futs) :]
            self._note_done()
            return (run[: len(futs)], futs) if run else None

    def _loop(self) -> None:
        while self.flights.wait_for_idle_link(self._memory_cap, self._active_until_s, self._stopping):
            claimed = self._claim()
            if claimed is None:
                return  # everything is held, or the budget is full
            run, futs = claimed
            if not run:
                continue
            # "kept" below must be known, so the disk write comes first; and a fill gives its link
            # up to any demand but one for these very experts
            ctx = FetchContext(Priority.FILL, abandon=functools.partial(self.flights.fill_yields, run))
            results = self.chain.fetch_run(run, keep_now=True, ctx=ctx, decode=False)
            run, futs, results = self._finish_abandoned(run, futs, results)
            demanded = self.flights.release_fill(run)
            results = [  # decoded only for a demand that joined (a fill needs the bytes on disk, not in
                # MLX); for nobody, not even the bytes are kept
                (self.chain.decoded(k, r) if k in demanded else Fetched(None, r.source, r.seconds))
                if isinstance(r, Fetched)
                else r
                for k, r in zip(run, results)
            ]
            going_on = self._hand_out(run, futs, results)
            del futs, results  # nothing of this run stays referenced while the thread waits
            if not going_on:
                return

    def _finish_abandoned(self, run: list[ExpertKey], futs: list, results: list) -> tuple[list, list, list]:
        """Fills that gave their link up: one a demand came for meanwhile is fetched now, for it;
        the others are released (their futures fail, nobody waits) and tried again later."""
        done = []  # (key, future, result) still to hand out
        for key, fut, result in zip(run, futs, results):
            if not isinstance(result, Abandoned):
                done.append((key, fut, result))
            elif self.flights.release_fill_unless_demanded(key):
                fut.set_exception(without_locals(result))
                with self._lock:
                    self._retry.append(key)
                    self._note_done()
            else:
                fetched: Fetched | BaseException
                try:
                    fetched = self.chain.fetch(key, keep_now=True)
                except BaseException as e:  # noqa: BLE001 - handed to the demand that waits
                    fetched = e
                done.append((key, fut, fetched))
        return [d[0] for d in done], [d[1] for d in done], [d[2] for d in done]

    def _hand_out(self, run: list[ExpertKey], futs: list, results: list) -> bool:
        """Hand each result to whoever joined; False when the disk kept nothing (fill stops)."""
        kept = True
        for key, fut, result in zip(run, futs, results):
            if isinstance(result, BaseException):
                logger.debug("filling expert %s failed: %s", key, result)
                fut.set_exception(without_locals(result))
                continue
            fut.set_result(result)
            if result.source != "disk" and key not in self.disk:
                kept = False
            else:
                self.stats.record_prefetch("filled")
        if not kept:
            with self._lock:  # the disk did not keep it (a full file system): more fills would be wasted
                self._next, self._retry = len(self._order), []
                self._note_done()
            logger.warning("the disk cache did not keep a filled expert; idle-link fill stops")
            return False
        with self._lock:
            if len(run) == self._run and not any(isinstance(r, BaseException) for r in results):
                self._run = min(FILL_RUN_MAX, 2 * self._run)
        return True

    def stop(self) -> None:
        """Take no more fills; a fill in flight finishes (see `join`)."""
        self._closing.set()
        self.flights.notify()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
