"""Who is in the household and who owns which expert, computed the same way on every node.

Each expert has an owner: the live node with the highest weighted rendezvous score for the
expert's key (weight = the node's disk budget), so ownership spreads in proportion to disk and
moves little when a node comes or goes. There is no central directory: every node computes the
owner from its own peer table, which zeroconf (household/discovery.py), `--peer` addresses and
gRPC health checks keep in step. A peer that errs is skipped for a while and counted by reason.
A node enters the table only once it has proven it knows the household secret (`prove_peer`),
with the attributes it signed: an advertisement alone is never enough.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from expertmesh.node import constants
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.rpc.client import NodeClient
from expertmesh.node.rpc.proof import PROVE_DEADLINE_S, ProofError, prove

logger = logging.getLogger(__name__)

SKIP_AFTER_ERROR_S = 30.0
# a peer whose copy of an expert two agreeing Hub copies contradicted is not asked for experts, nor
# to compute them, for this long (its owner's `expertmesh verify` repairs it meanwhile); after it,
# its copies are audited afresh (store/peer_audit.py)
DISTRUST_S = 3600.0


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


def expert_key(index: ExpertIndex, layer: int, expert: int) -> str:
    """The name an expert is hashed by: the same on every node of the household."""
    return f"{index.repo_id}@{index.commit}/{layer}/{expert}"


@dataclass
class PeerTable:
    """The peers this node knows: from `--peer` addresses and from zeroconf."""

    self_id: str
    self_weight: float
    peers: dict[str, Peer] = field(default_factory=dict)
    errors: Counter = field(default_factory=Counter)  # reason -> count
    version: int = 0  # bumped when a member comes, goes or changes its weight: ownership moved
    # node id -> until when (monotonic) it is not trusted for content: kept apart from the Peer,
    # which a new advertisement replaces
    distrusted: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, peer: Peer) -> None:
        with self._lock:
            if peer.node_id == self.self_id:
                return  # our own advertisement
            old = self.peers.get(peer.node_id)
            if old is None or old.weight != peer.weight:
                self.version += 1
            peer.skip_until = max(peer.skip_until, self.distrusted.get(peer.node_id, 0.0))
            self.peers[peer.node_id] = peer

    def get(self, node_id: str) -> Peer | None:
        with self._lock:
            return self.peers.get(node_id)

    def remove(self, node_id: str) -> None:
        with self._lock:
            if self.peers.pop(node_id, None) is not None:
                self.version += 1

    def all(self) -> list[Peer]:
        with self._lock:
            return list(self.peers.values())

    def live_count(self) -> int:
        with self._lock:
            return sum(p.live for p in self.peers.values())

    def compute_peers(self) -> list[Peer]:
        """Live peers that answer ComputeExperts."""
        with self._lock:
            return [p for p in self.peers.values() if p.compute and p.live]

    def full_addresses(self) -> list[str]:
        """Addresses of the live full nodes: where the coordinator may send generations."""
        with self._lock:
            return [p.address for p in self.peers.values() if p.role == "full" and p.live]

    def restore(self, peer: Peer) -> None:
        """A skipped peer answered its health check: use it again now, not when its skip ends
        (unless it is distrusted: a healthy peer that sends wrong bytes is still not asked)."""
        with self._lock:
            peer.skip_until = self.distrusted.get(peer.node_id, 0.0)

    def penalise(self, peer: Peer, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1
            peer.skip_until = max(time.monotonic() + SKIP_AFTER_ERROR_S, self.distrusted.get(peer.node_id, 0.0))
        logger.warning(
            "peer %s (%s): %s; skipping it for %.0f s", peer.node_id, peer.address, reason, SKIP_AFTER_ERROR_S
        )

    def distrust(self, peer: Peer, seconds: float = DISTRUST_S) -> None:
        """`peer` sent an expert's copy that two agreeing Hub copies contradict: skip it for
        everything (fetches, remote compute, generations) for `seconds`, re-advertised or not."""
        with self._lock:
            now = time.monotonic()
            until = now + seconds
            if self.distrusted.get(peer.node_id, 0.0) <= now:  # one count for copies shown wrong together
                self.errors["lied"] += 1
            self.distrusted[peer.node_id] = until
            peer.skip_until = max(peer.skip_until, until)
        logger.warning(
            "peer %s (%s) sent a wrong copy of an expert: not asking it for %.0f s", peer.node_id, peer.address, seconds
        )

    def ranked(self, key: str) -> list[Peer | None]:
        """Live peers by rendezvous score for `key`, best first; None stands for this node."""
        with self._lock:
            entries: list[tuple[float, Peer | None]] = [
                (rendezvous_score(key, p.node_id, p.weight), p) for p in self.peers.values() if p.live
            ]
        entries.append((rendezvous_score(key, self.self_id, self.self_weight), None))
        return [p for _, p in sorted(entries, key=lambda e: e[0], reverse=True)]

    def owns(self, key: str) -> bool:
        """Whether this node is the owner of the expert named `key` among the live nodes."""
        return self.ranked(key)[0] is None

    def keeps(self, key: str) -> bool:
        """Whether this node owns `key` among all members, briefly skipped ones included: what
        its disk keeps longest. A peer skipped for a few seconds after an error still owns its
        experts, so one timeout does not make every node re-sort its disk."""
        mine = rendezvous_score(key, self.self_id, self.self_weight)
        with self._lock:
            return all(rendezvous_score(key, p.node_id, p.weight) < mine for p in self.peers.values())


@dataclass
class ExpertOwnership:
    """Which experts of one model this node owns, as the disk tier asks it (store/tiers/disk.py)."""

    table: PeerTable
    index: ExpertIndex

    @property
    def version(self) -> int:
        return self.table.version

    def owns(self, key: tuple[int, int]) -> bool:
        return self.table.keeps(expert_key(self.index, *key))


def prove_peer(address: str, secret: str, tls_ca: bytes | None = None, timeout: float = PROVE_DEADLINE_S) -> Peer:
    """The node at `address` as it proves itself (rpc/proof.py): only a node that knows the
    household secret gets into a table, and with the id, role, weight and compute flag it signed.
    No call to it carries the secret before this returns.

    Raises:
        ProofError: no valid proof (another secret, a forgery, a relay), or an unusable address.
        grpc.RpcError: it did not answer Prove (down, not a node, or it refused the address).
    """
    with NodeClient(address, secret, tls_ca) as client:
        identity = prove(client, secret, timeout)
    if identity.protocol_version != constants.PROTOCOL_VERSION:  # its calls and ours would be refused
        raise ProofError(
            f"the node at {address} ({identity.node_id}) speaks protocol {identity.protocol_version} and this one "
            f"{constants.PROTOCOL_VERSION}: run the same expertmesh release on every Mac of the household"
        )
    return Peer(identity.node_id, address, float(identity.disk_budget_bytes), identity.role, compute=identity.compute)


def describe_peer(address: str, secret: str, tls_ca: bytes | None = None) -> Peer:
    """Who the node at `address` is (for a static `--peer`), proven as `prove_peer` proves it."""
    return prove_peer(address, secret, tls_ca)
