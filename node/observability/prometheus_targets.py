"""Prometheus' file-based service discovery, kept in step with the nodes zeroconf finds.

Every node that serves `/metrics` advertises its port as the `metrics` TXT property (never the
secret). This module browses the advertisements of one cluster and rewrites a `file_sd` JSON file
whenever a node comes, moves or goes; Prometheus re-reads the file by itself. The file is written
to a temporary name and renamed, so Prometheus never reads half of it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from zeroconf import IPVersion, ServiceBrowser, ServiceListener, Zeroconf

from expertmesh.node.household.discovery import RESOLVE_TIMEOUT_MS, SERVICE_TYPE, _text

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricsTarget:
    address: str  # host:metrics-port
    node_id: str
    role: str
    cluster: str


def targets_document(targets: list[MetricsTarget]) -> list[dict]:
    """The `file_sd` JSON of `targets`: one group per node, labelled with its id, role and cluster."""
    return [
        {"targets": [t.address], "labels": {"node_id": t.node_id, "role": t.role, "cluster": t.cluster}}
        for t in sorted(targets, key=lambda t: t.address)
    ]


def write_targets(path: Path, targets: list[MetricsTarget]) -> None:
    """Replace `path` atomically with the `file_sd` JSON of `targets`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(targets_document(targets), indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class TargetsWatcher:
    """Browse a cluster's nodes and rewrite `path` whenever their metrics targets change.

    Args:
        interfaces: addresses to browse on (None: every interface).
    """

    def __init__(self, path: Path, cluster: str, interfaces: list[str] | None = None):
        self.path = path
        self.cluster = cluster
        self._targets: dict[str, MetricsTarget] = {}  # service name -> target
        self._lock = threading.Lock()
        self.changed = threading.Event()  # set after each rewrite (tests, `--once`)
        write_targets(path, [])
        self._zc = Zeroconf(interfaces=interfaces or ["0.0.0.0"], ip_version=IPVersion.V4Only)
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, _Listener(self))

    def targets(self) -> list[MetricsTarget]:
        with self._lock:
            return list(self._targets.values())

    def _resolve(self, name: str) -> None:
        info = self._zc.get_service_info(SERVICE_TYPE, name, timeout=RESOLVE_TIMEOUT_MS)
        if info is None or not info.parsed_addresses():
            return
        props = info.properties or {}
        port = _text(props, "metrics")
        if _text(props, "cluster") != self.cluster or not port.isdigit() or not 0 < int(port) < 65536:
            self._set(name, None)  # another cluster, or a node that serves no metrics
            return
        target = MetricsTarget(
            f"{info.parsed_addresses()[0]}:{port}",
            _text(props, "node_id"),
            _text(props, "role") or "full",
            self.cluster,
        )
        self._set(name, target)

    def _set(self, name: str, target: MetricsTarget | None) -> None:
        with self._lock:
            if self._targets.get(name) == target:
                return
            if target is None:
                self._targets.pop(name, None)
            else:
                self._targets[name] = target
            targets = list(self._targets.values())
            write_targets(self.path, targets)  # under the lock: writes never interleave
        logger.info("%s: %d metrics targets", self.path, len(targets))
        self.changed.set()

    def close(self) -> None:
        self._browser.cancel()
        self._zc.close()


class _Listener(ServiceListener):
    def __init__(self, watcher: TargetsWatcher):
        self.w = watcher

    def _resolve_in_background(self, name: str) -> None:
        threading.Thread(target=self.w._resolve, args=(name,), daemon=True).start()  # never in zeroconf's thread

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self._resolve_in_background(name)

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self._resolve_in_background(name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.w._set(name, None)
