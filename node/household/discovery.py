"""Finding the household's nodes with zeroconf (mDNS/DNS-SD), and telling them about this one.

Every node advertises `_expertmesh._tcp.local.` with its node id, cluster name, role, disk budget
and protocol version in the TXT record — never the secret. A browser follows the advertisements of
the same cluster into the peer table: added, updated (a new address or budget), removed. Another
node advertising our own id is a duplicate (a copied home folder, say): it is reported and ignored.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

from expertmesh.node.store.tiers.peers import Peer, PeerTable

logger = logging.getLogger(__name__)

SERVICE_TYPE = "_expertmesh._tcp.local."
DEFAULT_CLUSTER = "home"
RESOLVE_TIMEOUT_MS = 3000


@dataclass
class Advertisement:
    node_id: str
    cluster: str
    role: str
    port: int
    disk_budget_bytes: int
    protocol_version: int = 1
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


def _text(props: dict, key: str) -> str:
    value = props.get(key.encode()) or props.get(key)
    return value.decode() if isinstance(value, bytes) else (value or "")


class Discovery:
    """Advertise this node and keep `table` in step with the cluster's other advertisements.

    Args:
        interfaces: addresses to use (e.g. ["192.168.1.20"]); None: every interface.
    """

    def __init__(
        self,
        table: PeerTable,
        ad: Advertisement,
        address: str | None,
        interfaces: list[str] | None = None,
        advertise: bool = True,
    ):
        self.table = table
        self.ad = ad
        self.duplicates = 0
        self._zc = Zeroconf(interfaces=interfaces or ["0.0.0.0"], ip_version=IPVersion.V4Only)
        self._info = None
        if advertise:  # `expertmesh peers` only looks
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
        self._resolving: list[threading.Thread] = []
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, _Listener(self))

    def _resolve(self, name: str) -> None:
        info = self._zc.get_service_info(SERVICE_TYPE, name, timeout=RESOLVE_TIMEOUT_MS)
        if info is None or not info.parsed_addresses():
            return
        props = info.properties or {}
        node_id, cluster = _text(props, "node_id"), _text(props, "cluster")
        if cluster != self.ad.cluster or not node_id:
            return
        address = f"{info.parsed_addresses()[0]}:{info.port}"
        if node_id == self.ad.node_id:
            if self._info is not None and name != self._info.name:
                self.duplicates += 1
                logger.error(
                    "another node (%s) advertises this node's id %s: give one of them a fresh home", address, node_id
                )
            return
        try:
            weight = float(_text(props, "disk") or 0)
        except ValueError:
            weight = 0.0
        with self._lock:
            self._names[name] = node_id
        self.table.add(
            Peer(node_id, address, weight, _text(props, "role") or "full", compute=_text(props, "compute") == "1")
        )
        logger.info("peer %s at %s joined (%s)", node_id, address, _text(props, "role"))

    def _resolve_in_background(self, name: str) -> None:
        t = threading.Thread(target=self._resolve, args=(name,), daemon=True)
        with self._lock:
            self._resolving = [r for r in self._resolving if r.is_alive()] + [t]
        t.start()

    def settle(self) -> None:
        """Wait for the resolutions under way (bounded by their timeout)."""
        with self._lock:
            pending = list(self._resolving)
        for t in pending:
            t.join(RESOLVE_TIMEOUT_MS / 1000 + 1)

    def _gone(self, name: str) -> None:
        with self._lock:
            node_id = self._names.pop(name, None)
        if node_id is not None:
            self.table.remove(node_id)
            logger.info("peer %s left", node_id)

    def close(self) -> None:
        self._browser.cancel()
        if self._info is not None:
            self._zc.unregister_service(self._info)
        self._zc.close()


class _Listener(ServiceListener):
    def __init__(self, discovery: Discovery):
        self.d = discovery

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.d._resolve_in_background(name)  # resolving blocks: never in zeroconf's own thread

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.d._resolve_in_background(name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.d._gone(name)
