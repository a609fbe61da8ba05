"""Peers that misbehave on purpose, over real gRPC on loopback: a peer whose FetchExpert hangs
while its health says SERVING stays skipped (longer each time), a busy peer is passed over
without a penalty (and asked again by warm), a peer's inventory is read only as far as it fits
the model, and a node busy with owner fetches refuses the excess at once while its health and
Info stay answered."""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import pytest
from fake_nodes import fake_node
from grpc_health.v1 import health_pb2
from nodes import serving
from repos import KIMI_K3
from waiting import wait_until

from expertmesh.node import constants
from expertmesh.node.config import RpcConfig
from expertmesh.node.household.membership import SKIP_AFTER_ERROR_S, Peer, PeerTable
from expertmesh.node.household.peers_tier import PeerSource, SkipPolicy
from expertmesh.node.household.warm import WarmNode, warm
from expertmesh.node.hub.local_models import find_index
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
from expertmesh.node.rpc.admission import BUSY
from expertmesh.node.rpc.auth import SecretInterceptor, call_metadata, node_method
from expertmesh.node.rpc.client import NodeClient, model_key
from expertmesh.node.rpc.inventory import bitmap_bytes, inventory_keys, layer_sizes
from expertmesh.node.rpc.server import RESERVED_WORKERS
from expertmesh.v1 import node_pb2, node_pb2_grpc

SECRET = "robustness-test-secret"
HUNG_DEADLINE_S = 0.3  # the fetch deadline against the hung peer (30 s by default)


class _Misbehaving(node_pb2_grpc.NodeServicer):
    """A peer that answers health SERVING and does what `mode` says with FetchExpert: "hang" (until
    `release` is set), "busy" (RESOURCE_EXHAUSTED, as a full admission does), or "busy twice" (so
    twice, then it keeps the expert as warm asks), or "slow keeps" (keeps one expert at a time,
    each taking `keep_s`, as an owner on a slow home link does); its GetInventory answers `inventory`."""

    def __init__(self) -> None:
        self.mode = "hang"
        self.asked = 0
        self.release = threading.Event()
        self.inventory: list[node_pb2.LayerBitmap] = []
        self.inventory_model: node_pb2.ModelKey | None = None  # the model its inventory names (None: the one asked)
        self.serve_bytes = 0
        self.keep_s = 0.0
        self._keeping = threading.Lock()

    def FetchExpert(self, request, context):
        self.asked += 1
        if self.mode == "slow keeps":
            with self._keeping:
                time.sleep(self.keep_s)
            return iter([node_pb2.ExpertChunk(size=1)])
        if self.mode == "busy" or (self.mode == "busy twice" and self.asked <= 2):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{BUSY}: 8 expert fetches run")
        if self.mode == "busy twice":
            return iter([node_pb2.ExpertChunk(size=1)])
        if self.mode == "not found":
            context.abort(grpc.StatusCode.NOT_FOUND, "not held")
        if self.mode == "progress after data":  # the expert, then word of a fetch it no longer makes
            data = bytes(self.serve_bytes)
            digest = hashlib.sha256(data).hexdigest()
            progress = node_pb2.FetchProgress(fetching=True, received_bytes=1)
            return iter(
                [
                    node_pb2.ExpertChunk(progress=progress),
                    node_pb2.ExpertChunk(size=len(data), sha256=digest, data=data),
                    node_pb2.ExpertChunk(progress=progress),
                ]
            )
        if self.mode == "busy, then serve":  # twice busy, then the asked size of zeros
            if self.asked <= 2:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{BUSY}: 8 expert fetches run")
            data = bytes(self.serve_bytes)
            return iter([node_pb2.ExpertChunk(size=len(data), sha256=hashlib.sha256(data).hexdigest(), data=data)])
        end = time.monotonic() + 30  # until the caller gives up, 30 s at most
        while context.is_active() and time.monotonic() < end and not self.release.wait(0.05):
            pass
        return iter(())

    def GetInventory(self, request, context):
        return node_pb2.InventoryResponse(model=self.inventory_model or request.model, layers=self.inventory)


@pytest.fixture(scope="module")
def index(module_home) -> ExpertIndex:
    return ExpertIndex.load(find_index(module_home, KIMI_K3) / INDEX_FILENAME)


@pytest.fixture(scope="module")
def fake():
    """(servicer, its health servicer, its address)."""
    servicer = _Misbehaving()
    with fake_node(servicer, [SecretInterceptor(SECRET)], workers=16) as (address, health_servicer):
        try:
            yield servicer, health_servicer, address
        finally:
            servicer.release.set()


def _source(index: ExpertIndex, address: str, **options) -> tuple[PeerSource, Peer]:
    """A tier whose only peer is the one at `address`, with a disk so big it owns every expert."""
    table = PeerTable(self_id="me", self_weight=1.0)
    peer = Peer("bad", address, weight=2.0**60)
    table.add(peer)
    # its FetchExpert hangs while its health answers: only the deadline ends the wait, and the
    # time an owner's Hub fetch may take (a K3 expert's minutes) is no part of this test's
    options.setdefault("owner_hub_s", lambda nbytes: 0.0)
    return PeerSource(index, table, SECRET, deadline_s=HUNG_DEADLINE_S, **options), peer


def test_a_hung_peer_stays_skipped_though_its_health_says_serving(index, fake) -> None:
    servicer, _, address = fake
    servicer.mode = "hang"
    source, peer = _source(index, address)
    try:
        loc = next(iter(index.experts.values()))
        before = time.monotonic()
        assert source.fetch(loc) is None  # the owner hung to the deadline
        assert source.table.errors["deadline_exceeded"] == 1
        assert not peer.live and peer.skip_until >= before + SKIP_AFTER_ERROR_S
        skip_until = peer.skip_until
        source.check_health()  # SERVING: this used to lift the skip (every 10 s)
        assert not peer.live and peer.skip_until == skip_until
        assert source.fetch(loc) is None
        assert source.table.errors["deadline_exceeded"] == 1  # while it is skipped, no miss waits on it
        assert source.skip_reason(peer) == "deadline_exceeded"
    finally:
        source.close()


def test_repeated_failures_skip_longer_up_to_a_bound(index, fake) -> None:
    servicer, _, address = fake
    servicer.mode = "hang"
    policy = SkipPolicy(first_s=0.2, max_s=0.8, kept_s=60.0)
    source, peer = _source(index, address, skips=policy)
    loc = next(iter(index.experts.values()))
    try:
        for skip_s in (0.2, 0.4, 0.8, 0.8):  # doubled each time, at most max_s
            assert wait_until(lambda: peer.live, timeout_s=5)  # the last skip ran its course
            before = time.monotonic()
            assert source.fetch(loc) is None
            after = time.monotonic()
            assert peer.skip_until - before >= skip_s >= peer.skip_until - after  # skipped from the failure on
            skip_until = peer.skip_until
            source.check_health()
            assert peer.skip_until == skip_until  # health does not lift it
        assert source.table.errors["deadline_exceeded"] == 4
    finally:
        source.close()


def test_a_skip_for_failed_health_is_lifted_when_it_serves_again(index, fake) -> None:
    _, health_servicer, address = fake
    source, peer = _source(index, address)
    try:
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        source.check_health()
        assert not peer.live and source.skip_reason(peer) == "not_serving"
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        source.check_health()
        assert peer.live
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        source.close()


def test_a_busy_peer_is_passed_over_without_a_penalty(index, fake) -> None:
    servicer, _, address = fake
    servicer.mode = "busy"
    source, peer = _source(index, address)
    try:
        assert source.fetch(next(iter(index.experts.values()))) is None  # to the Hub, this once
        assert peer.live and sum(source.table.errors.values()) == 0
    finally:
        servicer.mode = "hang"
        source.close()


def test_a_busy_owner_is_asked_again_before_the_hub(index, fake) -> None:
    """An owner is busy while it fetches for the household: going to the Hub at once would
    download the expert twice, so it is asked again after short pauses (and not penalised)."""
    servicer, _, address = fake
    loc = next(iter(index.experts.values()))
    servicer.mode, servicer.asked, servicer.serve_bytes = "busy, then serve", 0, loc.nbytes
    source, peer = _source(index, address)
    source.deadline_s = 10.0  # room for the pauses (at most BUSY_WAIT_S)
    try:
        blob = source.fetch(loc)
        assert blob is not None and len(blob) == loc.nbytes  # from the owner, not the Hub
        assert servicer.asked == 3
        assert peer.live and sum(source.table.errors.values()) == 0
    finally:
        servicer.mode = "hang"
        source.close()


def test_an_owner_whose_progress_comes_after_its_data_is_refused_as_malformed(index, fake) -> None:
    """Progress says how a fetch goes before its bytes; after them it is a confused or hostile
    node's, and its bytes are not used."""
    servicer, _, address = fake
    loc = next(iter(index.experts.values()))
    servicer.mode, servicer.serve_bytes = "progress after data", loc.nbytes
    source, peer = _source(index, address)
    try:
        assert source.fetch(loc) is None  # to the Hub instead
        assert source.table.errors["malformed"] == 1 and not peer.live
    finally:
        servicer.mode = "hang"
        source.close()


def test_warm_asks_a_busy_node_again_rather_than_take_it_for_full(index, fake) -> None:
    servicer, _, address = fake
    servicer.mode, servicer.asked = "busy twice", 0
    try:
        [result] = warm(index, [WarmNode("bad", address, 2**40)], SECRET, order=list(index.experts)[:1])
    finally:
        servicer.mode = "hang"
    assert servicer.asked == 3
    assert result.kept == 1 and not result.full and not result.errors


def test_warm_waits_for_an_owner_whose_hub_link_is_slow(index, fake, monkeypatch) -> None:
    """On a slow home link an owner's keeps queue behind each other, each within its own Hub
    fetch's bound: warm must wait for them, not give up on work the owner is still doing and
    then on the owner. Time is scaled down: a Hub fetch's bound of about 0.7 s, keeps of 0.5 s."""
    monkeypatch.setattr(constants, "HUB_FETCH_DEADLINE_S", 0.6)
    monkeypatch.setattr(constants, "HUB_SPEED_WINDOW_S", 0.05)
    servicer, _, address = fake
    servicer.mode, servicer.asked, servicer.keep_s = "slow keeps", 0, 0.5
    order = list(index.experts)[:4]
    try:
        [result] = warm(index, [WarmNode("slow", address, 2**40)], SECRET, order=order, concurrency=4)
    finally:
        servicer.mode = "hang"
    assert servicer.asked == len(order)
    assert result.kept == len(order) and not result.errors and not result.unreachable


def test_a_peer_inventory_is_read_only_as_far_as_it_fits_the_model(index, fake) -> None:
    servicer, _, address = fake
    sizes = layer_sizes(index)
    first, last = index.moe_layers[0], index.moe_layers[-1]
    n = sizes[first]
    all_bits = b"\xff" * bitmap_bytes(n)
    servicer.inventory = [
        node_pb2.LayerBitmap(layer=4_000_000_000, num_experts=2**32 - 1, bits=b"\xff" * 65536),  # no such layer
        node_pb2.LayerBitmap(layer=last, num_experts=2**32 - 1, bits=b"\xff" * 65536),  # not its expert count
        node_pb2.LayerBitmap(layer=last, num_experts=sizes[last], bits=b"\xff" * 65536),  # bits too long
        node_pb2.LayerBitmap(layer=last, num_experts=sizes[last], bits=b""),  # bits too short
        node_pb2.LayerBitmap(layer=first, num_experts=n, bits=all_bits),  # right: every expert, padding too
        node_pb2.LayerBitmap(layer=first, num_experts=n, bits=all_bits),  # the same layer again
    ]
    source, peer = _source(index, address)
    try:
        held = source.inventory(peer)
        assert held == {(first, e) for e in range(n)}
    finally:
        servicer.inventory = []
        source.close()


def test_a_peer_that_misses_what_its_inventory_lists_is_not_asked_for_it_again(index, fake) -> None:
    """Its inventory says it holds every expert, its answers say NOT_FOUND: after the first miss the
    expert is no longer believed there (until its inventory is read anew), so later misses do not
    ask it again first; an honest miss is not penalised."""
    servicer, _, address = fake
    first = index.moe_layers[0]
    n = layer_sizes(index)[first]
    servicer.inventory = [node_pb2.LayerBitmap(layer=first, num_experts=n, bits=b"\xff" * bitmap_bytes(n))]
    servicer.mode = "not found"
    source, peer = _source(index, address)
    try:
        loc = index.expert(first, 0)
        assert source._holds(peer, (first, 0), 1.0)  # as its inventory says
        assert source._fetch_from(peer, loc, owner=False, timeout=5.0) is None
        assert not source._holds(peer, (first, 0), 1.0) and source._holds(peer, (first, 1), 1.0)
        assert peer.live and sum(source.table.errors.values()) == 0
    finally:
        servicer.mode, servicer.inventory = "hang", []
        source.close()


def test_an_inventory_answered_for_another_model_holds_nothing(index, fake) -> None:
    """A node refuses the inventory of a model it does not serve; a peer that answers one anyway
    for another model or revision names experts of something else, though its bitmaps fit."""
    servicer, _, address = fake
    first = index.moe_layers[0]
    n = layer_sizes(index)[first]
    servicer.inventory = [node_pb2.LayerBitmap(layer=first, num_experts=n, bits=b"\xff" * bitmap_bytes(n))]
    others = [model_key("someone/else", index.commit), model_key(index.repo_id, "0" * 40), None]
    try:
        for other in others:
            servicer.inventory_model = other
            source, peer = _source(index, address)
            try:
                held = source.inventory(peer)
            finally:
                source.close()
            assert held == (set() if other is not None else {(first, e) for e in range(n)}), other
    finally:
        servicer.inventory, servicer.inventory_model = [], None


# -- a node's own admission -------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(module_home):
    with serving(KIMI_K3, module_home, SECRET, node_id="busy-owner") as served:
        yield served


def _gate_owner_fetches(node, monkeypatch) -> threading.Event:
    """Owner fetches wait for the returned event (a Hub link that does not answer) before going on."""
    gate = threading.Event()
    fetch = node.service.experts.fetch_as_owner

    def slow(loc, *args):
        gate.wait(30)
        return fetch(loc, *args)

    monkeypatch.setattr(node.service.experts, "fetch_as_owner", slow)
    return gate


def test_owner_fetches_beyond_the_slots_are_refused_while_health_and_info_answer(node, monkeypatch) -> None:
    gate = _gate_owner_fetches(node, monkeypatch)
    model = model_key(node.index.repo_id, node.index.commit)
    workers = RpcConfig().max_workers
    service = node.service
    capacity = workers - RESERVED_WORKERS - service.generation_slots.capacity - service.count_slots.capacity  # 8
    keys = [k for k in node.index.experts if k not in node.disk][: workers + 4]
    assert len(keys) == workers + 4  # more owner fetches than threads
    refused: list = []
    compute = node_pb2.ComputeExpertsRequest(model=model, layer=node.index.moe_layers[0])
    with NodeClient(node.rpc.address, SECRET) as client:
        calls = [client.fetch_expert(model, *k, timeout=60, fetch_on_miss=True) for k in keys]
        try:
            refusing = wait_until(lambda: sum(c.done() for c in calls) >= len(keys) - capacity, timeout_s=20)
            # the reserve answers while the admitted fetches wait on the Hub (these timed out before)
            assert client.health(2.0) == health_pb2.HealthCheckResponse.SERVING
            assert client.info(5.0).node_id == "busy-owner"
            assert client.inventory(model, layer_sizes(node.index), timeout=5.0) == {
                k for k in node.index.experts if k in node.disk
            }
            assert refusing
            refused = [c for c in calls if c.done()]
            assert len(refused) == len(keys) - capacity
            assert {c.code() for c in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert refused[0].details().startswith(BUSY)
            slots = node.service.peer_call_slots
            assert slots.capacity == capacity and slots.in_use() == capacity
            # ComputeExperts shares the slots: refused at once too
            with pytest.raises(grpc.RpcError) as e:
                client.compute_experts(compute, timeout=10).result()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details().startswith(BUSY)
        finally:
            gate.set()
        for c, k in zip(calls, keys, strict=True):
            if c not in refused:  # the admitted ones are served once the Hub answers
                assert sum(len(ch.data) for ch in c) == node.index.expert(*k).nbytes
    assert wait_until(lambda: slots.in_use() == 0, timeout_s=20)  # every slot given back
    with NodeClient(node.rpc.address, SECRET) as client, pytest.raises(grpc.RpcError) as e:
        client.compute_experts(compute, timeout=10).result()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # admitted now, and checked


def test_get_inventory_counts_the_layers_once(node) -> None:
    """GetInventory used to rescan every expert once per layer on every call (0.2 s of GIL-held
    time at K3's size); now a call after the first does not walk the index at all."""
    index = node.service.experts.index
    walks = [0]

    class Counting(dict):
        def __iter__(self):
            walks[0] += 1
            return super().__iter__()

    model, sizes = model_key(index.repo_id, index.commit), layer_sizes(index)
    request = node_pb2.InventoryRequest(model=model)
    kept = index.experts
    index.experts = Counting(kept)
    try:
        with grpc.insecure_channel(node.rpc.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            first = stub.GetInventory(request, metadata=call_metadata(SECRET, node_method("GetInventory")), timeout=10)
            walks[0] = 0
            again = stub.GetInventory(request, metadata=call_metadata(SECRET, node_method("GetInventory")), timeout=10)
    finally:
        index.experts = kept
    assert walks[0] == 0
    assert [b.layer for b in again.layers] == sorted(sizes)
    assert inventory_keys(first, sizes) == inventory_keys(again, sizes) == {k for k in kept if k in node.disk}


def test_a_peers_words_reach_the_terminal_without_control_characters() -> None:
    """`status` and `peers` print what each node's Info says of itself; a member's id, role, model
    name or Hub bucket cannot move the cursor, set the window's title or add lines."""
    from expertmesh.coordinator.status import status_lines
    from expertmesh.node.rpc.client import NodeAnswer

    hostile = "\x1b]0;owned\x07\x1b[2J\nnode"
    info = node_pb2.InfoResponse(
        node_id=hostile,
        role=hostile,
        models=[node_pb2.ModelKey(repo_id=hostile * 50, commit=hostile)],
        hub_requests={hostile: 3},
    )
    lines = status_lines([NodeAnswer("127.0.0.1:1", info=info)])
    text = "\n".join(lines)
    assert "\x1b" not in text and "\x07" not in text
    assert len(text.splitlines()) == len(lines)  # no line of a peer's making
    assert max(len(line) for line in lines) < 400  # cut, not 50 copies of its name
