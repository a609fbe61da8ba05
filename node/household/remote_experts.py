"""Move activations, not experts: run a layer's experts on the household Macs that hold them.

At each MoE layer the engine hands the layer's distinct experts and their token rows to
`RemoteExperts.run`, which places every expert, per pass, by estimated completion time:

    in local RAM                          compute here (free)
    on local disk                         read and compute here, unless a peer would be done sooner
    held by a compute peer                send it the rows: one round trip per peer per layer, a few
                                          KB each way, plus that peer's own read and compute
    held by nobody                        its owner fetches it from the Hub, keeps it and computes it
                                          when the owner is a compute peer; else fetched here

The estimates come from measurements, not fixed rules: each peer's round-trip time and bandwidth
(an `Info` ping and the ComputeExperts calls themselves), its reported queue and its service time
per expert, and this node's own fetch latencies by source from the store's statistics. Experts are
assigned greedily, each to whichever of "here" or a holding peer would finish it first given what
is already assigned there (list scheduling); a pass then takes about as long as its slowest peer.

The calls of a layer go out together, each within `max_call_bytes` of rows (a prompt's expert
with more rows than that has them split over several calls), a few encoded at a time as earlier
ones are answered, and each answer is handed on (`ExpertOutputs`) as it comes; the local experts
are fetched (through the store's one entry point, `layer_groups`, in groups within its hold
limit) and computed while they are in flight. A peer that errs, misses its deadline, answers
with rows of the wrong shape, dtype or count, or answers missing what it was asked to fetch as the
owner is skipped for a while (the peer table's penalty) and its experts are fetched and
computed here: the token is never lost. A prompt's first miss only lengthens that peer's
deadlines for prompts (`RemoteExperts._forgiven`). Everything is counted in the store's
statistics (source `remote`, activation bytes, fallbacks by reason), so summaries and metrics show
the decisions.

`run` is called inside the forward pass, on the process's MLX thread. While it waits for the
peers' answers that thread serves the peers' own ComputeExperts calls (`ModelThread.wait`): two
nodes computing for each other at the same moment each answer the other instead of both waiting
for a deadline.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import mlx.core as mx
import numpy as np

from expertmesh.node.config import RemoteConfig
from expertmesh.node.engine.blocks import ExpertOutputs, StreamingExperts
from expertmesh.node.engine.expert_rows import RoutedRows
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.household.membership import Peer, expert_key
from expertmesh.node.household.peers_tier import HEALTH_DEADLINE_S, PeerSource
from expertmesh.node.rpc import activations
from expertmesh.node.rpc.client import NodeClient
from expertmesh.node.store.prefetch import LayerGuess
from expertmesh.node.store.stats import ExpertKey, StoreStats
from expertmesh.node.store.store import ExpertStore, Served
from expertmesh.v1 import node_pb2

if TYPE_CHECKING:
    from expertmesh.node.household.compute_audit import ComputeAudit

logger = logging.getLogger(__name__)

# Priors until something is measured: gigabit Ethernet, an SSD, a home link.
DEFAULT_LAN_RTT_S = 1e-3
DEFAULT_LAN_BANDWIDTH = RemoteConfig.lan_bandwidth
DEFAULT_DISK_BANDWIDTH = 2e9
DEFAULT_HUB_BANDWIDTH = 12.5e6
DEFAULT_HUB_LATENCY_S = 0.05
EWMA = 0.2  # weight of a new measurement
PING_EVERY_S = 30.0  # round-trip time is re-measured this often per peer
PINGS = 3  # back to back each time; the quickest is the link's (_link)
PING_DEADLINE_S = 2.0  # an Info ping unanswered this long skips the peer as a failed call
CALLS_IN_FLIGHT_PER_PEER = 2  # a peer's calls of a layer sent at once; the rest as these are answered (_PeerCalls)
CALLS_ENCODED_PER_PEER = 4  # of them at most this many encoded at once, those in flight included


@dataclass
class LinkEstimate:
    """What this node has measured of one peer: round trip, bandwidth, call overhead, service time."""

    rtt_s: float = DEFAULT_LAN_RTT_S  # an Info ping
    measured_bandwidth: float | None = None  # bytes/s of its expert transfers (FetchExpert)
    prior_bandwidth: float = DEFAULT_LAN_BANDWIDTH
    call_s: float | None = None  # a ComputeExperts call's time outside the peer: round trip + activations
    service_s: float | None = None  # the peer's own seconds per expert (read + compute)
    service_rows: float | None = None  # the rows per expert of the calls `service_s` was measured on
    mlx_wait_s: float = 0.0  # what a call waits at the peer for its MLX thread (its own generation, other peers)
    queued: int = 0  # ComputeExperts calls running at the peer when the last one arrived
    prompt_scale: float = 1.0  # how many times the rows' linear growth a prompt's call takes here, at least
    misses: int = 0  # deadlines this peer missed since its last answer
    shared_rows: bool = False  # its Info says it takes a call's rows once (ComputeExpertsRequest.rows)
    last_call_s: float = 0.0
    pinged_at: float = -1e9

    def observe_ping(self, seconds: float) -> None:
        self.rtt_s = seconds if self.pinged_at < 0 else (1 - EWMA) * self.rtt_s + EWMA * seconds
        self.pinged_at = time.monotonic()
        if self.call_s is not None:  # a peer once slow (a cold start, a busy spell) gets tried again
            self.call_s = (self.call_s + self.rtt_s) / 2

    @property
    def bandwidth(self) -> float:
        return self.measured_bandwidth if self.measured_bandwidth is not None else self.prior_bandwidth

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        transfer = seconds - self.rtt_s
        if nbytes > 0 and transfer > 0:
            self.measured_bandwidth = _ewma(self.measured_bandwidth, nbytes / transfer)

    def observe_call(
        self,
        wall_s: float,
        server_s: float,
        n_experts: int,
        queued: int,
        mlx_wait_s: float = 0.0,
        rows: int | None = None,
    ) -> None:
        """One ComputeExperts call: `server_s` the peer's own seconds, `mlx_wait_s` the part of them it
        waited for its MLX thread, `rows` the token rows it computed over all of its experts. The
        wait is kept apart: a peer busy with its own generation for a moment is not a peer whose
        experts are slow."""
        if rows is not None and n_experts > 0:
            self.service_rows = _ewma(self.service_rows, rows / n_experts)
        server_s = min(max(0.0, server_s), wall_s)  # the peer's own figures: never trusted beyond what we saw
        mlx_wait_s = min(max(0.0, mlx_wait_s), server_s)
        per_expert = (server_s - mlx_wait_s) / max(1, n_experts)
        self.service_s = _ewma(self.service_s, per_expert)
        self.mlx_wait_s = (1 - EWMA) * self.mlx_wait_s + EWMA * mlx_wait_s
        self.call_s = _ewma(self.call_s, max(0.0, wall_s - server_s))
        self.queued, self.last_call_s = queued, wall_s

    def call_start_s(self, activation_bytes: int) -> float:
        """Seconds a call spends outside the peer, plus the wait for the calls queued there."""
        net = self.call_s if self.call_s is not None else self.rtt_s + activation_bytes / self.bandwidth
        return net + self.mlx_wait_s + self.queued * self.last_call_s

    def transfer_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth

    def rows_factor(self, rows_per_expert: float) -> float:
        """How many times the measured service time a call with `rows_per_expert` may take, at
        most: its compute grows with its rows (on a CPU about linearly; on a GPU far less), and
        `service_s` was measured at `service_rows` (a token's few rows, where decode measured
        it). A prompt's call carries tens of rows per expert: its deadline must allow for them,
        and for what such calls were seen to take beyond that growth (`prompt_scale`): every
        peer computes a prompt's layer at once, so on shared cores each takes longer still."""
        linear = rows_per_expert / max(1.0, self.service_rows or 1.0)
        return linear * self.prompt_scale if linear > 1.0 else 1.0

    def observe_prompt_call(self, seconds: float, expected_s: float, answered: bool) -> None:
        """A prompt-sized call that was `expected_s` long by the linear model (`rows_factor`
        without `prompt_scale`) took `seconds`, or, when not `answered`, at least `seconds` (its
        deadline: a censored observation, whose lower bound is all it says)."""
        if expected_s <= 0:
            return
        ratio = max(1.0, seconds / expected_s)
        if answered:
            self.prompt_scale = (1 - EWMA) * self.prompt_scale + EWMA * ratio
        else:
            self.prompt_scale = max(self.prompt_scale, ratio)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass
class _Call:
    peer: Peer
    request: node_pb2.ComputeExpertsRequest | None  # let go once answered: a prompt's call holds MBs of rows
    client: NodeClient
    timeout_s: float
    sent_bytes: int
    rows: dict[int, int]  # expert -> row count expected back
    dtype: str
    first_row: dict[int, int]  # expert -> where its rows in this call start
    expected_s: float = 0.0  # its duration by the linear rows model, when it carries a prompt's rows; else 0
    misses: int = 0  # the peer's deadlines missed in a row when the call went out
    as_owner: bool = False  # sent with fetch_on_miss: the peer must fetch what it lacks, never answer it missing
    # sampled for the compute audit: (an expert of it, its rows as sent, whether the peer's first)
    audit: tuple[int, node_pb2.Tensor, bool] | None = None
    future: grpc.Future | None = None
    started: float = 0.0
    finished: float = 0.0  # when the answer arrived (set as it does)

    def send(self, answered: Callable[[_Call], None]) -> None:
        """Send it; `answered(self)` once it is (also when it could not be sent: `future` stays None)."""
        self.started = time.perf_counter()
        assert self.request is not None, "a call is sent once"
        try:
            self.future = self.client.compute_experts(self.request, self.timeout_s)
        except ValueError:  # grpc's "closed channel": the node is closing
            self._answered(answered)
            return
        self.future.add_done_callback(lambda _: self._answered(answered))

    def _answered(self, then: Callable[[_Call], None]) -> None:
        self.finished = time.perf_counter()
        self.request = None  # its rows are the peer's now (or computed here, from the caller's own)
        then(self)


class _Answers:
    """Answered calls, handed from gRPC's threads to the MLX thread as they come."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: deque[_Call] = deque()
        self._arrived: concurrent.futures.Future[None] = concurrent.futures.Future()

    def put(self, call: _Call) -> None:
        with self._lock:
            self._calls.append(call)
            if not self._arrived.done():
                self._arrived.set_result(None)

    def take_ready(self) -> list[_Call]:
        """Those answered since the last take, without waiting for one."""
        with self._lock:
            calls = list(self._calls)
            self._calls.clear()
            return calls

    def take(self) -> list[_Call]:
        """Those answered since the last take; on the MLX thread it waits for one serving the
        peers' calls meanwhile (`ModelThread.wait`)."""
        while True:
            with self._lock:
                if self._calls:
                    calls = list(self._calls)
                    self._calls.clear()
                    self._arrived = concurrent.futures.Future()
                    return calls
                arrived = self._arrived
            model_thread().wait([arrived])


class _PeerCalls:
    """One peer's calls of one layer, each encoded on the MLX thread shortly before it is sent.

    At most CALLS_IN_FLIGHT_PER_PEER are in flight. A peer computes one call at a time on its MLX
    thread; a second in flight lets the next call's rows cross while it computes. More would only
    queue there, each holding one of its peer-call slots (rpc/admission.py), which its own fetches
    and other nodes' calls share; a peer refuses a call beyond them as busy, and a long prompt's
    rows make many calls (a 1,024-token prompt's rows for one of four peers, in K3's latent width,
    about twenty).

    Encoded just in time, a prompt's rows exist as the calls that carry them only a few calls at a
    time instead of the layer's whole share for the peer at once, beside the answers: at most
    CALLS_ENCODED_PER_PEER calls of a peer (each within `max_call_bytes` each way) are held at
    once, encoded and waiting to be sent, in flight, or answered and waiting for the MLX thread to
    take them (`taken`). The ones encoded beyond those in flight are sent by the gRPC thread that
    sees an answer, so the peer is kept busy while the MLX thread computes (`fill` runs between
    the local groups and as answers are taken)."""

    def __init__(
        self,
        node_id: str,
        batches: list[list[tuple[int, int, int]]],
        encode: Callable[[list[tuple[int, int, int]]], _Call],
        answers: _Answers,
    ):
        self.node_id = node_id
        self.total = len(batches)
        self._batches = deque(batches)
        self._encode = encode
        self._ready: deque[_Call] = deque()
        self._in_flight = 0
        self._held = 0  # encoded and not yet taken: ready, in flight, or answered and waiting
        self._lock = threading.Lock()
        self._answers = answers

    def fill(self) -> None:
        """On the MLX thread: encode while fewer than CALLS_ENCODED_PER_PEER calls are held, each
        sent at once if a slot in flight is free."""
        while self._batches:
            with self._lock:
                if self._held >= CALLS_ENCODED_PER_PEER:
                    break
                self._held += 1
            call = self._encode(self._batches.popleft())
            with self._lock:
                self._ready.append(call)
            self._send_ready()

    def taken(self) -> None:
        """An answered call of this peer's was taken by the MLX thread (its answer let go)."""
        with self._lock:
            self._held -= 1

    def _send_ready(self) -> None:
        while True:
            with self._lock:
                if not self._ready or self._in_flight >= CALLS_IN_FLIGHT_PER_PEER:
                    return
                call = self._ready.popleft()
                self._in_flight += 1
            call.send(self._answered)

    def _answered(self, call: _Call) -> None:
        with self._lock:
            self._in_flight -= 1
        self._answers.put(call)
        self._send_ready()


@dataclass
class Placement:
    """Where each of a layer's experts runs: `remote` maps expert -> peer; the rest run here."""

    remote: dict[int, Peer] = field(default_factory=dict)
    owner_fetch: set[int] = field(default_factory=set)  # remote experts the owner fetches first
    estimate_s: dict[str, float] = field(default_factory=dict)  # node id (or "here") -> estimated busy time


class RemoteExperts:
    """Places and runs each layer's experts on this node and the household's compute peers."""

    def __init__(
        self, store: ExpertStore, peers: PeerSource, disk: Container[ExpertKey], config: RemoteConfig | None = None
    ):
        self.store = store
        self.peers = peers
        self.disk = disk
        self.config = config or RemoteConfig()
        self.links: dict[str, LinkEstimate] = {}
        self.audit: ComputeAudit | None = None  # set by the composition root unless audits are off
        peers.transfer_observer = lambda peer, nbytes, seconds: self._link(peer).observe_transfer(nbytes, seconds)

    # -- cost model ---------------------------------------------------------------------------

    def _link(self, peer: Peer) -> LinkEstimate:
        link = self.links.get(peer.node_id)
        if link is None:
            link = self.links[peer.node_id] = LinkEstimate(prior_bandwidth=self.config.lan_bandwidth)
        if time.monotonic() - link.pinged_at > PING_EVERY_S:
            # The quickest of a few pings: one answer a busy moment delayed (a GC pause, a loaded
            # core) is not the link, and taken as its round trip it would make every call look
            # dearer than a fetch until the next ping (as NTP keeps the least-delayed sample).
            quickest = None
            client = self.peers.client(peer.address)
            for _ in range(PINGS):
                t0 = time.perf_counter()
                try:
                    link.shared_rows = client.info(timeout=PING_DEADLINE_S).shared_rows
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        # the ping runs on the MLX thread: a peer that lets it hang would cost every
                        # token that wait each PING_EVERY_S, and its calls would hang as well
                        self.peers.penalise(peer, "ping_deadline_exceeded")
                    break  # any other failure: the call itself will find out
                took = time.perf_counter() - t0
                quickest = took if quickest is None else min(quickest, took)
            if quickest is None:
                link.pinged_at = time.monotonic()
            else:
                link.observe_ping(quickest)
        return link

    def _fetch_latency_s(self, source: str, nbytes: int, stats: StoreStats) -> float:
        """Seconds one fetch from `source` takes here: measured by the store (`stats`), else a prior."""
        if stats.uses[source] >= 4 and stats.bytes[source] > 0:
            return stats.fetch_seconds[source] / stats.uses[source]
        if source == "disk":
            return nbytes / DEFAULT_DISK_BANDWIDTH
        if source == "peer":
            return DEFAULT_LAN_RTT_S + nbytes / DEFAULT_LAN_BANDWIDTH
        return DEFAULT_HUB_LATENCY_S + nbytes / DEFAULT_HUB_BANDWIDTH

    def _compute_peers(self) -> list[Peer]:
        return self.peers.table.compute_peers()

    def plan(self, layer: int, experts: list[int], row_bytes: dict[int, int]) -> Placement:
        """Assign each expert not in local RAM to wherever it would be done first.

        List scheduling over the resources a pass keeps busy: this node's disk (reads side by
        side on the store's workers), the Hub link (likewise), and each peer — its link carries
        the experts fetched from it, and its compute runs the experts sent to it after the call's
        fixed cost (round trip, activations, its queue). Every expert fetched from a peer also
        crosses this node's own NIC (`"nic"`), one after another whichever peer sends it: three
        peers do not make a gigabit port three times faster (docs/lab.md). Each expert, slowest
        first, goes where its end time is earliest; a tie stays here. `row_bytes[e]`: bytes of
        expert e's rows.
        """
        placement = Placement()
        computers = self._compute_peers()
        if not computers:
            return placement
        index = self.store.index
        # what each peer holds: as last known (the health checks keep it fresh), asked now only the first time
        held = {p.node_id: self.peers.known_inventory(p) or self.peers.inventory(p) or set() for p in computers}
        by_id = {p.node_id: p for p in computers}
        links = {p.node_id: self._link(p) for p in computers}
        lanes = self.store.fetch_workers  # local fetches run side by side
        busy: dict[str, float] = {"here": 0.0, "hub": 0.0}
        stats = self.store.stats.snapshot()
        called: set[str] = set()
        # (fetch seconds, expert, bytes, (where it is fetched, fetch seconds, seconds on our NIC),
        #  [(a peer that could compute it, whether it must fetch it first)])
        todo: list[tuple[float, int, int, tuple[str, float, float], list[tuple[str, bool]]]] = []
        for e in experts:
            key = (layer, e)
            if key in self.store.ram:
                continue
            loc = index.expert(layer, e)
            holders = [p for p in computers if key in held[p.node_id]]
            owner = self.peers.table.ranked(expert_key(index, layer, e))[0]
            source = holders[0] if holders else owner
            if key in self.disk:
                fetch = ("here", self._fetch_latency_s("disk", loc.nbytes, stats) / lanes, 0.0)
            elif source is not None:
                link = links.get(source.node_id) or self._link(source)
                # an owner that lacks the expert fetches it from the Hub before sending it
                hub_first = self._fetch_latency_s("hub", loc.nbytes, stats) if not holders else 0.0
                fetch = (source.node_id, hub_first + link.transfer_s(loc.nbytes), link.transfer_s(loc.nbytes))
            else:
                fetch = ("hub", self._fetch_latency_s("hub", loc.nbytes, stats) / lanes, 0.0)
            options = [(p.node_id, False) for p in holders]
            if owner is not None and owner.compute and owner.live and owner not in holders:
                options.append((owner.node_id, True))  # the owner fetches it from the Hub, keeps it, computes it
            todo.append((fetch[1], e, loc.nbytes, fetch, options))
        disk_prior = self._fetch_latency_s("disk", index.expert(layer, experts[0]).nbytes, stats) if experts else 0.0
        for cost, e, nbytes, (where, _, nic_s), options in sorted(todo, key=lambda t: -t[0]):
            # a transfer starts when its sender is free and, for its last `nic_s`, our NIC is too
            fetch_end = busy.get(where, 0.0) + cost
            if nic_s > 0:
                fetch_end = max(fetch_end, busy.get("nic", 0.0) + nic_s)
            best, best_end, remote = where, fetch_end, None
            for node_id, fetches in options:
                link = links[node_id]
                start = busy.get(node_id, 0.0) + (0.0 if node_id in called else link.call_start_s(2 * row_bytes[e]))
                end = start + (link.service_s if link.service_s is not None else disk_prior)
                if fetches:
                    end += self._fetch_latency_s("hub", nbytes, stats)
                if end < best_end:
                    best, best_end, remote = node_id, end, (node_id, fetches)
            busy[best] = best_end
            if remote is None and nic_s > 0:
                busy["nic"] = best_end
            if remote is not None:
                called.add(best)
                placement.remote[e] = by_id[best]
                if remote[1]:
                    placement.owner_fetch.add(e)
        placement.estimate_s = busy
        return placement

    def prefers_local(self, layer: int, expert: int) -> bool:
        """Whether a guessed expert is worth prefetching here (no compute peer is known to hold it)."""
        key = (layer, expert)
        if key in self.disk:
            return True
        return not any(key in self.peers.known_inventory(p) for p in self._compute_peers())

    # -- one layer ----------------------------------------------------------------------------

    def run(
        self,
        block: StreamingExperts,
        experts: list[int],
        rows: RoutedRows,
        guess: LayerGuess | None,
    ) -> tuple[dict[int, mx.array], dict[int, Served]]:
        """Every expert's output rows for `block`'s layer, computed here or on peers, and which
        tier (or `remote`) served each (`run_into`, the parts of an expert joined)."""
        joined = _Joined()
        served = self.run_into(block, experts, rows, guess, joined)
        return joined.outputs(), served

    def run_into(
        self,
        block: StreamingExperts,
        experts: list[int],
        rows: RoutedRows,
        guess: LayerGuess | None,
        outputs: ExpertOutputs,
    ) -> dict[int, Served]:
        """Every expert's output rows for `block`'s layer into `outputs` as each part is made here
        or answered by a peer, and which tier (or `remote`) served each.

        Expert e's rows are gathered when they are encoded into a call (`rows.host(e)`) or computed
        here (`rows[e]`), and not kept after: a prompt's rows live only in the few calls encoded
        at a time (`_PeerCalls`), and each answer goes to `outputs` as it comes.
        An expert that fails at a peer after some of its parts were put is put again, whole, once
        computed here (`outputs.drop` first)."""
        if guess is not None:
            guess = guess._replace(experts=[e for e in guess.experts if self.prefers_local(guess.layer, e)])
        counts = {e: rows.count(e) for e in experts}
        itemsize = rows.dtype.size
        placement = self.plan(block.layer, experts, {e: n * rows.width * itemsize for e, n in counts.items()})
        answers = _Answers()
        chains = self._calls_of(block, placement, rows, counts, itemsize, answers)
        _fill(chains)
        local = [e for e in experts if e not in placement.remote]
        served: dict[int, Served] = {}
        # the whole routing announces the pass (traced, judging the guesses made for it); evaluated
        # before waiting for the peers, whose calls to us may then write slots meanwhile
        collecting = _Collecting(self, block, chains, answers, outputs)
        self._compute_here(block, local, rows, outputs, served, guess, routed=experts, between=collecting.between)
        if chains:
            failed = collecting.rest(served)
            if failed:
                for e in failed:
                    outputs.drop(e)
                self._compute_here(block, failed, rows, outputs, served, None, routed=[])
        return served

    def _compute_here(
        self,
        block: StreamingExperts,
        experts: list[int],
        rows: RoutedRows,
        outputs: ExpertOutputs,
        served: dict[int, Served],
        guess: LayerGuess | None,
        routed: list[int],
        between: Callable[[], None] | None = None,
    ) -> None:
        """`experts` fetched and computed on this node, a group at a time within the hold limit;
        `between()` after each group (the peers' answers taken and next calls encoded meanwhile)."""
        store = self.store
        for group in store.layer_groups(block.layer, experts, guess=guess, routed=routed):
            if not group.served:
                continue  # nothing here: the call only announced the pass
            with group.placed() as placed:
                part = block.compute_rows(placed, {e: rows[e] for e in group.served})
                mx.eval(list(part.values()))
            for e, y in part.items():
                outputs.put(e, 0, y)
            del part
            served.update(group.served)
            if between is not None:
                between()

    def _calls_of(
        self,
        block: StreamingExperts,
        placement: Placement,
        rows: RoutedRows,
        counts: dict[int, int],
        itemsize: int,
        answers: _Answers,
    ) -> list[_PeerCalls]:
        """Each peer's calls of the layer, none encoded yet (see `_PeerCalls`)."""
        by_peer: dict[str, list[int]] = {}
        peers = {}
        for e, p in placement.remote.items():
            by_peer.setdefault(p.node_id, []).append(e)
            peers[p.node_id] = p
        model = node_pb2.ModelKey(repo_id=self.store.index.repo_id, commit=self.store.index.commit)
        chains = []
        for node_id, experts in by_peer.items():
            peer = peers[node_id]
            link = self.links.get(node_id) or self._link(peer)
            batches = _calls(block, sorted(experts), counts, itemsize, self.config.max_call_bytes)
            encode = _Encoder(
                self.config,
                peer,
                self.peers.client(peer.address),
                link,
                placement.estimate_s.get(node_id, 0.0),
                node_pb2.ComputeExpertsRequest(model=model, layer=block.layer),
                placement.owner_fetch,
                rows,
                self.audit,
            )
            chains.append(_PeerCalls(node_id, batches, encode, answers))
        return chains

    def _take(
        self,
        block: StreamingExperts,
        call: _Call,
        outputs: ExpertOutputs,
        walls: dict[int, float],
        fall_back: Callable[..., None],
    ) -> None:
        """One answered call: its rows checked and put, its timings learnt, or its experts failed."""
        asked = list(call.rows)
        # the call lets go of its future: the future's callbacks refer to the call, and the
        # answer's megabytes would otherwise wait in that cycle for a garbage collection
        future, call.future = call.future, None
        if future is None:  # never sent
            fall_back(asked, fallback_error=1)
            return
        try:
            response = future.result()
        except grpc.RpcError as error:
            code = error.code()
            deadline = code == grpc.StatusCode.DEADLINE_EXCEEDED
            if not deadline:  # the count alone says nothing of why: the status does
                logger.warning(
                    "ComputeExperts to %s failed (%s: %s); computing its %d experts here",
                    call.peer.node_id,
                    code.name,
                    error.details(),
                    len(asked),
                )
            forgiven = deadline and self._forgiven(call)
            if not forgiven and code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy is no fault: not skipped
                self.peers.penalise_call(
                    call.peer, code, "compute_deadline" if deadline else f"compute_{code.name.lower()}"
                )
            fall_back(asked, **{"fallback_deadline" if deadline else "fallback_error": 1})
            return
        wall = call.finished - call.started
        try:
            got = self._check(block, call, response)
        except activations.BadTensor as error:
            logger.warning(
                "peer %s answered ComputeExperts with bad rows (%s); computing here", call.peer.node_id, error
            )
            self.peers.penalise(call.peer, "bad_output")
            fall_back(asked, fallback_bad_output=1)
            return
        received = sum(len(x.rows.data) for x in response.experts)
        link = self.links.get(call.peer.node_id) or self._link(call.peer)
        link.misses = 0
        if call.expected_s > 0:
            link.observe_prompt_call(wall, call.expected_s, answered=True)
        link.observe_call(
            wall,
            response.compute_seconds,
            len(got) + len(response.missing),
            response.queued,
            response.mlx_wait_seconds,
            rows=sum(n for e, n in call.rows.items() if e in got),
        )
        self.store.stats.record_remote(calls=1, sent_bytes=call.sent_bytes, received_bytes=received)
        missing = list(response.missing)
        audit, call.audit = call.audit, None
        if audit is not None and self.audit is not None and audit[0] in got:
            answered = _own_copy(next(x.rows for x in response.experts if x.expert == audit[0]))
            self.audit.offer(call.peer, block.layer, audit[0], audit[1], answered, audit[2])
        del response  # its bytes: decoded into `got` now
        if call.as_owner and missing:
            # asked as the owner, a peer fetches what it lacks (household/expert_compute.py) and
            # never answers it missing: one that does would be asked again at every layer
            logger.warning(
                "peer %s answered %d experts missing though asked to fetch them as their owner; computing here",
                call.peer.node_id,
                len(missing),
            )
            self.peers.penalise(call.peer, "owner_missing")
        for e, arr in got.items():
            outputs.put(e, call.first_row[e], arr)
            walls[e] = max(walls.get(e, 0.0), wall)
            self.peers.note_holding(call.peer, (block.layer, e), True)
        for e in missing:
            self.peers.note_holding(call.peer, (block.layer, e), False)
        fall_back(missing, fallback_missing=1)

    def _forgiven(self, call: _Call) -> bool:
        """Whether a call past its deadline is a measurement rather than a fault: the first miss
        in a row of a prompt-sized call, from a peer that still answers its health check. Its
        deadline was a guess: from decode's few rows, or, before any call, from a prior (often
        just the floor) while every peer computes the same layer. The miss says the peer needs
        at least that long for a prompt's rows, so the next prompt's deadlines allow for it
        (`observe_prompt_call`) and the peer keeps computing the prompt's other layers and
        decode. A second miss in a row, a decode call's miss or a silent peer is a fault: the
        peer is skipped (`penalise_call`)."""
        link = self.links.get(call.peer.node_id) or self._link(call.peer)
        link.misses += 1
        if call.expected_s <= 0 or call.misses > 0:
            return False
        link.observe_prompt_call(call.timeout_s, call.expected_s, answered=False)
        return self.peers.client(call.peer.address).serving(HEALTH_DEADLINE_S)

    def _check(
        self, block: StreamingExperts, call: _Call, response: node_pb2.ComputeExpertsResponse
    ) -> dict[int, mx.array]:
        """The response's rows, if it answers exactly what was asked with rows of the right shape.

        Raises:
            BadTensor: an expert not asked, twice, or neither answered nor missing; rows of another
                shape or dtype than asked; values that are not finite.
        """
        got: dict[int, mx.array] = {}
        for item in response.experts:
            if item.expert not in call.rows or item.expert in got:
                raise activations.BadTensor(f"expert {item.expert} was not asked for, or came twice")
            got[item.expert] = activations.decode(
                item.rows, block.output_dims, dtype=call.dtype, rows=call.rows[item.expert]
            )
            if not activations.finite(item.rows):
                raise activations.BadTensor("rows with NaN or infinite values")
        missing = set(response.missing)
        if set(got) | missing != set(call.rows) or set(got) & missing or len(missing) < len(response.missing):
            raise activations.BadTensor("the answer does not account for every expert asked exactly once")
        return got


def _calls(
    block: StreamingExperts, experts: list[int], counts: dict[int, int], itemsize: int, max_bytes: int
) -> list[list[tuple[int, int, int]]]:
    """One peer's experts and their `counts` of rows cut into calls of at most `max_bytes` of rows
    each way (or a single row, where one row is larger): each call a list of (expert, its first
    row, how many rows).

    An expert whose rows do not fit in the room a call has left is split over calls by rows (a
    long prompt gives an expert thousands), so no request or answer passes the limit both sides'
    channels set (rpc/server.py, rpc/tls.py), and none is computed here only for being large. An
    expert appears at most once per call, as the peer requires; its parts are in consecutive calls."""
    row_bytes = max(block.input_width, block.output_dims) * itemsize  # the answer may be the wider
    calls: list[list[tuple[int, int, int]]] = []
    batch: list[tuple[int, int, int]] = []
    room = max_bytes
    for e in experts:
        first = 0
        while first < counts[e]:
            if room < row_bytes and batch:
                calls.append(batch)
                batch, room = [], max_bytes
            take = min(counts[e] - first, max(1, room // row_bytes))
            batch.append((e, first, take))
            room -= take * row_bytes
            first += take
    if batch:
        calls.append(batch)
    return calls


def _fill(chains: list[_PeerCalls]) -> None:
    for chain in chains:
        chain.fill()


class _Collecting:
    """A layer's answers, taken whenever the MLX thread looks: between its local groups without
    waiting (`between`), then waiting for the rest (`rest`). Each is checked and put into
    `outputs` as it is taken and its answer let go, and the peer's next calls are encoded: a peer
    holds at most CALLS_ENCODED_PER_PEER calls at once, answered ones waiting here included
    (_PeerCalls), while it is kept busy through a long local phase."""

    def __init__(
        self,
        remote: RemoteExperts,
        block: StreamingExperts,
        chains: list[_PeerCalls],
        answers: _Answers,
        outputs: ExpertOutputs,
    ):
        self._remote, self._block, self._chains = remote, block, chains
        self._answers, self._outputs = answers, outputs
        self._chain_of = {chain.node_id: chain for chain in chains}
        self._left = sum(chain.total for chain in chains)
        self._failed: set[int] = set()
        self._walls: dict[int, float] = {}

    def between(self) -> None:
        """Between local groups: the answers already here taken, the peers' next calls encoded."""
        self._take_all(self._answers.take_ready())
        _fill(self._chains)

    def rest(self, served: dict[int, Served]) -> list[int]:
        """Every answer still to come, taken as it comes; `served` says `remote` for an expert
        all of whose parts came. Returns the experts to fetch and compute here instead (an
        expert with a failed part among them)."""
        while self._left:
            self._take_all(self._answers.take())
            _fill(self._chains)
        stats = self._remote.store.stats
        for e, wall in self._walls.items():
            if e in self._failed:
                continue
            # a use with no expert bytes: the LAN bytes are the activations, in record_remote
            stats.record("remote", 0, wall)
            served[e] = Served("remote", 0, wall)
        return sorted(self._failed)

    def _take_all(self, calls: list[_Call]) -> None:
        for call in calls:
            self._left -= 1
            self._remote._take(self._block, call, self._outputs, self._walls, self._fall_back)
            self._chain_of[call.peer.node_id].taken()

    def _fall_back(self, asked: list[int], **reason: int) -> None:
        fresh = [e for e in asked if e not in self._failed]
        self._remote.store.stats.record_remote(**{k: len(fresh) for k in reason})
        self._failed.update(asked)


class _Encoder:
    """Makes one peer's calls of one layer from its batches of (expert, first row, rows), on the
    MLX thread: each expert's rows gathered on the host once for all of its parts (they are in
    consecutive calls), and let go with its last."""

    def __init__(
        self,
        config: RemoteConfig,
        peer: Peer,
        client: NodeClient,
        link: LinkEstimate,
        estimate_s: float,
        head: node_pb2.ComputeExpertsRequest,
        owner_fetch: set[int],
        rows: RoutedRows,
        audit: ComputeAudit | None = None,
    ):
        self.config, self.peer, self.client, self.link = config, peer, client, link
        self.estimate_s, self.head, self.owner_fetch, self.rows = estimate_s, head, owner_fetch, rows
        self.misses = link.misses  # as the layer began: its calls' misses are judged together (_forgiven)
        self.dtype = activations.wire_dtype(rows.dtype)
        self._held: tuple[int, np.ndarray] | None = None
        self.audit = audit  # samples calls for the compute audit (household/compute_audit.py)

    def _own(self, batch: list[tuple[int, int, int]]) -> list[node_pb2.ExpertRows]:
        """Each expert's rows in full, as an older peer takes them."""
        encoded = []
        for e, first, n in batch:
            if self._held is None or self._held[0] != e:
                self._held = None
                self._held = (e, self.rows.host(e))  # gathered on the host: no wait for the device
            x = self._held[1]
            encoded.append(node_pb2.ExpertRows(expert=e, rows=activations.encode(x[first : first + n], self.dtype)))
            if first + n == x.shape[0]:
                self._held = None  # its last part
        return encoded

    def _shared(self, batch: list[tuple[int, int, int]], request: node_pb2.ComputeExpertsRequest) -> None:
        """The call's rows once (`request.rows`), each expert's named by index: a token routed to
        several experts this peer computes crosses the LAN once, not once per expert."""
        ids = [self.rows.row_ids(e)[first : first + n] for e, first, n in batch]
        unique, index = np.unique(np.concatenate(ids), return_inverse=True)
        request.rows.CopyFrom(activations.encode(self.rows.host_rows(unique), self.dtype))
        at = 0
        for e, _, n in batch:
            request.experts.append(node_pb2.ExpertRows(expert=e, row_index=index[at : at + n].tolist()))
            at += n

    def __call__(self, batch: list[tuple[int, int, int]]) -> _Call:
        request = node_pb2.ComputeExpertsRequest()
        request.CopyFrom(self.head)
        if self.link.shared_rows:
            self._shared(batch, request)
        else:
            request.experts.extend(self._own(batch))
        request.fetch_on_miss = any(e in self.owner_fetch for e, _, _ in batch)
        # the estimate places experts by their bytes and per-expert costs (a row's compute costs
        # the same here or there); the deadline must also cover the call's rows
        factor = self.link.rows_factor(sum(n for _, _, n in batch) / len(batch))
        timeout = max(self.config.deadline_floor_s, self.config.deadline_factor * self.estimate_s * factor)
        audit = None
        sampled = self.audit.sample(self.peer) if self.audit is not None else None
        if self.audit is not None and sampled is not None:
            item = request.experts[self.audit.pick(len(request.experts))]  # any: the peer cannot tell which
            audit = (item.expert, _expert_input(request, item), sampled == "first")
        return _Call(
            self.peer,
            request,
            self.client,
            timeout,
            len(request.rows.data) + sum(len(x.rows.data) for x in request.experts),
            {e: n for e, _, n in batch},
            self.dtype,
            {e: first for e, first, _ in batch},
            expected_s=self.estimate_s * factor / self.link.prompt_scale if factor > 1.0 else 0.0,
            misses=self.misses,
            as_owner=request.fetch_on_miss,
            audit=audit,
        )


def _expert_input(request: node_pb2.ComputeExpertsRequest, item: node_pb2.ExpertRows) -> node_pb2.Tensor:
    """`item`'s input rows as a Tensor of their own, whether the call sent them with it or shared."""
    if not request.HasField("rows"):
        return _own_copy(item.rows)
    return activations.take_rows(request.rows, item.row_index)


def _own_copy(rows: node_pb2.Tensor) -> node_pb2.Tensor:
    """One expert's rows apart from their message: a part kept alone would keep the whole call's
    rows alive (megabytes of a prompt's) until its audit is done."""
    copy = node_pb2.Tensor()
    copy.CopyFrom(rows)
    return copy


class _Joined:
    """A layer's outputs as one array per expert, an expert's parts (from several calls) joined in
    order: what decode's layer takes."""

    def __init__(self) -> None:
        self._parts: dict[int, list[tuple[int, mx.array]]] = {}

    def put(self, expert: int, first: int, rows: mx.array) -> None:
        self._parts.setdefault(expert, []).append((first, rows))

    def drop(self, expert: int) -> None:
        self._parts.pop(expert, None)

    def outputs(self) -> dict[int, mx.array]:
        out = {}
        for e, pieces in self._parts.items():
            pieces.sort(key=lambda piece: piece[0])
            out[e] = pieces[0][1] if len(pieces) == 1 else mx.concatenate([arr for _, arr in pieces])
        return out
