"""`expertmesh warm` against real cache peers on loopback: each expert lands on its owner's disk
once, the Hub serves it once, a second warm costs nothing, a budget is filled most-used first and
never by evicting, and a wrong secret warms nothing. Also the peers tier's use of inventories:
after the owner, only nodes that hold an expert are asked for it; and an owner, once warmed,
computes every expert it owns when a peer sends it activations (never answers one `missing`),
and a node asked as an expert's owner keeps it even where its own peer table names another."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
import pytest
from nodes import serving
from repos import KIMI_K3, QWEN3_MOE

from expertmesh.cli import main
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.household.warm import WarmNode, owners, warm, warm_order
from expertmesh.node.hub import local_models
from expertmesh.node.hub.pull import pull
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
from expertmesh.node.rpc import activations
from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.node.service import NodeService
from expertmesh.v1 import node_pb2, node_pb2_grpc

SECRET = "warm-test-secret"


class CachePeer:
    def __init__(self, home: Path, node_id: str, disk_budget: str):
        pull(QWEN3_MOE, home=home, progress=False, index_only=True)
        self.node = serving(
            QWEN3_MOE, home, SECRET, node_id=node_id, cache_only=True, store=StoreConfig(disk_budget=disk_budget)
        )
        self.experts = self.node.experts
        self.node_id = node_id
        self.address = self.node.rpc.address

    def as_warm_node(self) -> WarmNode:
        return WarmNode(self.node_id, self.address, self.experts.disk.budget_bytes)

    def close(self) -> None:
        self.node.close()


@pytest.fixture
def peers(hub: HubServer, tmp_path: Path):
    made: list[CachePeer] = []

    def make(node_id: str, disk_budget: str = "100MB") -> CachePeer:
        made.append(CachePeer(tmp_path / node_id, node_id, disk_budget))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_every_expert_lands_on_its_owner_once(hub: HubServer, peers, tmp_path: Path, monkeypatch, capsys) -> None:
    a, b = peers("node-a"), peers("node-b")
    index = a.experts.index
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path / "node-a"))
    monkeypatch.setenv("EXPERTMESH_SECRET", SECRET)
    before = hub.stats()["bytes_served"]
    assert main(["warm", QWEN3_MOE, "--no-discovery", "--peer", a.address, "--peer", b.address]) == 0
    owned = owners(index, [a.as_warm_node(), b.as_warm_node()], index.experts)
    for peer in (a, b):
        assert set(peer.experts.disk._files) == set(owned[peer.node_id])  # its own experts, no one else's
        assert peer.experts.disk.evictions == 0
    assert owned["node-a"] and owned["node-b"]
    all_bytes = sum(loc.nbytes for loc in index.experts.values())
    assert hub.stats()["bytes_served"] - before == all_bytes  # each expert crossed the Hub once
    out = capsys.readouterr().out
    assert "node-a" in out and "done" in out

    # a second warm asks only for what is missing: nothing
    assert main(["warm", QWEN3_MOE, "--no-discovery", "--peer", a.address, "--peer", b.address]) == 0
    assert hub.stats()["bytes_served"] - before == all_bytes
    assert "kept       0" in capsys.readouterr().out


def test_a_small_budget_is_filled_most_used_first_without_evicting(hub: HubServer, peers) -> None:
    small = peers("small")
    index = small.experts.index
    nbytes = next(iter(index.experts.values())).nbytes
    small.experts.disk.budget_bytes = 5 * nbytes
    keys = sorted(index.experts)
    uses = Counter({k: 100 - i for i, k in enumerate(keys[-7:])})  # the 7 hottest are the last keys
    order = warm_order(index, uses)
    assert order[:7] == keys[-7:]
    [result] = warm(index, [small.as_warm_node()], SECRET, order, concurrency=1)
    assert result.full and result.kept == 5
    assert set(small.experts.disk._files) == set(keys[-7:-2])  # the five most used
    assert small.experts.disk.evictions == 0 and small.experts.disk.nbytes <= small.experts.disk.budget_bytes


def test_a_wrong_secret_warms_nothing(hub: HubServer, peers, tmp_path: Path, monkeypatch, capsys) -> None:
    a = peers("node-a")
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path / "node-a"))
    monkeypatch.setenv("EXPERTMESH_SECRET", "not-the-secret")
    assert main(["warm", QWEN3_MOE, "--no-discovery", "--peer", a.address]) != 0
    err = capsys.readouterr().err
    assert "unauthenticated" in err and "no node serving" in err
    assert "not-the-secret" not in err and SECRET not in err
    assert len(a.experts.disk) == 0


class _CountingService(NodeService):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fetches = 0

    def FetchExpert(self, request, context):
        self.fetches += 1
        yield from super().FetchExpert(request, context)


def test_after_a_dead_owner_only_holders_known_from_inventories_are_asked(
    pulled_home, hub: HubServer, tmp_path: Path
) -> None:
    from expertmesh.node.household.membership import Peer, PeerTable, expert_key, rendezvous_score
    from expertmesh.node.household.peers_tier import PeerSource

    made = []
    try:
        for name in ("owner", "holder", "empty"):
            home = tmp_path / name
            pulled_home("qwen3_moe", home, index_only=True)
            store = StoreConfig(disk_budget="100MB")
            made.append(
                serving(
                    QWEN3_MOE, home, SECRET, node_id=name, cache_only=True, store=store, service_class=_CountingService
                )
            )
        owner_node, holder_node, empty_node = made
        owner_server, holder_server, empty_server = (n.rpc for n in made)
        holder, empty_service = holder_node.experts, empty_node.service
        index = holder.index

        # experts for which, once the owner is gone, the empty node ranks before the holder
        keys = [
            k
            for k in sorted(index.experts)
            if rendezvous_score(expert_key(index, *k), "empty", 1.0)
            > rendezvous_score(expert_key(index, *k), "holder", 1.0)
        ][:3]
        for key in keys:
            assert holder.keep(index.expert(*key))
        table = PeerTable("client", 0.0)
        table.add(Peer("owner", f"127.0.0.1:{owner_server.port}", 1e15))  # owns every key
        table.add(Peer("holder", f"127.0.0.1:{holder_server.port}", 1.0))
        table.add(Peer("empty", f"127.0.0.1:{empty_server.port}", 1.0))
        owner_server.stop()  # the owner is gone
        source = PeerSource(index, table, SECRET)
        try:
            hub_before = hub.stats()["bytes_served"]
            loc = index.expert(*keys[0])
            assert len(source.fetch(loc) or b"") == loc.nbytes  # the owner fails: the holder serves it
            assert empty_service.fetches == 0  # it ranked before the holder, but its inventory lists nothing
            assert hub.stats()["bytes_served"] == hub_before
            assert table.errors["unavailable"] == 1 and not table.peers["owner"].live  # the dead owner is skipped
        finally:
            source.close()
    finally:
        for node in made:
            node.close()


def _compute(address: str, index: ExpertIndex, layer: int, experts: list[int], width: int, fetch_on_miss: bool = False):
    """A peer's ComputeExperts call for `experts` of `layer`, one row each (as remote execution sends
    them); `fetch_on_miss`: asked as their owner, which fetches what it lacks."""
    rng = np.random.default_rng(len(experts))
    request = node_pb2.ComputeExpertsRequest(
        model=node_pb2.ModelKey(repo_id=index.repo_id, commit=index.commit),
        layer=layer,
        fetch_on_miss=fetch_on_miss,
        experts=[
            node_pb2.ExpertRows(
                expert=e, rows=activations.encode(mx.array(rng.standard_normal((1, width)).astype(np.float32)))
            )
            for e in experts
        ],
    )
    with grpc.insecure_channel(address) as channel:
        return node_pb2_grpc.NodeStub(channel).ComputeExperts(
            request, metadata=call_metadata(SECRET, node_method("ComputeExperts")), timeout=30
        )


def test_a_warmed_owner_computes_every_expert_it_owns_never_missing(home: Path) -> None:
    """After `warm` an owner holds its experts, so a ComputeExperts call for them gets every one
    computed: an expert answered `missing` crosses the LAN whole instead (the lab's
    `fallback_missing`). A call for more experts than the owner holds at once comes in groups, the
    next queued before the last is placed; here placing the first group lets go of expert b, the
    least recently used, which the store had already found in RAM for the next group."""
    index = ExpertIndex.load(local_models.find_index(home, KIMI_K3) / INDEX_FILENAME)
    layer = index.moe_layers[0]
    nbytes = index.expert(layer, 0).nbytes
    store = StoreConfig(
        ram_budget=str(4 * nbytes),
        disk_budget="100MB",
        fetch_concurrency=2,
        ram_policy="lru",
        prefetch=False,
        fill=False,
    )
    node = serving(KIMI_K3, home, SECRET, node_id="owner", store=store)
    try:
        kept, limit = node.store.ram.slots(nbytes), node.store.hold_limit()
        group = max(1, limit // 2)  # the store's group size for a call of more than `limit`
        assert kept >= 1 and kept + limit + 1 <= sum(lay == layer for lay, _ in index.experts)  # experts enough
        [warmed] = warm(index, [WarmNode("owner", node.rpc.address, node.experts.disk.budget_bytes)], SECRET)
        assert warmed.kept == warmed.owned == len(index.experts)  # the only node: it owns every expert
        width = node.model.blocks[0].input_width
        residents = list(range(kept))  # expert 0 is b: into RAM first, so least recently used
        others = list(range(kept, kept + limit))  # with b, a call of limit + 1: more than one group
        calls = [[e] for e in residents] + [others[:group] + [residents[0]] + others[group:]]
        for experts in calls:
            response = _compute(node.rpc.address, index, layer, experts, width)
            assert list(response.missing) == [], f"answered {list(response.missing)} missing after warm"
            assert [x.expert for x in response.experts] == experts
    finally:
        node.close()


def test_a_node_asked_as_owner_keeps_what_it_fetched_from_a_peer(pulled_home, hub: HubServer, home: Path) -> None:
    """A requester whose peer table lacks a node (a static peer list without it, or one skipped after
    a deadline) counts another node as an expert's owner: it asks that node to fetch the expert on
    a miss and compute it (`fetch_on_miss`), and from then on counts it as held there. The node asked
    must keep it, as an owner keeps what it fetches for the household; else, once its RAM lets the
    expert go, the requester's next call gets it answered `missing` and fetches it whole (the lab's
    `fallback_missing` after `warm`). Here the node asked, x, knows z, which owns the expert in x's
    own view and holds it after `warm`, so x fetches it from z over the LAN, not from the Hub."""
    z = serving(
        KIMI_K3,
        pulled_home("kimi_k3", home.parent / "z", index_only=True),
        SECRET,
        node_id="z",
        cache_only=True,
        store=StoreConfig(disk_budget="100MB"),
    )
    index = z.experts.index
    layer = index.moe_layers[0]
    nbytes = index.expert(layer, 0).nbytes
    store = StoreConfig(ram_budget=str(4 * nbytes), disk_budget="100MB", ram_policy="lru", prefetch=False, fill=False)
    x = serving(KIMI_K3, home, SECRET, node_id="x", store=store, peers=[z.rpc.address])
    try:
        nodes = [WarmNode(n.node_id, n.rpc.address, n.experts.disk.budget_bytes) for n in (x, z)]
        warm(index, nodes, SECRET)
        owned = owners(index, nodes, [k for k in index.experts if k[0] == layer])
        [asked] = owned["z"][:1]  # z's: x fetches it from z when asked for it as its owner
        own = [e for _, e in owned["x"]][: x.store.ram.slots(nbytes)]  # on x's disk: enough to fill its RAM
        width = x.model.blocks[0].input_width
        hub_before = hub.stats()["bytes_served"]
        response = _compute(x.rpc.address, index, layer, [asked[1]], width, fetch_on_miss=True)
        assert list(response.missing) == []
        # from z, not the Hub: the Hub served only the check of z's first copy here
        assert x.stats.audits["confirmed"] == 1 and hub.stats()["bytes_served"] - hub_before == x.stats.audit_bytes
        for e in own:  # x's RAM lets the asked expert go
            assert list(_compute(x.rpc.address, index, layer, [e], width).missing) == []
        assert asked not in x.store.ram
        response = _compute(x.rpc.address, index, layer, [asked[1]], width)
        assert list(response.missing) == [], "the node asked as owner let go of what it fetched"
    finally:
        x.close()
        z.close()
