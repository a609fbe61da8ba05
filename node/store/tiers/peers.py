"""The peers tier: experts from other Macs of the household, between the disk and the Hub.

Each expert has an owner: the live node with the highest weighted rendezvous score for the
expert's key (weight = the node's disk budget), so ownership spreads in proportion to disk and
moves little when a node comes or goes. A miss goes to the owner first, who fetches it from the
Hub if it lacks it (so each expert crosses the internet once per household), keeps it and
serves it. If this node is the owner, the store goes to the Hub itself. A peer that errs, times
out or sends bad bytes is skipped for a while and counted by reason.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from expertmesh.node.hub.expert_index import ExpertIndex, ExpertLocation
from expertmesh.node.rpc.auth import call_metadata
from expertmesh.node.rpc.tls import open_channel
from expertmesh.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)

FETCH_DEADLINE_S = 30.0  # for one expert from one peer, the owner's Hub fetch included
SKIP_AFTER_ERROR_S = 30.0
INFO_DEADLINE_S = 5.0
INVENTORY_TTL_S = 30.0  # how long a peer's inventory is trusted before it is asked again
HEALTH_EVERY_S = 10.0  # every peer's gRPC health is checked this often
HEALTH_DEADLINE_S = 2.0


@dataclass
class Peer:
    node_id: str
    address: str  # host:port
    weight: float  # its disk budget in bytes: a bigger disk owns more experts
    role: str = "full"
    skip_until: float = 0.0
    compute: bool = False  # answers ComputeExperts: runs experts it holds on activations we send

    @property
    def live(self) -> bool:
        return time.monotonic() >= self.skip_until


def rendezvous_score(key: str, node_id: str, weight: float) -> float:
    """Weighted rendezvous (highest random weight) score: -w / ln(u), u uniform in (0, 1) from a hash."""
    if weight <= 0:
        return -math.inf
    h = int.from_bytes(hashlib.sha256(f"{key}|{node_id}".encode()).digest()[:8], "big")
    u = (h + 0.5) / 2**64
    return -weight / math.log(u)


def inventory_keys(inv: node_pb2.InventoryResponse) -> set[tuple[int, int]]:
    """The (layer, expert) keys an InventoryResponse's bitmaps mark as held."""
    return {(lb.layer, e) for lb in inv.layers for e in range(lb.num_experts) if lb.bits[e // 8] >> (e % 8) & 1}


def expert_key(index: ExpertIndex, layer: int, expert: int) -> str:
    return f"{index.repo_id}@{index.commit}/{layer}/{expert}"


@dataclass
class PeerTable:
    """The peers this node knows: from `--peer` addresses and, later, from zeroconf."""

    self_id: str
    self_weight: float
    peers: dict[str, Peer] = field(default_factory=dict)
    errors: Counter = field(default_factory=Counter)  # reason -> count
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, peer: Peer) -> None:
        with self._lock:
            if peer.node_id == self.self_id:
                return  # our own advertisement
            self.peers[peer.node_id] = peer

    def remove(self, node_id: str) -> None:
        with self._lock:
            self.peers.pop(node_id, None)

    def live_count(self) -> int:
        with self._lock:
            return sum(p.live for p in self.peers.values())

    def compute_peers(self) -> list[Peer]:
        """Live peers that answer ComputeExperts."""
        with self._lock:
            return [p for p in self.peers.values() if p.compute and p.live]

    def restore(self, peer: Peer) -> None:
        """A skipped peer answered its health check: use it again now, not when its skip ends."""
        with self._lock:
            peer.skip_until = 0.0

    def penalise(self, peer: Peer, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1
            peer.skip_until = time.monotonic() + SKIP_AFTER_ERROR_S
        logger.warning(
            "peer %s (%s): %s; skipping it for %.0f s", peer.node_id, peer.address, reason, SKIP_AFTER_ERROR_S
        )

    def ranked(self, key: str) -> list[Peer | None]:
        """Live peers by rendezvous score for `key`, best first; None stands for this node."""
        with self._lock:
            entries = [(rendezvous_score(key, p.node_id, p.weight), p) for p in self.peers.values() if p.live]
        entries.append((rendezvous_score(key, self.self_id, self.self_weight), None))
        return [p for _, p in sorted(entries, key=lambda e: e[0], reverse=True)]


def describe_peer(address: str, secret: str, tls_ca: bytes | None = None) -> Peer:
    """Ask a node at `address` who it is (for a static `--peer`)."""
    with open_channel(address, tls_ca) as channel:
        info = node_pb2_grpc.NodeStub(channel).Info(
            node_pb2.InfoRequest(), metadata=call_metadata(secret), timeout=INFO_DEADLINE_S
        )
    return Peer(info.node_id, address, float(info.disk_budget_bytes), info.role, compute=info.compute)


class PeerSource:
    """A `ByteSource` over the household: the owner first, then the other live peers."""

    name = "peer"

    def __init__(
        self,
        index: ExpertIndex,
        table: PeerTable,
        secret: str,
        deadline_s: float = FETCH_DEADLINE_S,
        tls_ca: bytes | None = None,
    ):
        self.index = index
        self.tls_ca = tls_ca
        self.table = table
        self._metadata = call_metadata(secret)
        self.deadline_s = deadline_s
        self._channels: dict[str, grpc.Channel] = {}
        self._last_server: dict[tuple[int, int], Peer] = {}
        self._inventories: dict[str, tuple[float, set[tuple[int, int]]]] = {}  # node id -> (when, held keys)
        self._lock = threading.Lock()
        # called as transfer_observer(peer, nbytes, seconds) after each expert that came from a
        # peer: how remote execution measures each peer's bandwidth
        self.transfer_observer = None
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    def stub(self, address: str) -> node_pb2_grpc.NodeStub:
        return self._stub(address)

    @property
    def metadata(self):
        return self._metadata

    def _stub(self, address: str) -> node_pb2_grpc.NodeStub:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, self.tls_ca)
            return node_pb2_grpc.NodeStub(channel)

    def inventory(self, peer: Peer, timeout: float = INFO_DEADLINE_S) -> set[tuple[int, int]] | None:
        """The keys `peer` holds, as its inventory said at most INVENTORY_TTL_S ago (asked again
        when older); None when it cannot be had."""
        now = time.monotonic()
        with self._lock:
            known = self._inventories.get(peer.node_id)
        if known is None or now - known[0] > INVENTORY_TTL_S:
            model = node_pb2.ModelKey(repo_id=self.index.repo_id, commit=self.index.commit)
            try:
                inv = self._stub(peer.address).GetInventory(
                    node_pb2.InventoryRequest(model=model),
                    metadata=self._metadata,
                    timeout=min(timeout, INFO_DEADLINE_S),
                )
            except grpc.RpcError:
                return None
            known = (now, inventory_keys(inv))
            with self._lock:
                self._inventories[peer.node_id] = known
        return known[1]

    def known_inventory(self, peer: Peer) -> set[tuple[int, int]]:
        """What `peer` was last known to hold, without asking (empty if never asked)."""
        with self._lock:
            known = self._inventories.get(peer.node_id)
        return known[1] if known is not None else set()

    def note_holding(self, peer: Peer, key: tuple[int, int], held: bool) -> None:
        """Correct the cached inventory from what a call showed (an expert computed or missing)."""
        with self._lock:
            known = self._inventories.get(peer.node_id)
            if known is not None:
                (known[1].add if held else known[1].discard)(key)

    def _holds(self, peer: Peer, key: tuple[int, int], timeout: float) -> bool:
        """Whether `peer`'s inventory lists `key`; a peer whose inventory cannot be had is assumed
        to hold it, so it is still asked."""
        held = self.inventory(peer, timeout)
        return held is None or key in held

    def fetch(self, loc: ExpertLocation) -> bytes | None:
        """The expert from the household, or None: the caller goes to the Hub (this node owns it, or
        no peer could serve it in time). The owner is asked first (it fetches on a miss); after it,
        only the peers whose inventories list the expert."""
        key = expert_key(self.index, loc.layer, loc.expert)
        ranked = self.table.ranked(key)
        deadline = time.monotonic() + self.deadline_s
        for n, peer in enumerate(ranked):
            if peer is None:
                if n == 0:
                    return None  # we own it: we fetch it from the Hub ourselves
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if n > 0 and not self._holds(peer, (loc.layer, loc.expert), left):
                continue
            blob = self._fetch_from(peer, loc, owner=(n == 0), timeout=left)
            if blob is not None:
                self._last_server[(loc.layer, loc.expert)] = peer
                return blob
        return None

    def _fetch_from(self, peer: Peer, loc: ExpertLocation, owner: bool, timeout: float) -> bytes | None:
        request = node_pb2.FetchExpertRequest(
            key=node_pb2.ExpertKey(
                model=node_pb2.ModelKey(repo_id=self.index.repo_id, commit=self.index.commit),
                layer=loc.layer,
                expert=loc.expert,
            ),
            fetch_on_miss=owner,
        )
        t0 = time.perf_counter()
        try:
            parts, size, digest = [], None, None
            for chunk in self._stub(peer.address).FetchExpert(request, metadata=self._metadata, timeout=timeout):
                if size is None:
                    size, digest = chunk.size, chunk.sha256
                parts.append(chunk.data)
                if sum(map(len, parts)) > loc.nbytes:
                    self.table.penalise(peer, "oversized")
                    return None
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND and not owner:
                return None  # an honest miss
            self.table.penalise(peer, e.code().name.lower())
            return None
        blob = b"".join(parts)
        if size != loc.nbytes or len(blob) != loc.nbytes:
            self.table.penalise(peer, "wrong_size")
            return None
        if hashlib.sha256(blob).hexdigest() != digest:
            self.table.penalise(peer, "bad_digest")
            return None
        if self.transfer_observer is not None:
            self.transfer_observer(peer, len(blob), time.perf_counter() - t0)
        return blob

    def check_health(self) -> None:
        """Ask every known peer's standard health service once: one that is not SERVING (or does
        not answer in HEALTH_DEADLINE_S) is skipped, and a skipped one that is SERVING again is
        used again at once; a compute peer's inventory is refreshed here when stale, so remote
        execution's placement reads it without a call. Generation never waits for this."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with self.table._lock:
            peers = list(self.table.peers.values())
        for peer in peers:
            with self._lock:
                channel = self._channels.get(peer.address)
                if channel is None:
                    channel = self._channels[peer.address] = open_channel(peer.address, self.tls_ca)
            try:
                status = (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_DEADLINE_S)
                    .status
                )
            except grpc.RpcError as e:
                if peer.live:
                    self.table.penalise(peer, f"health_{e.code().name.lower()}")
                continue
            if status != health_pb2.HealthCheckResponse.SERVING:
                if peer.live:
                    self.table.penalise(peer, "not_serving")
                continue
            if not peer.live:
                self.table.restore(peer)
            if peer.compute:
                self.inventory(peer)  # asked again when stale, here rather than in a generation's layer

    def start_health_checks(self, every_s: float = HEALTH_EVERY_S) -> None:
        """Check every peer's health every `every_s` seconds until `close`."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    self.check_health()
                except Exception:  # a prober must never die of one bad round
                    logger.exception("peer health check failed")

        self._prober = threading.Thread(target=loop, name="peer-health", daemon=True)
        self._prober.start()

    def discard(self, loc: ExpertLocation) -> None:
        """The store found these bytes disagree with the digest it recorded: the peer lied."""
        peer = self._last_server.pop((loc.layer, loc.expert), None)
        if peer is not None:
            self.table.penalise(peer, "bad_bytes")

    def close(self) -> None:
        self._stop.set()
        if self._prober is not None:
            self._prober.join(HEALTH_DEADLINE_S + 1)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


def attach_peers(sm, addresses: list[str], secret: str, node_id: str, tls_ca: bytes | None = None) -> PeerSource:
    """Put a peers tier for `addresses` between the disk and the Hub of a streamed model's store.

    Raises:
        EndpointUnreachableError: a listed peer does not answer (or refuses the secret).
    """
    from expertmesh.node.errors import EndpointUnreachableError

    table = PeerTable(self_id=node_id, self_weight=float(sm.disk.budget_bytes))
    for address in addresses:
        try:
            table.add(describe_peer(address, secret, tls_ca))
        except grpc.RpcError as e:
            raise EndpointUnreachableError(
                f"peer {address} did not answer Info ({e.code().name.lower()}): "
                "is it running, and is the household secret the same?"
            ) from None
    source = PeerSource(sm.index, table, secret, tls_ca=tls_ca)
    source.start_health_checks()
    hub_at = next(i for i, s in enumerate(sm.store.sources) if s.name == "hub")
    sm.store.sources.insert(hub_at, source)
    # idle-link fill keeps to the experts this node owns: the household holds each expert once
    sm.store.fill_filter = lambda key: table.ranked(expert_key(sm.index, *key))[0] is None
    return source
