"""Finding the household's nodes with zeroconf (mDNS/DNS-SD), and telling them about this one.

Every node advertises `_expertmesh._tcp.local.` with its node id, cluster name, role, disk
budget, protocol version, metrics port and whether it computes experts for peers in the TXT
record — never the secret. One `Browser` follows those advertisements (resolving each off
zeroconf's own thread) and hands every change to a callback: `Discovery` keeps the peer table in
step with the cluster's nodes, observability/prometheus_targets.py keeps Prometheus' targets.
Another node advertising our own id is a duplicate (a copied home folder, say): it is reported
and ignored. TXT values come from the network: they are parsed defensively, never trusted, and an
advertisement is only a hint of where to look: `Discovery` joins a node once it has proven it
knows the household secret (rpc/proof.py), with the attributes of its proof.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from zeroconf import (
    DNSOutgoing,
    DNSQuestion,
    DNSQuestionType,
    EventLoopBlocked,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceListener,
    Zeroconf,
)
from zeroconf.const import _CLASS_IN, _FLAGS_QR_QUERY, _TYPE_PTR

from expertmesh.node import constants
from expertmesh.node.household.membership import Peer, PeerTable, prove_peer
from expertmesh.node.rpc.client import NodeClient
from expertmesh.node.rpc.proof import ROLES, ProofError, valid_node_id

logger = logging.getLogger(__name__)

SERVICE_TYPE = "_expertmesh._tcp.local."
DEFAULT_CLUSTER = "home"
RESOLVE_TIMEOUT_MS = 3000
RESOLVE_WORKERS = 4  # threads that resolve (and prove) advertisements, however many names arrive
# Every question goes out multicast-response (QM). python-zeroconf asks its first question QU
# (unicast response), but RFC 6762 section 15.1 warns that a unicast reply to port 5353 reaches
# only one of the sockets bound there: on a Mac that is mDNSResponder's, beside `serve` another
# node's, so the answer is lost and a short browse (`run --discovery-wait`) can miss a node.
QUESTION_TYPE = DNSQuestionType.QM
MAX_PENDING = 256  # names waiting for a worker; more are dropped (a flood of invented names)
RESOLVE_LIMIT_S = 10.0  # the longest `wait_resolved` waits
# After a goodbye for a member's name, the pauses before each check that it really left. mDNS
# goodbyes carry no proof (anyone on the LAN can send one for any name), so a member that still
# proves itself and says SERVING through all of them stays; a node that leaves stops its gRPC
# server within a second or two of its goodbye (assembly.py: discovery, then rpc).
GOODBYE_CHECKS_S = (0.5, 1.0, 2.0, 4.0)
_MAX_NOTED = 1024  # (name, address) pairs whose failure was logged, kept to log each once
_DIGITS = re.compile(r"[0-9]{1,20}")  # ASCII only: \d and str.isdigit() take other scripts' digits


@dataclass(frozen=True)
class Advertisement:
    node_id: str
    cluster: str
    role: str
    port: int
    disk_budget_bytes: int
    protocol_version: int = constants.PROTOCOL_VERSION
    metrics_port: int = 0  # where /metrics is served (0: not served); read by `expertmesh prometheus-targets`
    compute: bool = False  # answers ComputeExperts (a full node with MLX)

    def properties(self) -> dict[str, str]:
        props = {
            "node_id": self.node_id,
            "cluster": self.cluster,
            "role": self.role,
            "disk": str(self.disk_budget_bytes),
            "proto": str(self.protocol_version),
        }
        if self.metrics_port:
            props["metrics"] = str(self.metrics_port)
        if self.compute:
            props["compute"] = "1"
        return props


@dataclass(frozen=True)
class Sighting:
    """A resolved advertisement: where the node is and what it says of itself."""

    host: str
    ad: Advertisement

    @property
    def address(self) -> str:
        return f"{self.host}:{self.ad.port}"


def _text(props: dict, key: str) -> str:
    value = props.get(key.encode()) or props.get(key)
    try:
        return value.decode() if isinstance(value, bytes) else (value or "")
    except UnicodeDecodeError:
        return ""


def _number(props: dict, key: str, upper: int) -> int:
    """A TXT number: ASCII digits only (str.isdigit() also takes "²", which int() refuses), at most
    20 of them, below `upper`; 0 for anything else."""
    text = _text(props, key)
    return int(text) if _DIGITS.fullmatch(text) and int(text) < upper else 0


def parse_service(info: ServiceInfo) -> Sighting | None:
    """What an advertisement says, or None if it is not a usable expertmesh node (no address or
    port, a node id outside [A-Za-z0-9._-]{1,64}, an unknown role). Never raises on TXT values."""
    addresses = info.parsed_addresses()
    if not addresses or not info.port:
        return None
    props = info.properties or {}
    node_id = _text(props, "node_id")
    role = _text(props, "role") or "full"
    if not valid_node_id(node_id) or role not in ROLES:
        return None
    ad = Advertisement(
        node_id=node_id,
        cluster=_text(props, "cluster"),
        role=role,
        port=info.port,
        disk_budget_bytes=_number(props, "disk", 1 << 62),
        protocol_version=_number(props, "proto", 1 << 16),
        metrics_port=_number(props, "metrics", 65536),
        compute=_text(props, "compute") == "1",
    )
    return Sighting(addresses[0], ad)


class Browser:
    """Follow the advertisements of SERVICE_TYPE: `on_change(name, sighting)` for each one
    resolved (added or updated) and `on_change(name, None)` when one goes away.

    Resolving blocks (up to RESOLVE_TIMEOUT_MS), and so may `on_change` (Discovery proves the node
    there), so neither runs on zeroconf's thread: RESOLVE_WORKERS threads take names from a
    deduplicated queue of at most MAX_PENDING, and a flood of invented names costs dropped names,
    not threads. An exception in `on_change` or in parsing is logged; it never ends a worker.

    Args:
        interfaces: addresses to browse on (None: every interface).
        zc: a Zeroconf instance to share (e.g. the one advertising this node); made if None.
    """

    def __init__(
        self,
        on_change: Callable[[str, Sighting | None], None],
        interfaces: list[str] | None = None,
        zc: Zeroconf | None = None,
    ):
        self._on_change = on_change
        self._own_zc = zc is None
        self.zc = zc or Zeroconf(interfaces=interfaces or ["0.0.0.0"], ip_version=IPVersion.V4Only)
        self._cond = threading.Condition()
        self._pending: OrderedDict[str, None] = OrderedDict()  # names to resolve, oldest first
        self._busy = 0
        self.dropped = 0  # names not resolved because MAX_PENDING were waiting
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name="zeroconf-resolve", daemon=True) for _ in range(RESOLVE_WORKERS)
        ]
        for t in self._workers:
            t.start()
        try:
            self._browser = ServiceBrowser(self.zc, SERVICE_TYPE, _Listener(self), question_type=QUESTION_TYPE)
        except BaseException:
            self._stop_workers()
            raise

    def _resolve(self, name: str) -> None:
        info = self.zc.get_service_info(SERVICE_TYPE, name, timeout=RESOLVE_TIMEOUT_MS, question_type=QUESTION_TYPE)
        if info is None or self._closed:
            return
        sighting = parse_service(info)
        if sighting is not None:
            self._on_change(name, sighting)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait(1.0)
                if self._closed:
                    return
                name, _ = self._pending.popitem(last=False)
                self._busy += 1
            try:
                self._resolve(name)
            except EventLoopBlocked:  # zeroconf's own loop was too busy to answer (a flood, a loaded CPU)
                logger.warning(
                    "resolving the advertisement %r timed out in zeroconf; it is asked again when announced", name
                )
            except Exception:  # a hostile advertisement must not end the worker
                logger.exception("handling the advertisement %r failed", name)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _resolve_in_background(self, name: str) -> None:
        """Queue `name` for a worker (once, however often it is announced meanwhile)."""
        with self._cond:
            if self._closed or name in self._pending:
                return
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning("more than %d zeroconf names wait to be resolved: dropping the rest", MAX_PENDING)
                return
            self._pending[name] = None
            self._cond.notify()

    def _gone(self, name: str) -> None:
        with self._cond:
            self._pending.pop(name, None)
        if not self._closed:
            self._on_change(name, None)

    def wait_resolved(self) -> None:
        """Wait for the resolutions queued and under way (RESOLVE_LIMIT_S at most)."""
        deadline = time.monotonic() + RESOLVE_LIMIT_S
        with self._cond:
            while (self._pending or self._busy) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _stop_workers(self) -> None:
        """Workers end after what they are doing now (a resolve, a proof: both bounded in time)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()

    def close(self) -> None:
        self._stop_workers()
        self._browser.cancel()
        if self._own_zc:
            self.zc.close()


class _Listener(ServiceListener):
    def __init__(self, browser: Browser):
        self.b = browser

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.b._resolve_in_background(name)

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.b._resolve_in_background(name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.b._gone(name)


class Discovery:
    """Advertise this node (unless `address` is None) and keep `table` in step with the other
    advertisements of its cluster: added, updated (a new address or budget), removed.

    An advertisement only says where to look: the node there joins the table once it has proven it
    knows the household `secret` (membership.prove_peer), with the id, role, weight and compute flag
    of its proof. Without a secret nobody joins. A node id belongs to the service name whose node
    proved it first: another name claiming that id is reported and ignored, and only the owning
    name's removal removes the peer. A peer already in the table that no name owns (a `--peer`) is
    left as it is.

    Args:
        interfaces: addresses to use (e.g. ["192.168.1.20"]); None: every interface.
        secret: the household secret that discovered nodes must prove they know.
        tls_ca: the household CA, when the nodes serve TLS (rpc/tls.py).
    """

    def __init__(
        self,
        table: PeerTable,
        ad: Advertisement,
        address: str | None,
        interfaces: list[str] | None = None,
        secret: str | None = None,
        tls_ca: bytes | None = None,
    ):
        self.table = table
        self.ad = ad
        self.address = f"{address}:{ad.port}" if address is not None else None  # as advertised
        self.duplicates = 0  # other names advertising our own id
        self.claims = 0  # other names advertising the id of a peer another name owns
        self.unproven = 0  # advertisements whose node did not prove it knows the secret
        self._secret = secret
        self._tls_ca = tls_ca
        self._zc = Zeroconf(interfaces=interfaces or ["0.0.0.0"], ip_version=IPVersion.V4Only)
        self._info = None
        if address is not None:
            self._info = ServiceInfo(
                SERVICE_TYPE,
                f"{ad.node_id}.{SERVICE_TYPE}",
                port=ad.port,
                addresses=[socket.inet_aton(address)],
                properties=ad.properties(),
                server=f"expertmesh-{ad.node_id}.local.",
            )
            self._zc.register_service(self._info, allow_name_change=False)
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}  # service name -> the node id it proved
        self._owners: dict[str, str] = {}  # node id -> the service name that owns it
        self._proving: dict[str, object] = {}  # service name -> the proof under way for it
        self._leaving: set[str] = set()  # names whose goodbye is being checked
        self._stopping = threading.Event()
        self.forged_goodbyes = 0  # goodbyes for a member that went on proving itself
        self._noted: OrderedDict[tuple[str, str], None] = OrderedDict()  # failures logged once
        self.browser = Browser(self._changed, zc=self._zc)

    def _note_once(self, name: str, address: str, message: str, *args, level: int = logging.WARNING) -> None:
        """Log a refusal once per (name, address): a hostile advertiser cannot fill the log."""
        with self._lock:
            key = (name, address)
            if key in self._noted:
                return
            self._noted[key] = None
            if len(self._noted) > _MAX_NOTED:
                self._noted.popitem(last=False)
        logger.log(level, message, *args)

    def _holder(self, name: str, node_id: str) -> str | None:
        """Who holds `node_id` if not `name`: "name" (another advertisement owns it), "static" (the
        table has it from a --peer), or None. Under _lock. The name a node advertises itself under
        (`<node_id>.` + SERVICE_TYPE) may take its id back from another name, once it proves it: an
        advertisement pointing at a member's own address can then not hold the member hostage."""
        owner = self._owners.get(node_id)
        if owner is not None:
            own_name = f"{node_id}.{SERVICE_TYPE}".lower()
            return None if owner == name or (name.lower() == own_name != owner.lower()) else "name"
        return "static" if self.table.get(node_id) is not None else None

    def _changed(self, name: str, sighting: Sighting | None) -> None:
        if sighting is None:
            self._withdrawn(name)
            return
        ad = sighting.ad
        if ad.cluster != self.ad.cluster:
            return
        if ad.node_id == self.ad.node_id:
            if self._info is not None and name != self._info.name:
                self.duplicates += 1
                self._note_once(  # once per name and address: each re-announcement is resolved again
                    name,
                    sighting.address,
                    "another node (%s) advertises this node's id %s: give one of them a fresh home",
                    sighting.address,
                    ad.node_id,
                    level=logging.ERROR,
                )
            return
        token = object()
        with self._lock:
            holder = self._holder(name, ad.node_id)
            if holder is None:
                self._proving[name] = token
            elif holder == "name":
                self.claims += 1
        if holder == "static":
            logger.debug("peer %s is a --peer: its advertisement %r changes nothing", ad.node_id, name)
            return
        if holder == "name":
            self._note_once(
                name,
                sighting.address,
                "ignoring %r at %s: it claims the id of peer %s, which another advertisement holds",
                name,
                sighting.address,
                ad.node_id,
            )
            return
        peer = self._prove(name, sighting)
        with self._lock:
            if self._proving.get(name) is token:
                del self._proving[name]
            else:
                return  # withdrawn (or seen again) while it was being proven
            if peer is None or self._holder(name, peer.node_id) is not None:
                return
            old = self._names.get(name)
            if old is not None and old != peer.node_id and self._owners.get(old) == name:
                del self._owners[old]
                self.table.remove(old)
            previous = self._owners.get(peer.node_id)
            if previous is not None and previous != name:
                self._names.pop(previous, None)  # the member's own name took its id back
            self._names[name] = peer.node_id
            self._owners[peer.node_id] = name
            self.table.add(peer)
        logger.info("peer %s at %s joined (%s)", peer.node_id, peer.address, peer.role)

    def _prove(self, name: str, sighting: Sighting) -> Peer | None:
        """The advertised node as it proves itself, or None (logged once per name and address)."""
        address = sighting.address
        if self._secret is None:
            self._note_once(name, address, "not joining %r at %s: this node has no household secret", name, address)
            return None
        try:
            peer = prove_peer(address, self._secret, self._tls_ca)
        except ProofError:
            why = "its proof does not check with the household secret"
        except grpc.RpcError as e:
            why = f"it did not answer Prove ({e.code().name.lower()})"
        else:
            if peer.node_id == sighting.ad.node_id:
                return peer
            why = f"it proved another id ({peer.node_id})"
        self.unproven += 1
        self._note_once(
            name, address, "not joining %r at %s (advertised as %s): %s", name, address, sighting.ad.node_id, why
        )
        return None

    def _withdrawn(self, name: str) -> None:
        """A goodbye (or an expired record) for `name`: its peer leaves the table once a check
        finds it gone (`_confirm_leaving`, on a thread of its own: zeroconf's must not wait)."""
        with self._lock:
            self._proving.pop(name, None)
            node_id = self._names.get(name)
            if node_id is None or self._owners.get(node_id) != name:
                self._names.pop(name, None)
                return
            peer = self.table.get(node_id)
            if peer is None or self._secret is None:
                self._forget(name, node_id, None)
                return
            if name in self._leaving or self._stopping.is_set():
                return
            self._leaving.add(name)
        threading.Thread(
            target=self._confirm_leaving,
            args=(name, node_id, peer.address, self._secret),
            name="zeroconf-goodbye",
            daemon=True,
        ).start()

    def _confirm_leaving(self, name: str, node_id: str, address: str, secret: str) -> None:
        """Remove the peer as soon as it stops proving itself or serving; keep it if it never does
        within GOODBYE_CHECKS_S (a forged goodbye)."""
        try:
            for pause_s in GOODBYE_CHECKS_S:
                if self._stopping.wait(pause_s):
                    return
                if not self._still_here(address, node_id, secret):
                    with self._lock:
                        self._forget(name, node_id, address)
                    return
            self.forged_goodbyes += 1
            self._ask_for_advertisements()
            self._note_once(
                name,
                address,
                "a goodbye for peer %s arrived, but it still proves itself at %s: kept (a forged goodbye?)",
                node_id,
                address,
            )
        finally:
            with self._lock:
                self._leaving.discard(name)

    def _ask_for_advertisements(self) -> None:
        """Ask the LAN who offers SERVICE_TYPE: the goodbye took the member's record out of
        zeroconf's cache, and without it being seen again its real leaving later would go unseen."""
        out = DNSOutgoing(_FLAGS_QR_QUERY)
        out.add_question(DNSQuestion(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN))
        try:
            self._zc.send(out)
        except Exception as e:  # noqa: BLE001 - zeroconf closing meanwhile: nothing to ask for
            logger.debug("asking for advertisements failed: %s", e)

    def _still_here(self, address: str, node_id: str, secret: str) -> bool:
        try:
            peer = prove_peer(address, secret, self._tls_ca)
            if peer.node_id != node_id:
                return False
            with NodeClient(address, secret, self._tls_ca) as client:
                return client.serving()  # NOT_SERVING: a node in its graceful shutdown
        except (ProofError, grpc.RpcError):
            return False

    def _forget(self, name: str, node_id: str, address: str | None) -> None:
        """Under _lock: `name` and its peer leave, if `name` still owns it (and, given `address`,
        the peer is still there: one that came back elsewhere meanwhile is not removed)."""
        if self._names.get(name) != node_id or self._owners.get(node_id) != name:
            return
        peer = self.table.get(node_id)
        if address is not None and peer is not None and peer.address != address:
            return
        del self._names[name]
        del self._owners[node_id]
        self.table.remove(node_id)
        logger.info("peer %s left", node_id)

    def wait_resolved(self) -> None:
        self.browser.wait_resolved()

    def close(self) -> None:
        self._stopping.set()
        self.browser.close()
        if self._info is not None:
            self._zc.unregister_service(self._info)
        self._zc.close()
