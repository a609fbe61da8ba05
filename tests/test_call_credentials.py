"""The household secret never crosses the network: every call carries a fresh credential made
with it (node/rpc/auth.py), which a node checks, accepts once (node/rpc/replay_cache.py), and
which is worthless after its time window and for any other method."""

from __future__ import annotations

import heapq
import threading
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from expertmesh.node.rpc import auth, replay_cache
from expertmesh.node.rpc.auth import AUTH_METADATA_KEY, CALL_CREDENTIAL_WINDOW_S, call_metadata, node_method
from expertmesh.node.rpc.client import NodeClient
from expertmesh.node.rpc.replay_cache import REPLAYED, START_MARGIN_S, ReplayCache
from expertmesh.node.rpc.server import NodeServer
from expertmesh.v1 import node_pb2, node_pb2_grpc

SECRET = "credentials-test-secret"
INFO = node_method("Info")


class _Node(node_pb2_grpc.NodeServicer):
    def Info(self, request, context):
        return node_pb2.InfoResponse(node_id="node-c", role="full")


@pytest.fixture(scope="module")
def node():
    """A node service behind the household secret, as `serve` runs it (rpc/server.py), and when it
    was started (its replay cache refuses credentials made before)."""
    started = time.time()
    server = NodeServer(_Node(), SECRET, host="127.0.0.1", port=0, max_workers=4)
    server.start()
    try:
        yield SimpleNamespace(address=server.address, started=started)
    finally:
        server.stop(0)


def _info(address: str, metadata) -> node_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), metadata=metadata, timeout=10)


def _refusal(address: str, metadata) -> str:
    """The details of the UNAUTHENTICATED refusal of an Info call with `metadata`."""
    with pytest.raises(grpc.RpcError) as e:
        _info(address, metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    return e.value.details()


def _made_at(when: float, method: str = INFO, secret: str = SECRET):
    """A credential made (or recorded off the LAN) at unix time `when`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(auth, "time", SimpleNamespace(time=lambda: when))  # this module's clock only
        return call_metadata(secret, method)


def test_calls_carry_a_fresh_credential_never_the_secret(node, monkeypatch) -> None:
    sent = []
    real = auth.call_metadata
    monkeypatch.setattr("expertmesh.node.rpc.client.call_metadata", lambda s, m: sent.append(real(s, m)) or sent[-1])
    with NodeClient(node.address, SECRET) as client:
        client.info()
        client.info()
    assert len(sent) == 2 and sent[0] != sent[1]  # a new nonce each call
    assert all(SECRET not in value for md in sent for _, value in md)
    assert all(key == AUTH_METADATA_KEY for md in sent for key, _ in md)
    assert all(value.startswith("v2:") for md in sent for _, value in md)


def test_a_wrong_secret_or_the_bare_secret_is_refused(node) -> None:
    for metadata in (call_metadata("another-secret", INFO), ((AUTH_METADATA_KEY, SECRET),)):
        assert _refusal(node.address, metadata) == "a valid household secret is required"


def test_a_node_of_the_previous_protocol_is_told_to_upgrade_not_that_its_secret_is_wrong(node) -> None:
    details = _refusal(node.address, (("x-expertmesh-secret", SECRET),))  # what protocol 1 sent
    assert "same expertmesh release" in details and SECRET not in details


def test_a_credential_of_protocol_2_is_told_to_upgrade(node) -> None:
    ((_, credential),) = call_metadata(SECRET, INFO)
    old = "v1:" + credential.split(":", 1)[1]  # protocol 2's shape: v1:<time>:<nonce>:<HMAC>
    details = _refusal(node.address, ((AUTH_METADATA_KEY, old),))
    assert "protocol 2" in details and "same expertmesh release" in details and old not in details


def test_a_member_of_another_protocol_is_not_joined_and_says_why() -> None:
    from fake_nodes import member

    from expertmesh.node.household.membership import prove_peer
    from expertmesh.node.rpc.proof import ProofError

    with member(SECRET, "old-mac", protocol_version=2) as old:
        with pytest.raises(ProofError, match="speaks protocol 2 and this one 3"):
            prove_peer(old.address, SECRET)


def test_a_copied_credential_is_refused_once_its_window_is_over_and_says_the_clocks_differ(node) -> None:
    assert _info(node.address, call_metadata(SECRET, INFO)).node_id == "node-c"
    old = _made_at(time.time() - CALL_CREDENTIAL_WINDOW_S - 60)  # made six minutes ago
    details = _refusal(node.address, old)
    assert "clock" in details and "behind" in details


def test_the_same_credential_sent_twice_is_refused_as_a_replay(node) -> None:
    copied = call_metadata(SECRET, INFO)
    assert _info(node.address, copied).node_id == "node-c"
    details = _refusal(node.address, copied)  # a copy sent again: the node remembers its nonce
    assert details == REPLAYED == "this credential was already used: a replayed call"
    assert SECRET not in details and copied[0][1] not in details
    for _ in range(2):  # fresh credentials, one per call, still pass
        assert _info(node.address, call_metadata(SECRET, INFO)).node_id == "node-c"


def test_a_credential_cannot_be_moved_to_another_method(node) -> None:
    for_inventory = call_metadata(SECRET, node_method("GetInventory"))
    assert _refusal(node.address, for_inventory) == "a valid household secret is required"


def test_a_credential_made_before_the_node_started_is_refused_and_says_why(node) -> None:
    copied = _made_at(node.started - START_MARGIN_S - 60)  # inside the window, but before the start
    details = _refusal(node.address, copied)
    assert "before this node started" in details and "clock" in details


def test_concurrent_calls_with_fresh_credentials_all_pass_and_each_copy_is_served_once(node) -> None:
    threads, per_thread = 6, 10
    barrier = threading.Barrier(threads, timeout=30)
    copies = [call_metadata(SECRET, INFO) for _ in range(per_thread)]  # each sent by every thread

    def calls(_: int) -> tuple[int, list[str]]:
        fresh, refusals = 0, []
        with grpc.insecure_channel(node.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            barrier.wait()
            for copied in copies:
                fresh += stub.Info(node_pb2.InfoRequest(), metadata=call_metadata(SECRET, INFO), timeout=10) is not None
                try:
                    stub.Info(node_pb2.InfoRequest(), metadata=copied, timeout=10)
                except grpc.RpcError as e:
                    refusals.append(e.details())
        return fresh, refusals

    with futures.ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(calls, range(threads)))
    assert sum(fresh for fresh, _ in results) == threads * per_thread
    refusals = [r for _, rs in results for r in rs]
    assert len(refusals) == (threads - 1) * per_thread  # each copy served once, by whichever came first
    assert set(refusals) == {REPLAYED}


def _cache(max_entries: int, now: float) -> ReplayCache:
    return ReplayCache(CALL_CREDENTIAL_WINDOW_S, started=now - 3600, max_entries=max_entries)


def test_the_cache_never_grows_past_its_bound_and_then_refuses_what_it_may_have_forgotten() -> None:
    now = 1_800_000_000.0
    cache = _cache(4, now)
    stamps = [int(now) - 100 + i // 2 for i in range(12)]  # two calls a second, oldest first
    for i, stamp in enumerate(stamps):
        assert cache.admit(stamp, f"{i:032x}", now) is None
        assert len(cache) <= 4
    assert len(cache) == 4  # the last two seconds' calls
    for i, stamp in enumerate(stamps):  # none of them is accepted again, remembered or forgotten
        assert cache.admit(stamp, f"{i:032x}", now) is not None
    assert cache.admit(stamps[-1], f"{10:032x}", now) == REPLAYED
    older = cache.admit(stamps[0], "f" * 32, now)  # new, but older than the oldest remembered
    assert "remembers the calls of the last" in older and "full" in older
    assert cache.admit(int(now), "e" * 32, now) is None  # a call of now still passes
    assert len(cache) <= 4


def test_the_cache_forgets_nonces_whose_time_left_the_window() -> None:
    now = 1_800_000_000.0
    cache = _cache(100, now)
    for i in range(10):
        assert cache.admit(int(now), f"{i:032x}", now) is None
    later = now + CALL_CREDENTIAL_WINDOW_S + 2
    assert cache.admit(int(later), "a" * 32, later) is None
    assert len(cache) == 1
    # the node's clock stepped back (NTP): the forgotten nonces stay refused
    assert cache.admit(int(now), f"{3:032x}", now) is not None


def test_a_cache_refuses_what_was_stamped_before_it_started() -> None:
    now = 1_800_000_000.0
    cache = ReplayCache(CALL_CREDENTIAL_WINDOW_S, started=now)
    assert cache.admit(int(now) - START_MARGIN_S + 1, "a" * 32, now) is None  # a clock a little behind
    assert "before this node started" in cache.admit(int(now) - 60, "b" * 32, now)


def test_the_cache_accepts_each_nonce_once_across_threads(monkeypatch) -> None:
    def slow_push(heap: list[int], stamp: int) -> None:  # widens the step between finding and adding
        time.sleep(0.001)
        heapq.heappush(heap, stamp)

    monkeypatch.setattr(replay_cache, "heapq", SimpleNamespace(heappush=slow_push, heappop=heapq.heappop))
    now = 1_800_000_000.0
    cache = _cache(100_000, now)
    calls = [(int(now) - i, f"{i:032x}") for i in range(100)]  # a new second each: a new set each
    barrier = threading.Barrier(8, timeout=30)

    def admit_all(_: int) -> int:
        barrier.wait()
        return sum(cache.admit(stamp, nonce, now) is None for stamp, nonce in calls)

    with futures.ThreadPoolExecutor(8) as pool:
        accepted = sum(pool.map(admit_all, range(8)))
    assert accepted == len(calls) == len(cache)
