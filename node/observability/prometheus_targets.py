"""Prometheus' file-based service discovery, kept in step with the nodes zeroconf finds.

Every node that serves `/metrics` advertises its port as the `metrics` TXT property (never the
secret). This module follows the advertisements of one cluster (household/discovery.py's
Browser) and rewrites a `file_sd` JSON file whenever a node comes, moves or goes; Prometheus
re-reads the file by itself. The file is written to a temporary name and renamed, so Prometheus
never reads half of it.

Target labels are named `node_id`, `node_role` and `node_cluster` (TARGET_LABELS), never a name a
metric of ours uses: when a target label and a scraped label share a name, Prometheus keeps the
target's and renames the metric's to `exported_<name>`, so `expertmesh_peers{role}` (the roles of
the peers a node sees) would show the scraping node's own role instead. `honor_labels: true` would
fix that the other way round, but then a metric label could overwrite the target's identity;
distinct names keep both. tests/test_metrics.py checks the two sets stay disjoint.

An advertisement is anyone's to make, so given the household secret the watcher lists a node only
once it proves it knows the secret (rpc/proof.py, as household/discovery.py joins peers), with the
id and role of its proof: a stranger on the LAN cannot add scrape targets or pose as a member in
the dashboards. Without a secret the advertisements are taken as they are (and the CLI says so).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import grpc

from expertmesh.node.household.discovery import Browser, Sighting
from expertmesh.node.household.membership import Peer, prove_peer
from expertmesh.node.rpc.proof import ProofError

logger = logging.getLogger(__name__)

# The labels each target gets, besides Prometheus' own `job` and `instance`; disjoint from every
# label of observability/metrics.py and coordinator/api_metrics.py (METRIC_LABELS there).
TARGET_LABELS = ("node_id", "node_role", "node_cluster")
_MAX_NOTED = 1024  # (name, address) pairs whose refusal was logged


@dataclass(frozen=True)
class MetricsTarget:
    address: str  # host:metrics-port
    node_id: str
    role: str
    cluster: str


def targets_document(targets: list[MetricsTarget]) -> list[dict]:
    """The `file_sd` JSON of `targets`: one group per node, labelled with its id, role and cluster."""
    return [
        {"targets": [t.address], "labels": dict(zip(TARGET_LABELS, (t.node_id, t.role, t.cluster)))}
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
    """Follow a cluster's nodes and rewrite `path` whenever their metrics targets change.

    Args:
        interfaces: addresses to browse on (None: every interface).
        secret: the household secret: only nodes that prove they know it are listed.
        tls_ca: the household CA, when the nodes serve TLS (rpc/tls.py).
    """

    def __init__(
        self,
        path: Path,
        cluster: str,
        interfaces: list[str] | None = None,
        secret: str | None = None,
        tls_ca: bytes | None = None,
    ):
        self.path = path
        self.cluster = cluster
        self._secret = secret
        self._tls_ca = tls_ca
        self.unproven = 0  # advertisements whose node did not prove it knows the secret
        self._noted: OrderedDict[tuple[str, str], None] = OrderedDict()  # refusals logged once
        self._targets: dict[str, MetricsTarget] = {}  # service name -> target
        self._lock = threading.Lock()
        self.changed = threading.Event()  # set after each rewrite (tests, `--once`)
        write_targets(path, [])
        self._browser = Browser(self._seen, interfaces)

    def targets(self) -> list[MetricsTarget]:
        with self._lock:
            return list(self._targets.values())

    def _seen(self, name: str, sighting: Sighting | None) -> None:
        target = None
        if sighting is not None and sighting.ad.cluster == self.cluster and sighting.ad.metrics_port:
            ad = sighting.ad
            who: tuple[str, str] | None = (ad.node_id, ad.role)
            if self._secret is not None:
                proven = self._proven(name, sighting, self._secret)
                who = (proven.node_id, proven.role) if proven is not None else None
            if who is not None:
                target = MetricsTarget(f"{sighting.host}:{ad.metrics_port}", *who, self.cluster)
        self._set(name, target)  # None: gone, another cluster, unproven, or a node that serves no metrics

    def _proven(self, name: str, sighting: Sighting, secret: str) -> Peer | None:
        """The advertised node as it proves itself at its gRPC address, or None (logged)."""
        try:
            peer = prove_peer(sighting.address, secret, self._tls_ca)
        except (ProofError, grpc.RpcError) as e:
            why = "its proof does not check" if isinstance(e, ProofError) else "it did not answer Prove"
        else:
            if peer.node_id == sighting.ad.node_id:
                return peer
            why = f"it proved another id ({peer.node_id})"
        self.unproven += 1
        with self._lock:
            first = (name, sighting.address) not in self._noted
            self._noted[(name, sighting.address)] = None
            if len(self._noted) > _MAX_NOTED:
                self._noted.popitem(last=False)
        if first:  # once per name and address: a hostile advertiser cannot fill the log
            logger.warning("not listing %r at %s: %s", name, sighting.address, why)
        return None

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
        self._browser.close()
