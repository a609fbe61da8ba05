"""Finding the household's nodes with zeroconf (mDNS/DNS-SD), and telling them about this one.

Every node advertises `_expertmesh._tcp.local.` with its node id, cluster name, role, disk
budget, protocol version, metrics port and whether it computes experts for peers in the TXT
record — never the secret. One `Browser` follows those advertisements (resolving each off
zeroconf's own thread) and hands every change to a callback: `Discovery` keeps the peer table in
step with the cluster's nodes, observability/prometheus_targets.py keeps Prometheus' targets.
Another node advertising our own id is a duplicate (a copied home folder, say): it is reported
and ignored. TXT values come from the network: they are parsed defensively, never trusted.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

from expertmesh.node import constants
from expertmesh.node.household.membership import Peer, PeerTable

logger = logging.getLogger(__name__)

SERVICE_TYPE = "_expertmesh._tcp.local."
DEFAULT_CLUSTER = "home"
RESOLVE_TIMEOUT_MS = 3000


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
    text = _text(props, key)
    return int(text) if text.isdigit() and int(text) < upper else 0


def parse_service(info: ServiceInfo) -> Sighting | None:
    """What an advertisement says, or None if it is not a usable expertmesh node."""
    addresses = info.parsed_addresses()
    if not addresses or not info.port:
        return None
    props = info.properties or {}
    node_id = _text(props, "node_id")
    if not node_id:
        return None
    ad = Advertisement(
        node_id=node_id,
        cluster=_text(props, "cluster"),
        role=_text(props, "role") or "full",
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
        self._lock = threading.Lock()
        self._resolving: list[threading.Thread] = []
        self._closed = False
        self._browser = ServiceBrowser(self.zc, SERVICE_TYPE, _Listener(self))

    def _resolve(self, name: str) -> None:
        info = self.zc.get_service_info(SERVICE_TYPE, name, timeout=RESOLVE_TIMEOUT_MS)
        if info is None or self._closed:
            return
        sighting = parse_service(info)
        if sighting is not None:
            self._on_change(name, sighting)

    def _resolve_in_background(self, name: str) -> None:
        """Resolving blocks: never in zeroconf's own thread."""
        t = threading.Thread(target=self._resolve, args=(name,), name="zeroconf-resolve", daemon=True)
        with self._lock:
            self._resolving = [r for r in self._resolving if r.is_alive()] + [t]
        t.start()

    def _gone(self, name: str) -> None:
        if not self._closed:
            self._on_change(name, None)

    def settle(self) -> None:
        """Wait for the resolutions under way (bounded by their timeout)."""
        with self._lock:
            pending = list(self._resolving)
        for t in pending:
            t.join(RESOLVE_TIMEOUT_MS / 1000 + 1)

    def close(self) -> None:
        self._closed = True
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

    Args:
        interfaces: addresses to use (e.g. ["192.168.1.20"]); None: every interface.
    """

    def __init__(self, table: PeerTable, ad: Advertisement, address: str | None, interfaces: list[str] | None = None):
        self.table = table
        self.ad = ad
        self.address = f"{address}:{ad.port}" if address is not None else None  # as advertised
        self.duplicates = 0
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
        self._names: dict[str, str] = {}  # service name -> node id
        self._lock = threading.Lock()
        self.browser = Browser(self._changed, zc=self._zc)

    def _changed(self, name: str, sighting: Sighting | None) -> None:
        if sighting is None:
            with self._lock:
                node_id = self._names.pop(name, None)
            if node_id is not None:
                self.table.remove(node_id)
                logger.info("peer %s left", node_id)
            return
        ad = sighting.ad
        if ad.cluster != self.ad.cluster:
            return
        if ad.node_id == self.ad.node_id:
            if self._info is not None and name != self._info.name:
                self.duplicates += 1
                logger.error(
                    "another node (%s) advertises this node's id %s: give one of them a fresh home",
                    sighting.address,
                    ad.node_id,
                )
            return
        with self._lock:
            self._names[name] = ad.node_id
        self.table.add(Peer(ad.node_id, sighting.address, float(ad.disk_budget_bytes), ad.role, compute=ad.compute))
        logger.info("peer %s at %s joined (%s)", ad.node_id, sighting.address, ad.role)

    def settle(self) -> None:
        self.browser.settle()

    def close(self) -> None:
        self.browser.close()
        if self._info is not None:
            self._zc.unregister_service(self._info)
        self._zc.close()
