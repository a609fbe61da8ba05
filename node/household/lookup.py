"""Finding a household's nodes for a command that is not a node itself (`peers`, `status`,
`warm`, `run` and `chat` that join a household): browse zeroconf for a while, then ask each
node found who it is.

A node stays in the background as long as it runs (household/discovery.py's Browser, kept by the
node); a command looks once, for a bounded time, and decides from what it saw. An advertisement
is a hint, never a credential: a node is used only once it has proven it knows the household
secret (rpc/proof.py, through `ask_info`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from expertmesh.node.household.discovery import Browser, Sighting
from expertmesh.node.household.membership import Peer, PeerTable
from expertmesh.node.rpc.auth import refused
from expertmesh.node.rpc.client import ask_info


def browse(table: PeerTable, cluster: str, interface: str | None, seconds: float, enough: int | None = None) -> None:
    """Add to `table` the nodes of `cluster` that advertise within `seconds`; with `enough`, stop
    as soon as the table holds that many.

    Raises:
        OSError: zeroconf cannot browse on this machine (no multicast, the interface is gone).
    """
    done = threading.Event()

    def seen(name: str, sighting: Sighting | None) -> None:
        if sighting is not None and sighting.ad.cluster == cluster:
            ad = sighting.ad
            table.add(Peer(ad.node_id, sighting.address, float(ad.disk_budget_bytes), ad.role, compute=ad.compute))
            if enough is not None and len(table.all()) >= enough:
                done.set()

    browser = Browser(seen, [interface] if interface else None)
    try:
        done.wait(seconds)
        browser.wait_resolved()
    finally:
        browser.close()


@dataclass
class ServingNodes:
    """The nodes of a cluster that proved the secret and serve a model, and why others were skipped."""

    addresses: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (address, why), for the user


def nodes_serving(
    repo_id: str,
    cluster: str,
    interface: str | None,
    seconds: float,
    secret: str,
    tls_ca: bytes | None = None,
    own_id: str = "expertmesh-cli",
    exclude: tuple[str, ...] = (),
) -> ServingNodes:
    """Addresses of the nodes of `cluster` that zeroconf finds within `seconds`, that answer Info
    with `secret`, and that serve `repo_id`. `own_id`: this home's node id (its own `serve` is this
    machine, not a peer); `exclude`: addresses the caller knows already.

    Raises:
        OSError: zeroconf cannot browse (see `browse`).
    """
    table = PeerTable(self_id=own_id, self_weight=0.0)
    browse(table, cluster, interface, seconds)
    found = ServingNodes()
    for answer in ask_info(sorted(p.address for p in table.all() if p.address not in exclude), secret, tls_ca):
        if answer.info is None:
            why = "refused the household secret" if refused(answer.error) else f"did not answer ({answer.error})"
            found.skipped.append((answer.address, why))
        elif not any(m.repo_id == repo_id for m in answer.info.models):
            found.skipped.append((answer.address, "serves another model"))
        else:
            found.addresses.append(answer.address)
    return found
