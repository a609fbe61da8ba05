"""The expert store: RAM -> disk -> (peers, later) -> Hub, behind one call per layer.

The engine asks for the distinct experts of one layer at once; the store answers from RAM what it
can and fetches the rest concurrently, each from the first byte source that has it. Sources are
an ordered list of `ByteSource`s, so a peers tier slots in between the disk and the Hub without
the engine noticing. Bytes that came from further away are written to the disk cache, and every
use is counted by the tier that answered it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from expertmesh.node.errors import DownloadError
from expertmesh.node.hub.expert_index import ExpertIndex, ExpertLocation, run_ranges
from expertmesh.node.store.codec import ExpertCodec, ExpertWeights
from expertmesh.node.store.integrity import DigestBook
from expertmesh.node.store.policies import DEFAULT_POLICY, make_policy
from expertmesh.node.store.priority import DEMAND, FILL, PREFETCH, fetching_as

logger = logging.getLogger(__name__)

ExpertKey = tuple[int, int]  # (layer, expert) within the store's pinned (repo, commit)
# remote: computed by the peer that holds it (activations moved, not the expert); its bytes are
# the activation bytes sent and received
SOURCES = ("ram", "disk", "peer", "hub", "remote")
# issued: guesses fetched; used: demanded by the pass they were for; wasted: not demanded, dropped
# ready: used guesses that had arrived before their demand (no wait: as good as a RAM hit);
# filled: fetched onto the disk on an idle link (not a guess: see ExpertStore's fill)
PREFETCH_OUTCOMES = ("issued", "used", "wasted", "ready", "filled")
# remote execution (node/household/remote_experts.py): calls made, activation bytes each way, and experts a
# peer was asked for that were fetched and computed here instead, by why
REMOTE_COUNTS = (
    "calls",
    "sent_bytes",
    "received_bytes",
    "fallback_error",
    "fallback_deadline",
    "fallback_bad_output",
    "fallback_missing",
)
# queue priorities (node/store/priority.py): a guess never goes before a demand, a fill after both
DEFAULT_FETCH_CONCURRENCY = 8
CLOSE_TIMEOUT_S = 10.0
INTEGRITY_RETRIES = 2  # refetches from a remote source whose bytes failed their sha256 check
# Prefetch pauses for PREFETCH_PAUSE_CALLS layer calls when fewer than PREFETCH_MIN_ACCURACY of
# the last PREFETCH_WINDOW guesses were used.
PREFETCH_WINDOW = 64
PREFETCH_MIN_ACCURACY = 0.25
PREFETCH_PAUSE_CALLS = 512
# Idle-link fill: while generation is going on (a layer call within FILL_ACTIVE_S) and no demand is
# queued or running, as many fill threads as fetch workers fetch experts not yet held onto free disk
# budget. Measured on the demo model's first cold prompt (benchmarks/bench_fill.py):
# 2 fill threads 86-91 ms/token, 4: 78, as many as the workers (8): 57; without fill 76.
FILL_ACTIVE_S = 2.0
# Fills of experts lying back to back in a shard go as one Hub request, up to FILL_RUN_MAX experts
# (and HubSource.run_bytes): on the demo model's first cold prompt 39.8 ms/token vs 56.5 one by one.
FILL_RUN_MAX = 8


@dataclass(frozen=True)
class _Run:
    """Demanded experts lying back to back in a shard: one queue entry, one set of Hub requests."""

    keys: tuple[ExpertKey, ...]


class ByteSource(Protocol):
    """Somewhere an expert's upstream bytes can come from."""

    name: str  # the `source` it is counted as: disk | peer | hub

    def fetch(self, loc: ExpertLocation) -> bytes | None:
        """The expert's blob (its byte ranges concatenated), or None if this source lacks it."""


class ByteSink(Protocol):
    def put(self, loc: ExpertLocation, blob: bytes) -> None:
        """Keep a copy; failing to keep one is not an error for the caller."""


@dataclass
class StoreStats:
    """Expert uses and upstream bytes by source; thread-safe, cumulative."""

    uses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    fetch_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0.0))
    integrity_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    prefetch: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREFETCH_OUTCOMES, 0))
    remote: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMOTE_COUNTS, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # called as observer(source, nbytes, seconds) after each use (node/observability/metrics.py: the fetch histogram)
    observer: Callable[[str, int, float], None] | None = field(default=None, repr=False, compare=False)

    def record_prefetch(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.prefetch[outcome] += n

    def record_remote(self, **counts: int) -> None:
        with self._lock:
            for k, n in counts.items():
                self.remote[k] += n

    def record_integrity_failure(self, source: str) -> None:
        with self._lock:
            self.integrity_failures[source] += 1

    def record(self, source: str, nbytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.uses[source] += 1
            self.bytes[source] += nbytes
            self.fetch_seconds[source] += seconds
        if self.observer is not None:
            self.observer(source, nbytes, seconds)

    def snapshot(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                dict(self.uses),
                dict(self.bytes),
                dict(self.fetch_seconds),
                dict(self.integrity_failures),
                dict(self.prefetch),
                dict(self.remote),
            )

    def since(self, before: StoreStats) -> StoreStats:
        now = self.snapshot()
        return StoreStats(
            {k: now.uses[k] - before.uses[k] for k in SOURCES},
            {k: now.bytes[k] - before.bytes[k] for k in SOURCES},
            {k: now.fetch_seconds[k] - before.fetch_seconds[k] for k in SOURCES},
            {k: now.integrity_failures[k] - before.integrity_failures[k] for k in SOURCES},
            {k: now.prefetch[k] - before.prefetch[k] for k in PREFETCH_OUTCOMES},
            {k: now.remote[k] - before.remote[k] for k in REMOTE_COUNTS},
        )

    @property
    def total_uses(self) -> int:
        return sum(self.uses.values())


class RamCache:
    """Decoded experts within a byte budget, kept by a replacement policy (node/store/policies.py).

    The budget becomes a number of slots of one decoded expert's size (a model's experts share
    one size). The experts a layer is using stay alive through the caller's references even
    when the budget is smaller than one layer, so a tiny budget costs refetches, never wrong answers.
    """

    def __init__(self, budget_bytes: int, policy: str = DEFAULT_POLICY):
        self.budget_bytes = budget_bytes
        self.policy_name = policy
        make_policy(policy, 0)  # an unknown name fails here, not at the first expert
        self._policy = None  # made at the first put, once an expert's size is known
        self._items: dict[ExpertKey, ExpertWeights] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.evictions = 0

    def get(self, key: ExpertKey) -> ExpertWeights | None:
        with self._lock:
            weights = self._items.get(key)
            if weights is not None:
                self._policy.access(key)
            return weights

    def put(self, key: ExpertKey, weights: ExpertWeights) -> None:
        with self._lock:
            if key in self._items:
                return
            if self._policy is None:
                self._policy = make_policy(self.policy_name, self.budget_bytes // max(1, weights.nbytes))
            _, evicted = self._policy.access(key)
            self._items[key] = weights
            self.nbytes += weights.nbytes
            for old in evicted:
                gone = self._items.pop(old, None)
                if gone is not None:
                    self.nbytes -= gone.nbytes
                    self.evictions += 1

    def keys(self) -> list[ExpertKey]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._items


@dataclass
class _Fetched:
    weights: ExpertWeights
    source: str
    seconds: float


class ExpertStore:
    """Experts of one pinned model, from the nearest tier that has them.

    Demanded experts are fetched by a pool of workers from a priority queue; guesses for the
    next layer (`prefetch`) wait behind every demand, take at most half the workers, and are
    staged aside (not in the RAM policy) until the pass they were for demands or drops them.

    Args:
        index: where every expert lives upstream.
        codec: turns blobs into kernel arrays.
        ram: the RAM tier.
        sources: byte sources nearest first (disk, peers, Hub); the last must always answer.
        sinks: where bytes from further away are kept (the disk cache).
        digests: the sha256 of each expert, checked on every copy not from RAM (None: no checks).
        fill_order: experts to fetch onto the disk while the link is idle during generation, in
            this order, into free budget only (never evicting); None: no fill. `fill_filter(key)`
            (set by the peers tier: only experts this node owns) may narrow it.
    """

    def __init__(
        self,
        index: ExpertIndex,
        codec: ExpertCodec,
        ram: RamCache,
        sources: list[ByteSource],
        sinks: Iterable[ByteSink] = (),
        concurrency: int = DEFAULT_FETCH_CONCURRENCY,
        digests: DigestBook | None = None,
        prefetch: bool = True,
        fill_order: list[ExpertKey] | None = None,
        coalesce: bool = True,
    ):
        self.index = index
        self.digests = digests
        self.trace = None  # a TraceWriter (node/observability/routing_trace.py) records every call when set
        self.codec = codec
        self.ram = ram
        self.sources = sources
        self.sinks = list(sinks)
        self.stats = StoreStats()
        self.prefetch_enabled = prefetch
        self.coalesce = coalesce  # demanded experts back to back in a shard fetched as one run
        self._concurrency = max(1, concurrency)
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._inflight: dict[ExpertKey, Future] = {}
        self._started: set[ExpertKey] = set()
        self._guessed: set[ExpertKey] = set()  # prefetched, not yet used or wasted
        self._staged: dict[ExpertKey, _Fetched] = {}  # prefetched and arrived
        self._queued_demands = 0
        self._prefetching: set[ExpertKey] = set()  # guesses whose fetch has not finished
        self._window = [0, 0]  # used, wasted since the last accuracy check
        self._paused_calls = 0  # prefetch pauses for this many layer calls after poor guesses
        self._running_demands = 0
        self._lock = threading.Lock()
        self._workers = [
            threading.Thread(target=self._work, name=f"expert-fetch-{i}", daemon=True) for i in range(self._concurrency)
        ]
        self._fill_order = list(fill_order or [])
        self._fill_next = 0
        self._fill_reserved = 0  # bytes of fills in flight, counted against the disk's free room
        self._fill_run = 1  # experts per fill request: doubles with each run the disk kept
        self.fill_filter: Callable[[ExpertKey], bool] | None = None
        self._last_call = -1e9
        self._fill_wake = threading.Event()
        self._closing = False
        if self._fill_order and self.sinks:
            self._workers += [
                threading.Thread(target=self._fill_loop, name=f"expert-fill-{i}", daemon=True)
                for i in range(self._concurrency)
            ]
        for w in self._workers:
            w.start()

    # -- demand -------------------------------------------------------------------------------

    def get_layer(
        self, layer: int, experts: Iterable[int], guess: tuple[int, Iterable[int]] | None = None, record: bool = True
    ) -> dict[int, ExpertWeights]:
        """The given experts of `layer`, fetching the ones not in RAM concurrently.

        `guess` = (next layer, its likely experts) is prefetched behind this layer's demands.
        `record`: trace this call as the layer's routing (False when the caller traced the whole
        routing itself and asks for a part of it, as remote execution does).
        """
        experts = [int(e) for e in experts]
        self._last_call = time.monotonic()
        if self._fill_order:
            self._fill_wake.set()
        if self.trace is not None and record:
            self.trace.record(layer, experts)
        self._settle_guesses(layer, set(experts))
        out: dict[int, ExpertWeights] = {}
        missing: list[int] = []
        for e in experts:
            key = (layer, e)
            t0 = time.perf_counter()
            weights = self.ram.get(key)
            if weights is not None:
                out[e] = weights
                self.stats.record("ram", self.index.expert(layer, e).nbytes, time.perf_counter() - t0)
                continue
            with self._lock:
                staged = self._staged.pop(key, None)
            if staged is not None:
                self.stats.record_prefetch("ready")
                out[e] = self._use(key, staged)
            else:
                missing.append(e)
        waiting = self._submit_demands(layer, missing)
        if guess is not None:
            self.prefetch(*guess)
        for e, fut in waiting.items():
            out[e] = self._use((layer, e), fut.result())
        return out

    def _use(self, key: ExpertKey, fetched: _Fetched) -> ExpertWeights:
        self.stats.record(fetched.source, self.index.expert(*key).nbytes, fetched.seconds)
        self.ram.put(key, fetched.weights)
        return fetched.weights

    # -- guesses ------------------------------------------------------------------------------

    def wants_guesses(self) -> bool:
        """Whether guessing the next layer is worth its (small) compute right now."""
        return self.prefetch_enabled and self._paused_calls == 0

    def prefetch(self, layer: int, experts: Iterable[int]) -> None:
        """Fetch likely experts of `layer` at low priority, if the link has room and guesses pay."""
        if not self.prefetch_enabled or self._paused_calls > 0:
            return
        budget = max(1, self._concurrency // 2)
        for e in experts:
            key = (layer, int(e))
            if key in self.ram:
                continue
            with self._lock:
                if (
                    len(self._prefetching) >= budget
                    or self._queued_demands + len(self._prefetching) >= self._concurrency
                ):
                    return  # the guesses' share of the workers is taken, or demands need every worker
                if key in self._inflight or key in self._staged:
                    continue
                self._guessed.add(key)
                self._prefetching.add(key)
            self.stats.record_prefetch("issued")
            self._submit(key, PREFETCH)

    def _settle_guesses(self, layer: int, demanded: set[int]) -> None:
        """This layer's pass is here: guesses for it were used or wasted."""
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

    # -- the fetch queue ----------------------------------------------------------------------

    def _submit_demands(self, layer: int, experts: list[int]) -> dict[int, Future]:
        """Demands of one layer: where there are more of them than Hub connections, experts that lie
        back to back in a shard, are held nowhere nearer than the Hub and are not in flight go as
        runs, one queue entry and one request each; the rest one by one.

        Runs trade parallelism for fewer requests: a connection carries a run at its own share of
        the link, so while connections are free, one request per expert is faster. A run therefore
        holds at most as many experts as it takes to bring the layer's requests down to the number
        of connections, and stays within one piece (`min_piece_bytes`): an expert of a piece or more
        is split across connections already (K3's 17.5 MB experts never go as runs).
        """
        source = self._run_source() if self.coalesce else None
        waiting: dict[int, Future] = {}
        if source is not None and len(experts) > source.connections:
            runs: list[list[ExpertKey]] = []
            with self._lock:
                wanted = [
                    (layer, e)
                    for e in sorted(experts)
                    if (layer, e) not in self._inflight and not any((layer, e) in sink for sink in self.sinks)
                ]
                longest = -(-len(wanted) // source.connections)
                for key in wanted:
                    if runs and runs[-1][-1] == (layer, key[1] - 1) and len(runs[-1]) < longest:
                        locs = [self.index.expert(*k) for k in (*runs[-1], key)]
                        if sum(loc.nbytes for loc in locs) <= source.min_piece_bytes and run_ranges(locs) is not None:
                            runs[-1].append(key)
                            continue
                    runs.append([key])
                for run in runs:
                    if len(run) < 2:
                        continue
                    for key in run:  # started at once: a later demand or guess for one of them joins its future
                        waiting[key[1]] = self._inflight[key] = Future()
                        self._started.add(key)
                    self._queued_demands += 1
                    self._queue.put((DEMAND, next(self._seq), _Run(tuple(run))))
        for e in experts:
            if e not in waiting:
                waiting[e] = self._submit((layer, e), DEMAND)
        return waiting

    def _submit(self, key: ExpertKey, priority: int) -> Future:
        """Single flight: one future per expert; a demand for a queued guess moves it up."""
        with self._lock:
            fut = self._inflight.get(key)
            if fut is None:
                fut = Future()
                self._inflight[key] = fut
            elif priority == PREFETCH or key in self._started:
                return fut
            if priority == DEMAND:
                self._queued_demands += 1
            self._queue.put((priority, next(self._seq), key))
            return fut

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
                    continue  # a duplicate entry of a guess that a demand moved up
                self._started.add(key)
                fut = self._inflight[key]
                self._running_demands += priority == DEMAND
            try:
                with fetching_as(priority):
                    fetched = self._fetch(key)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                fetched, error = None, e
            else:
                error = None
            with self._lock:
                self._running_demands -= priority == DEMAND
                self._inflight.pop(key, None)
                self._started.discard(key)
                self._prefetching.discard(key)
                if key in self._guessed and fetched is not None:
                    self._staged[key] = fetched  # no demand has come for it yet
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(fetched)

    def _work_run(self, keys: tuple[ExpertKey, ...]) -> None:
        with self._lock:
            self._queued_demands -= 1
            self._running_demands += 1
            futs = [self._inflight[key] for key in keys]
        try:
            with fetching_as(DEMAND):
                results = self._fetch_run(list(keys))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            results = [e] * len(keys)
        with self._lock:
            self._running_demands -= 1
            for key in keys:
                self._inflight.pop(key, None)
                self._started.discard(key)
        for fut, result in zip(futs, results):
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    # -- idle-link fill -----------------------------------------------------------------------

    def _fill_candidate(self, key: ExpertKey) -> bool:
        """Whether `key` is neither held, nor being fetched, nor someone else's to hold (under the lock)."""
        if key in self._inflight or key in self.ram or any(key in sink for sink in self.sinks):
            return False
        return self.fill_filter is None or self.fill_filter(key)

    def _has_room(self, nbytes: int) -> bool:
        return all(getattr(sink, "has_room", lambda n: True)(nbytes + self._fill_reserved) for sink in self.sinks)

    def _run_source(self):
        """The source that fetches runs (the Hub), when nothing is asked before it but the disk."""
        remote = [s for s in self.sources if s.name != "disk"]
        return remote[0] if len(remote) == 1 and hasattr(remote[0], "fetch_run") else None

    def _next_fill(self) -> list[ExpertKey]:
        """The next run of experts to fill (one expert, or up to `_fill_run` lying back to back in a
        shard when the Hub is the only remote source); [] when nothing is left or no room (under the lock)."""
        while self._fill_next < len(self._fill_order):
            key = self._fill_order[self._fill_next]
            self._fill_next += 1
            if not self._fill_candidate(key):
                continue
            nbytes = self.index.expert(*key).nbytes
            if not self._has_room(nbytes):
                self._fill_next = len(self._fill_order)  # the disk budget is full: fill never evicts
                return []
            run, source = [key], self._run_source()
            while source is not None and len(run) < self._fill_run:
                nxt = (key[0], run[-1][1] + 1)
                if nxt not in self.index.experts or not self._fill_candidate(nxt):
                    break
                locs = [self.index.expert(*k) for k in (*run, nxt)]
                size = sum(loc.nbytes for loc in locs)
                if size > source.run_bytes or not self._has_room(size) or run_ranges(locs) is None:
                    break
                run.append(nxt)
            return run
        return []

    def _fill_loop(self) -> None:
        """Fetch experts onto the disk while a generation runs and no demand wants the link.

        A fill is not a guess and never enters RAM: it turns a future Hub miss into a disk hit.
        It is registered as in flight, so a demand for the same expert waits for it instead of
        fetching it twice; a demand that arrives while fills run gets every fetch worker.
        Runs start at one expert and double with every run the disk kept, so a disk that keeps
        nothing (a full file system) costs at most one expert per fill thread.
        """
        while not self._closing:
            self._fill_wake.wait(0.5)
            if self._closing:
                return
            if time.monotonic() - self._last_call > FILL_ACTIVE_S:
                self._fill_wake.clear()  # generation stopped: sleep until the next layer call
                continue
            with self._lock:
                if self._queued_demands or self._running_demands or self._prefetching:
                    run = []
                else:
                    run = self._next_fill()
                    if not run and self._fill_next >= len(self._fill_order):
                        return  # everything is held, or the budget is full
                    futs = []
                    for key in run:  # their room is held until they are on disk: two fills never take one slot
                        futs.append(self._inflight.setdefault(key, Future()))
                        self._started.add(key)
                        self._fill_reserved += self.index.expert(*key).nbytes
            if not run:
                time.sleep(0.002)  # the link is busy with demands: look again shortly
                continue
            with fetching_as(FILL):
                results = self._fetch_run(run)
            with self._lock:
                for key in run:
                    self._inflight.pop(key, None)
                    self._started.discard(key)
                    self._fill_reserved -= self.index.expert(*key).nbytes
            kept = True
            for key, fut, result in zip(run, futs, results):
                if isinstance(result, BaseException):
                    logger.debug("filling expert %s failed: %s", key, result)
                    fut.set_exception(result)
                    continue
                fut.set_result(result)
                if result.source != "disk" and not all(key in sink for sink in self.sinks):
                    kept = False
                else:
                    self.stats.record_prefetch("filled")
            if not kept:
                with self._lock:  # the disk did not keep it (a full file system): more fills would be wasted
                    self._fill_next = len(self._fill_order)
                logger.warning("the disk cache did not keep a filled expert; idle-link fill stops")
                return
            if len(run) == self._fill_run and not any(isinstance(r, BaseException) for r in results):
                self._fill_run = min(FILL_RUN_MAX, 2 * self._fill_run)

    def _fetch_run(self, keys: list[ExpertKey]) -> list[_Fetched | BaseException]:
        """Each expert of a run, fetched as one request when there are several; an expert whose
        bytes fail their checks is fetched again on its own (with `_fetch`'s retries)."""
        out: list[_Fetched | BaseException] = []
        blobs: list[bytes | None] = [None] * len(keys)
        source = self._run_source() if len(keys) > 1 else None
        t0 = time.perf_counter()
        if source is not None:
            try:
                blobs = source.fetch_run([self.index.expert(*k) for k in keys])
            except Exception as e:  # noqa: BLE001 - each expert is tried again on its own below
                logger.debug("experts %s as one run failed: %s", keys, e)
        seconds = (time.perf_counter() - t0) / len(keys)
        for key, blob in zip(keys, blobs):
            loc = self.index.expert(*key)
            try:
                if blob is not None and len(blob) == loc.nbytes and self._verify(key, source, blob):
                    weights = self.codec.decode(loc, blob)
                    for sink in self.sinks:
                        sink.put(loc, blob)
                    out.append(_Fetched(weights, source.name, seconds))
                else:
                    out.append(self._fetch(key))
            except BaseException as e:  # noqa: BLE001 - handed to a demand that joined, if any
                out.append(e)
        return out

    def _fetch(self, key: ExpertKey) -> _Fetched:
        loc = self.index.expert(*key)
        for source in self.sources:
            # a source that keeps no copy (the Hub, a peer) may send good bytes on a second try
            for _ in range(1 if source.name == "disk" else 1 + INTEGRITY_RETRIES):
                t0 = time.perf_counter()
                blob = source.fetch(loc)
                if blob is None:
                    break
                if len(blob) != loc.nbytes:  # a source must never hand over a partial expert
                    raise DownloadError(f"{source.name} gave {len(blob)} bytes for expert {key}, expected {loc.nbytes}")
                if self._verify(key, source, blob):
                    break
                blob = None
            if blob is None:
                continue
            weights = self.codec.decode(loc, blob)
            if source.name != "disk":
                for sink in self.sinks:
                    sink.put(loc, blob)
            return _Fetched(weights, source.name, time.perf_counter() - t0)
        raise DownloadError(f"expert {key} of {self.index.repo_id}: no source has a good copy")

    def _verify(self, key: ExpertKey, source: ByteSource, blob) -> bool:
        """Check a copy against the digest recorded at first fetch, or record it if this is the first.

        Only bytes that passed the Hub's (or a peer's) checks may become the reference; a disk copy
        without a recorded digest is unverifiable and treated like a bad one.
        """
        if self.digests is None or self.digests.check(key, blob, may_record=source.name != "disk"):
            return True
        self.stats.record_integrity_failure(source.name)
        logger.warning("expert %s from %s failed its sha256 check; discarding that copy", key, source.name)
        discard = getattr(source, "discard", None)
        if discard is not None:
            discard(self.index.expert(*key))
        return False

    def close(self) -> None:
        self._closing = True
        self._fill_wake.set()
        for _ in self._workers:
            self._queue.put((-1, -1, None))  # before any queued fetch: workers stop at once
        # Join them (bounded: one may be mid-fetch): MLX aborts the process at exit if a thread
        # that decoded experts with it is still running then.
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for w in self._workers:
            w.join(max(0.0, deadline - time.monotonic()))
        for source in self.sources:
            if hasattr(source, "close"):
                source.close()
        if self.trace is not None:
            self.trace.close()
