"""The peers tier: experts from other Macs of the household, between the disk and the Hub.

A miss goes to the expert's owner first (household/membership.py), who fetches it from the Hub
if it lacks it, keeps it and serves it, so each expert crosses the internet once per household;
if this node is the owner, the store goes to the Hub itself. After the owner, only peers whose
inventories list the expert are asked. Everything a peer sends is checked (size, its digest, and
then the store's recorded digest): a peer that errs, times out or lies is skipped for a while
and counted by reason. Each peer's gRPC health is checked in the background, so a peer that
comes back is used again at once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from expertmesh.node.household.membership import Peer, PeerTable, expert_key
from expertmesh.node.hub.expert_index import ExpertIndex, ExpertLocation
from expertmesh.node.rpc.client import INFO_DEADLINE_S, NodeClient, model_key
from expertmesh.node.store.buffers import shared_pool

logger = logging.getLogger(__name__)

FETCH_DEADLINE_S = 30.0  # for one expert from one peer, the owner's Hub fetch included
INVENTORY_TTL_S = 30.0  # how long a peer's inventory is trusted before it is asked again
HEALTH_EVERY_S = 10.0  # every peer's gRPC health is checked this often
HEALTH_DEADLINE_S = 2.0


class PeerSource:
    """A tier over the household: the owner first, then the other live peers that hold the expert."""

    source = "peer"
    local = False
    household = True

    def __init__(
        self,
        index: ExpertIndex,
        table: PeerTable,
        secret: str,
        deadline_s: float = FETCH_DEADLINE_S,
        tls_ca: bytes | None = None,
    ):
        self.index = index
        self.table = table
        self.secret = secret
        self.tls_ca = tls_ca
        self.deadline_s = deadline_s
        self._model = model_key(index.repo_id, index.commit)
        self._clients: dict[str, NodeClient] = {}
        self._last_server: dict[tuple[int, int], Peer] = {}
        self._inventories: dict[str, tuple[float, set[tuple[int, int]]]] = {}  # node id -> (when, held keys)
        self._lock = threading.Lock()
        # called as transfer_observer(peer, nbytes, seconds) after each expert that came from a
        # peer: how remote execution measures each peer's bandwidth
        self.transfer_observer = None
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    def client(self, address: str) -> NodeClient:
        """The kept-open client of the node at `address`."""
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = NodeClient(address, self.secret, self.tls_ca)
            return client

    # -- inventories --------------------------------------------------------------------------

    def inventory(self, peer: Peer, timeout: float = INFO_DEADLINE_S) -> set[tuple[int, int]] | None:
        """The keys `peer` holds, as its inventory said at most INVENTORY_TTL_S ago (asked again
        when older); None when it cannot be had."""
        now = time.monotonic()
        with self._lock:
            known = self._inventories.get(peer.node_id)
        if known is None or now - known[0] > INVENTORY_TTL_S:
            try:
                held = self.client(peer.address).inventory(self._model, timeout=min(timeout, INFO_DEADLINE_S))
            except grpc.RpcError:
                return None
            known = (now, held)
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

    # -- the tier -----------------------------------------------------------------------------

    def fetch(self, loc: ExpertLocation, abandon=None) -> bytearray | None:
        """The expert from the household, or None: the caller goes to the Hub (this node owns it, or
        no peer could serve it in time)."""
        ranked = self.table.ranked(expert_key(self.index, loc.layer, loc.expert))
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

    def _fetch_from(self, peer: Peer, loc: ExpertLocation, owner: bool, timeout: float) -> memoryview | None:
        t0 = time.perf_counter()
        blob = shared_pool().lend(loc.nbytes)  # the chunks land in place: no join, no fresh pages
        try:
            size, digest, received = None, None, 0
            for chunk in self.client(peer.address).fetch_expert(
                self._model, loc.layer, loc.expert, timeout, fetch_on_miss=owner
            ):
                if size is None:
                    size, digest = chunk.size, chunk.sha256
                if received + len(chunk.data) > loc.nbytes:
                    self.table.penalise(peer, "oversized")
                    return None
                blob[received : received + len(chunk.data)] = chunk.data
                received += len(chunk.data)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND and not owner:
                return None  # an honest miss
            self.table.penalise(peer, e.code().name.lower())
            return None
        if size != loc.nbytes or received != loc.nbytes:
            self.table.penalise(peer, "wrong_size")
            return None
        if hashlib.sha256(blob).hexdigest() != digest:
            self.table.penalise(peer, "bad_digest")
            return None
        if self.transfer_observer is not None:
            self.transfer_observer(peer, len(blob), time.perf_counter() - t0)
        return blob

    def discard(self, loc: ExpertLocation) -> None:
        """The store found these bytes disagree with the digest it recorded: the peer lied."""
        peer = self._last_server.pop((loc.layer, loc.expert), None)
        if peer is not None:
            self.table.penalise(peer, "bad_bytes")

    # -- health -------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Ask every known peer's standard health service once: one that is not SERVING (or does
        not answer in HEALTH_DEADLINE_S) is skipped, and a skipped one that is SERVING again is
        used again at once; a compute peer's inventory is refreshed here when stale, so remote
        execution's placement reads it without a call. Generation never waits for this."""
        for peer in self.table.all():
            try:
                status = self.client(peer.address).health(HEALTH_DEADLINE_S)
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

    def close(self) -> None:
        self._stop.set()
        if self._prober is not None:
            self._prober.join(HEALTH_DEADLINE_S + 1)
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
