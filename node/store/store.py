"""The expert store: one call per MoE layer, answered from RAM or fetched through the tiers.

The engine asks for the distinct experts of one layer at once (`layer_groups`, the one entry
point: this node's passes, remote execution and peers' ComputeExperts alike); the store answers
from RAM what it can, hands over guesses that arrived in time, and fetches the rest concurrently
through the tiers (store/tier_chain.py: disk, peers, the Hub), each expert at most once at a
time: every expert in flight has one record in one book (store/flights.py), which the fetch
workers (store/fetch_queue.py) take their work from. Its answer, an `ExpertGroup`, says which
tier served each expert and, on the MLX thread, puts the arrivals into RAM-tier slots
(store/tiers/ram.py) for the kernels. Around that demand path sit two helpers that use the link
when demands leave it free: the prefetcher (store/prefetch.py), which fetches the next layer's
guessed experts, and idle-link fill (store/fill.py), which fetches experts not yet held onto the
disk. Both go through the same book. Every use is counted by the tier that answered it
(store/stats.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

from expertmesh.node import constants
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.model.codec import ExpertWeights
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.store.fetch_queue import CLOSE_TIMEOUT_S, FetchQueue
from expertmesh.node.store.fill import IdleFill
from expertmesh.node.store.flights import Flights
from expertmesh.node.store.peer_audit import PeerAudit
from expertmesh.node.store.prefetch import LayerGuess, Prefetcher
from expertmesh.node.store.routing import RoutingRecorder
from expertmesh.node.store.runs import demand_runs
from expertmesh.node.store.stats import ExpertKey
from expertmesh.node.store.tier_chain import Fetched, TierChain
from expertmesh.node.store.tiers.ram import RamCache


@dataclass(frozen=True)
class Served:
    """Which tier answered for one expert of a layer, with its upstream bytes and fetch seconds."""

    source: str
    nbytes: int
    seconds: float


@dataclass
class _Started:
    """A group the store has looked at and queued, not yet handed over: its RAM hits are pinned."""

    layer: int
    served: dict[int, Served]
    arrived: dict[int, ExpertWeights]
    held: dict[int, int]  # expert -> slot, pinned
    waiting: dict[int, Future]

    def let_go(self, ram: RamCache) -> None:
        held, self.held = self.held, {}
        if held:
            ram.release([(self.layer, e) for e in held])


def _tapered(groups: list[list[int]]) -> list[list[int]]:
    """`groups` with the last of several split in halves down to two (8 -> 4, 2, 2): the experts computed
    after a layer's last byte has come are the last group's (store.layer_groups)."""
    if len(groups) < 2:
        return groups
    last, out = groups[-1], groups[:-1]
    while len(last) > 2:
        half = (len(last) + 1) // 2
        out.append(last[:half])
        last = last[half:]
    return out + [last]


@dataclass
class Placed:
    """A group's experts as the kernels read them (`ExpertGroup.placed`): in RAM-tier slots,
    pinned (`slots`: expert -> slot), or as they were decoded (`loose`): an arrival the tier does
    not keep, which a slot write would copy only to let it go."""

    slots: dict[int, int]
    loose: dict[int, ExpertWeights]


class ExpertGroup:
    """Some of a layer's experts, as the store hands them over: which tier served each (`served`),
    and the ones that arrived, to be written into RAM-tier slots on the MLX thread (`placed`).

    The experts RAM answered for are pinned when the store looks (`held`), not when the group is
    placed: the store queues the next group before handing this one over, and placing one group's
    arrivals may make the policy let go of experts RAM held for the next; unpinned, those would be
    gone by the time their group is placed, and a peer's ComputeExperts would answer an expert it
    holds as missing. Pins the caller never places are let go of by `let_go`."""

    def __init__(
        self,
        ram: RamCache,
        layer: int,
        served: dict[int, Served],
        arrived: dict[int, ExpertWeights],
        held: dict[int, int] | None = None,
    ):
        self.ram = ram
        self.layer = layer
        self.served = served
        self._arrived = arrived
        self._held = dict(held or {})  # expert -> slot, pinned when the store found it in RAM

    @property
    def experts(self) -> list[int]:
        return list(self.served)

    @contextmanager
    def placed(self) -> Iterator[Placed]:
        """On the MLX thread: every expert of the group, for the kernels (`Placed`): the arrivals
        the RAM tier keeps written into slots; slots pinned while inside, so nothing else takes
        them before their kernels are built."""
        placed, self._held = Placed(self._held, {}), {}  # the pins taken when the store looked are now these
        for e, weights in self._arrived.items():
            slot = self.ram.place((self.layer, e), weights)
            if slot is None:
                placed.loose[e] = weights
            else:
                placed.slots[e] = slot
        self._arrived = {}  # placed: the group keeps no reference of its own
        try:
            yield placed
        finally:
            self.ram.release([(self.layer, e) for e in placed.slots])

    def let_go(self) -> None:
        """Unpin the RAM hits of a group that was handed over but never placed."""
        held, self._held = self._held, {}
        if held:
            self.ram.release([(self.layer, e) for e in held])


class ExpertStore:
    """Experts of one pinned model, from the nearest tier that has them.

    Args:
        ram: the RAM tier.
        chain: the tiers after RAM (disk, peers, Hub), with integrity checks.
        workers: fetch threads, i.e. experts fetched at once.
        prefetch: fetch guesses of the next layer behind the demands.
        fill_order: experts to fetch onto the disk while the link is idle during a generation,
            in this order, into free budget only; None: no fill. `owns` narrows it (a household
            node fills only the experts it owns).
        coalesce: demanded experts back to back in a shard go as one run of requests when a
            layer wants more experts than the Hub has connections (store/runs.py).
        audit: with a household tier, check each peer's first copy against the origin before it
            is used, and a sample of the rest on the idle link (store/peer_audit.py).
        trace: a TraceWriter (observability/routing_trace.py) that records every layer call.
        wait: waits for a layer's demanded fetches (default: each in turn). The node passes the
            MLX thread's `wait`, which serves peers' calls while a token waits for its experts.
    """

    def __init__(
        self,
        index: ExpertIndex,
        ram: RamCache,
        chain: TierChain,
        workers: int = constants.EXPERT_FETCH_CONCURRENCY,
        prefetch: bool = True,
        fill_order: list[ExpertKey] | None = None,
        owns: Callable[[ExpertKey], bool] | None = None,
        coalesce: bool = True,
        trace: RoutingRecorder | None = None,
        wait: Callable[[list[Future]], None] | None = None,
        audit: bool = True,
    ):
        self.index = index
        self.wait = wait
        self.ram = ram
        self.chain = chain
        self.disk = chain.disk
        self.digests = chain.digests
        self.stats = chain.stats
        self.trace = trace
        self.coalesce = coalesce
        self._expert_bytes = max((loc.nbytes for loc in index.experts.values()), default=1)
        workers = max(1, workers)
        # the experts in flight have one book; the demands, the guesses and the fill only go through it
        self.flights = Flights()
        self.prefetcher = Prefetcher(
            self.flights, ram, self.stats, workers, enabled=prefetch, expert_bytes=self._expert_bytes
        )
        self.fetches = FetchQueue(self.flights, chain.fetch, chain.fetch_run, workers, may_share=self.prefetcher.proven)
        self.fill = None
        if fill_order:
            self.fill = IdleFill(index, fill_order, self.flights, chain, ram, self.stats, threads=workers, owns=owns)
        # in a household, what peers vouched for is sampled against the origin (store/peer_audit.py)
        origin = next((t for t in chain.remote if not t.household), None)
        self.audit: PeerAudit | None = None
        if audit and origin is not None and chain.digests is not None and any(t.household for t in chain.remote):
            self.audit = PeerAudit(index, chain, origin, self.flights, self.stats)
            chain.on_suspect = self.audit.suspect
        chain.on_forgotten = self._forgotten
        chain.check_senders = audit

    def start(self) -> ExpertStore:
        """Start the fetch workers (and fill threads); nothing runs before this."""
        self.fetches.start()
        if self.fill is not None:
            self.fill.start()
        if self.audit is not None:
            self.audit.start()
        return self

    def _forgotten(self, peer: str, keys: list[ExpertKey]) -> None:
        """`peer` was shown to send a wrong copy: the copies recorded from it leave RAM too."""
        self.ram.discard(keys)
        if self.audit is not None:
            self.audit.forgotten(peer)

    @property
    def fetch_workers(self) -> int:
        return self.fetches.workers

    # -- demand -------------------------------------------------------------------------------

    def hold_limit(self) -> int:
        """How many of one layer's experts may be held at once: what the RAM tier keeps anyway, or
        one per fetch worker beyond it (so memory stays within the budget during a long prefill),
        and never more than the tier has slots for."""
        return max(1, min(max(self.fetches.workers, self.ram.slots(self._expert_bytes)), self.ram.capacity))

    def layer_groups(
        self,
        layer: int,
        experts: Iterable[int],
        guess: LayerGuess | None = None,
        routed: Iterable[int] | None = None,
    ) -> Iterator[ExpertGroup]:
        """The given experts of `layer`, fetching the ones not in RAM concurrently, a group at a
        time where the layer wants more than `hold_limit`: the caller computes each group (and
        lets its weights go) before taking the next. Every use of the store's experts, this
        node's own passes and peers' ComputeExperts alike, comes through here.

        The groups are pipelined: the next groups' fetches are queued before a group is handed
        over, as many as fit beside it within the limit, so the link or the disk keeps working
        while the caller computes. A layer within the hold limit is one group (the kernels
        mlx-lm runs for the layer); a wider one is taken two experts per fetch worker at most,
        where that is less than the hold limit: an expert is decoded as it arrives and written
        into a slot only when its group is handed over, so what is queued ahead waits in memory
        beside the RAM tier's slots, and beyond one group per worker in flight it would only pile
        up there (the memory plan counts two experts per fetch worker). Each group is half that
        limit, the group being computed and the one in flight together within it, but the last: it comes in halves
        (`_tapered`), all queued while the group before it is computed. What the caller computes
        after the layer's last byte has come is then a few experts, not half the hold limit: the
        link idles through that compute, since the next layer's experts are known only after it.

        Args:
            guess: (next layer, its likely experts[, the rows that guessed]), prefetched behind
                this layer's demands.
            routed: every expert this node's pass of the layer routed to, traced and judging the
                guesses made for it; None: `experts`. Empty for a call that is not a pass of this
                node (a peer's ComputeExperts) or that asks for more of a pass already announced
                (remote execution computes some experts on peers, and fetches here what a peer
                did not answer).
        """
        experts = [int(e) for e in experts]
        routed = experts if routed is None else [int(e) for e in routed]
        self._begin_layer(layer, routed, record=bool(routed), own_pass=bool(routed))
        limit = self.hold_limit()
        if len(experts) > limit:  # in groups: what waits beside the slots is bounded by the workers
            limit = min(limit, 2 * self.fetches.workers)
        size = limit if len(experts) <= limit else max(1, limit // 2)
        # no experts: one empty group all the same (a call that only announces the pass)
        groups = _tapered([experts[i : i + size] for i in range(0, len(experts), size)]) or [[]]
        started: list[_Started] = []  # pinned RAM hits not yet handed over
        last = len(groups) - 1
        sizes: list[int] = []  # the started groups' sizes
        try:
            # the guess goes with the last group, behind every demand of this layer: queued with the
            # first, it would start in the gap while the caller computes a group and the next
            # group's demands are not queued yet, and hold the link they then need
            started.append(self._start(layer, groups[0], guess if last == 0 else None))
            sizes.append(len(groups[0]))
            later = list(enumerate(groups[1:], 1))
            while started:
                # queued before the group before them is handed over, as many as the limit holds beside it
                while later and (len(started) == 1 or sum(sizes) + len(later[0][1]) <= limit):
                    n, group = later.pop(0)
                    started.append(self._start(layer, group, guess if n == last else None))
                    sizes.append(len(group))
                sizes.pop(0)
                yield from self._hand_over(layer, started.pop(0))
        finally:  # the caller stopped early, or a fetch failed: no pin outlives the call
            for rest in started:
                rest.let_go(self.ram)

    def _hand_over(self, layer: int, started: _Started) -> Iterator[ExpertGroup]:
        """Wait for a started group and hand it over; once the caller is done with it, its pins
        that the caller did not place are let go of."""
        try:
            group = self._finish(layer, started)
        except BaseException:
            started.let_go(self.ram)
            raise
        try:
            yield group
        finally:
            group.let_go()

    def _begin_layer(self, layer: int, experts: list[int], record: bool, own_pass: bool = True) -> None:
        """A layer is asked for: generation is on (fill), its routing is traced, its guesses are judged."""
        if self.fill is not None:
            self.fill.touch()
        if self.audit is not None:
            self.audit.touch()
        if self.trace is not None and record:
            self.trace.record(layer, experts)
        if own_pass:
            self.prefetcher.judge_guesses(layer, set(experts))

    def resident_uses(self, layer: int, experts: list[int]) -> None:
        """Count uses of `layer`'s experts that ran from their slots without asking the store: a
        layer whose experts are all resident runs without a sync (engine/blocks.py), and its
        routing is read, and counted here, once its pass has been evaluated."""
        self._begin_layer(layer, experts, record=True)
        self.stats.record_ram([self.index.expert(layer, e).nbytes for e in experts])
        self.ram.touch([(layer, e) for e in experts])

    def _start(self, layer: int, experts: list[int], guess: LayerGuess | None) -> _Started:
        """Pin what RAM holds, take the guesses that arrived, and queue the rest (then the guess behind them)."""
        held = {key[1]: slot for key, slot in self.ram.acquire([(layer, e) for e in experts]).items()}
        served: dict[int, Served] = {}
        arrived: dict[int, ExpertWeights] = {}
        missing: list[int] = []
        for e in experts:
            key = (layer, e)
            if e in held:
                served[e] = Served("ram", self.index.expert(layer, e).nbytes, 0.0)
                self.stats.record("ram", served[e].nbytes)
                continue
            staged = self.prefetcher.take(key)
            if staged is not None:
                arrived[e] = self._use(key, staged, served)
            else:
                missing.append(e)
        started = _Started(layer, served, arrived, held, {})
        try:
            started.waiting = self._demand(layer, missing)
        except BaseException:
            started.let_go(self.ram)
            raise
        if guess is not None:
            self.prefetch(*guess)
        return started

    def _finish(self, layer: int, started: _Started) -> ExpertGroup:
        """Wait for the queued experts (timed: the wait is what a token pays for the link or disk)."""
        served, arrived, waiting = started.served, started.arrived, started.waiting
        if waiting:
            t0 = time.perf_counter()
            if self.wait is not None:
                self.wait(list(waiting.values()))
            fetched = {e: fut.result() for e, fut in waiting.items()}
            seconds = time.perf_counter() - t0
            for e, f in fetched.items():
                arrived[e] = self._use((layer, e), f, served)
            # a wait that included bytes from beyond this machine waited for the link; one that
            # only read the disk did not (it is the disk's)
            far = sum(self.index.expert(layer, e).nbytes for e, f in fetched.items() if f.source in ("hub", "peer"))
            if far:
                self.stats.record_wait(far, seconds)
        held, started.held = started.held, {}  # the group owns the pins from here
        return ExpertGroup(self.ram, layer, served, arrived, held)

    def _demand(self, layer: int, experts: list[int]) -> dict[int, Future]:
        """Queue the demands of one layer; where the Hub is the only remote tier and the layer wants
        more experts than it has connections, experts held nowhere nearer go as runs."""
        runs = self.chain.runs if self.coalesce else None
        plan = None
        if runs is not None and len(experts) > runs.connections:

            def plan(keys: list[ExpertKey]) -> list[list[ExpertKey]]:
                far = [k for k in keys if k not in self.disk]
                return demand_runs(self.index, far, runs.connections, runs.min_piece_bytes)

        waiting = self.flights.demand([(layer, e) for e in experts], plan)
        return {key[1]: fut for key, fut in waiting.items()}

    def _use(self, key: ExpertKey, fetched: Fetched, served: dict[int, Served]) -> ExpertWeights:
        """Count an expert that arrived; it goes into a slot when its group is placed."""
        nbytes = self.index.expert(*key).nbytes
        self.stats.record(fetched.source, nbytes, fetched.seconds)
        served[key[1]] = Served(fetched.source, nbytes, fetched.seconds)
        if fetched.weights is None:  # a demand's fetch is always decoded (a fill keeps only the bytes)
            raise ExpertmeshError(f"expert {key[1]} of layer {key[0]} arrived undecoded")
        return fetched.weights

    # -- guesses ------------------------------------------------------------------------------

    def wants_guesses(self) -> bool:
        """Whether guessing the next layer is worth its (small) compute right now."""
        return self.prefetcher.wants_guesses()

    def prefetch(self, layer: int, experts: Iterable[int], rows: int = 1) -> None:
        """Fetch likely experts of `layer` at low priority, if the link has room and guesses made
        by passes of as many `rows` pay."""
        self.prefetcher.guess(layer, experts, rows)

    def close(self) -> None:
        """Stop fill, the tiers (fetches in flight fail at once) and then the fetch workers (queued
        fetches fail at once: nothing would make them).

        The workers are joined (bounded): MLX aborts the process at exit if a thread that decoded
        experts with it is still running then.
        """
        if self.fill is not None:
            self.fill.stop()
        if self.audit is not None:
            self.audit.stop()
        self.chain.close()  # first: fetches in flight end at once instead of running on
        self.fetches.close()
        if self.fill is not None:
            self.fill.join(CLOSE_TIMEOUT_S)
        if self.audit is not None:
            self.audit.join(CLOSE_TIMEOUT_S)
        if self.trace is not None:
            self.trace.close()
