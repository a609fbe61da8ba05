"""The cost model's placement at K3's proportions, on stand-ins for the store and the peers (no
gRPC, no MLX): what the household lab showed the plan must take into account."""

from __future__ import annotations

import time
from types import SimpleNamespace

from expertmesh.node.config import RemoteConfig
from expertmesh.node.constants import K3_EXPERT_BYTES
from expertmesh.node.household.membership import Peer, PeerTable
from expertmesh.node.household.remote_experts import LinkEstimate, RemoteExperts
from expertmesh.node.store.stats import StoreStats

GIGABIT = 118e6
ROW_BYTES = 3584 * 4


class _Index:
    repo_id = "expertmesh/k3-lab"
    commit = "0" * 40

    def expert(self, layer: int, expert: int):
        return SimpleNamespace(nbytes=K3_EXPERT_BYTES)


def _remote(held: dict[str, set], service_s: float) -> RemoteExperts:
    """A generating node that holds nothing, and compute peers holding `held`, links measured."""
    table = PeerTable(self_id="me", self_weight=0.0)  # owns nothing: every expert's owner is a peer
    for node_id in held:
        table.add(Peer(node_id, f"{node_id}:1", 1.0, compute=True))
    peers = SimpleNamespace(
        table=table,
        known_inventory=lambda p: held[p.node_id],
        inventory=lambda p: held[p.node_id],
        client=lambda address: None,
    )
    store = SimpleNamespace(index=_Index(), ram=set(), fetch_workers=4, stats=StoreStats())
    remote = RemoteExperts(store, peers, set(), RemoteConfig(lan_bandwidth=GIGABIT))
    for node_id in held:  # measured already: no ping
        remote.links[node_id] = LinkEstimate(
            measured_bandwidth=GIGABIT, service_s=service_s, call_s=1e-3, pinged_at=time.monotonic()
        )
    return remote


def test_experts_fetched_from_several_peers_share_this_nodes_nic() -> None:
    # six experts, two on each of three peers; a peer computes one in 0.5 s, fetching one takes
    # 0.15 s: three peers sending at once would seem to take 0.3 s, but they share one gigabit port
    held = {f"p{i}": {(1, 2 * i), (1, 2 * i + 1)} for i in range(3)}
    remote = _remote(held, service_s=0.5)
    placement = remote.plan(1, list(range(6)), dict.fromkeys(range(6), ROW_BYTES))
    transfer_s = K3_EXPERT_BYTES / GIGABIT
    fetched = 6 - len(placement.remote)
    assert placement.remote, "fetching all six over one NIC (0.9 s) is slower than computing one on a peer"
    assert placement.estimate_s["nic"] >= fetched * transfer_s - 1e-9  # the NIC carries them one after another
    assert max(placement.estimate_s.values()) < 6 * transfer_s  # and the plan is better than fetching all


def test_a_fast_peer_computes_what_it_holds() -> None:
    held = {"p0": {(1, 0), (1, 1)}, "p1": {(1, 2), (1, 3)}}
    remote = _remote(held, service_s=0.01)
    placement = remote.plan(1, [0, 1, 2, 3], dict.fromkeys(range(4), ROW_BYTES))
    assert {e: p.node_id for e, p in placement.remote.items()} == {0: "p0", 1: "p0", 2: "p1", 3: "p1"}
    assert "nic" not in placement.estimate_s  # nothing crossed it


def test_a_slow_peer_still_loses_to_fetching_a_single_expert() -> None:
    remote = _remote({"p0": {(1, 0)}}, service_s=5.0)
    placement = remote.plan(1, [0], {0: ROW_BYTES})
    assert placement.remote == {}
    assert abs(placement.estimate_s["nic"] - K3_EXPERT_BYTES / GIGABIT) < 1e-9
