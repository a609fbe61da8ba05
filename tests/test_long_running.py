"""What a node that runs for weeks must not accumulate, counted over many iterations in one process
(the probes that watch a real `serve` for minutes through `/proc` stay outside the suite):

- the API: requests of every kind — finished, streamed, cancelled mid-stream, clients that hang up
  before their answer, refusals — leave no thread, connection or generation behind;
- a conversation that outgrows the model's context gets OpenAI's 400 `context_length_exceeded`,
  and the node answers the next request;
- the local Hub (`expertmesh hub`, also a household mirror): a keep-alive connection its client
  forgot is closed (before, each held a thread and a descriptor until the Hub stopped), and its
  counters stay bounded however many distinct ranges or missing names are asked for;
- a routing trace (`--trace`) stops at its size cap, and a full disk stops the trace, not generation.
"""

from __future__ import annotations

import errno
import http.client
import json
import select
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from lazy_import import lazy_import
from nodes import api_server, serving
from repos import KIMI_K3
from waiting import wait_until

from expertmesh.coordinator.openai_api import OpenAIServer
from expertmesh.devtools import local_hub
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.observability.routing_trace import TraceWriter, read_trace

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "long-running-secret"
CONTEXT = 4096  # the tiny kimi_k3's max_position_embeddings
LONG_TEXT = "tell me more about the sea and the sky " * 700  # about 5,000 tokens: beyond the context


@pytest.fixture(scope="module")
def node(module_home: Path):
    with serving(KIMI_K3, module_home, SECRET, node_id="long-running") as node:
        yield node.rpc.address


@pytest.fixture(scope="module")
def api(node):
    server = api_server([node], SECRET, [KIMI_K3], max_waiting=1)
    try:
        yield server
    finally:
        server.stop()


# -- the API ------------------------------------------------------------------------------------


def test_a_prompt_beyond_the_context_is_context_length_exceeded_and_the_node_goes_on(api: OpenAIServer) -> None:
    with openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120) as client:  # closes its pool
        _context_exceeded(client)


def _context_exceeded(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": LONG_TEXT}]
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=KIMI_K3, messages=messages, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as streamed:  # refused before the stream starts: a plain 400
        for _ in client.chat.completions.create(model=KIMI_K3, messages=messages, max_tokens=4, stream=True):
            pass
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=KIMI_K3, prompt=LONG_TEXT, max_tokens=4)
    for e, param in ((chat, "messages"), (streamed, "messages"), (completion, "prompt")):
        assert e.value.code == "context_length_exceeded"
        assert e.value.param == param
        assert f"context is {CONTEXT}" in e.value.message
    answer = client.chat.completions.create(model=KIMI_K3, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert answer.choices[0].finish_reason in ("length", "stop")


def _post(port: int, path: str, body: dict | bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _cancel_mid_stream(port: int, i: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": KIMI_K3, "prompt": f"tell {i}", "max_tokens": 200, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.fp.readline()  # the first event: the generation runs
    conn.sock.close()
    conn.close()
    return response.status


def _hang_up_before_the_answer(port: int, i: int) -> int:
    body = json.dumps({"model": KIMI_K3, "prompt": f"gone {i}", "max_tokens": 200}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
        s.sendall(head.encode() + body)
    return 0


def _burst(port: int, i: int) -> list[int]:
    """More requests at once than the queue holds: some are 429s."""
    codes: list[int] = []
    body = {"model": KIMI_K3, "prompt": f"burst {i}", "max_tokens": 4}
    threads = [threading.Thread(target=lambda: codes.append(_post(port, "/v1/completions", body))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return codes


def test_requests_of_every_kind_leave_no_thread_connection_or_generation_behind(api: OpenAIServer) -> None:
    port = api.port
    chat = {"model": KIMI_K3, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    kinds = [
        lambda i: _post(port, "/v1/chat/completions", chat),
        lambda i: _post(
            port, "/v1/completions", {"model": KIMI_K3, "prompt": f"p{i}", "max_tokens": 3, "stream": True}
        ),
        lambda i: _cancel_mid_stream(port, i),
        lambda i: _hang_up_before_the_answer(port, i),
        lambda i: _post(port, "/v1/chat/completions", b"{not json"),
        lambda i: _post(port, f"/v1/nothing-{i}", {}),
        lambda i: _burst(port, i),
    ]

    def closed_down() -> bool:
        return api.http.open_connections == 0 and api._threads.running == 0 and api.coordinator.queue.depth() == (0, 0)

    def rounds(n: int) -> list[int]:
        codes: list[int] = []
        for i in range(n):
            for kind in kinds:
                got = kind(i)
                codes += got if isinstance(got, list) else [got]
        assert wait_until(closed_down, timeout_s=30), (api.http.open_connections, api._threads.running)
        return codes

    rounds(2)  # warm-up: the pools' threads (the parser, the loop's executor) exist from here on
    threads_before = _unpooled_threads()
    codes = rounds(6)
    assert {200, 400, 404, 429} <= set(codes)  # every kind happened
    assert wait_until(lambda: len(_unpooled_threads()) <= len(threads_before), timeout_s=30), sorted(
        set(_unpooled_threads()) - set(threads_before)
    )
    series = [line for line in _metrics(port).splitlines() if line.startswith("expertmesh_api_responses_total")]
    assert len(series) <= 8  # per endpoint and code: 404s for 6 distinct paths are one "other" series


# Thread pools of a bounded size that start a worker when they first run that many calls at once:
# the node's gRPC server (18 workers) and the API's Info calls. A warm-up cannot be sure to have
# reached their peak, and a worker one of them adds later is no leak (the test failed now and then
# on a second `grpc_` worker).
_BOUNDED_POOLS = ("grpc_", "api-info_")


def _unpooled_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if not t.name.startswith(_BOUNDED_POOLS)]


def _metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


# -- the local Hub ------------------------------------------------------------------------------


def _closed_by_peer(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""


def test_the_hub_closes_connections_its_clients_forgot(hub_root: Path) -> None:
    with HubServer(hub_root, idle_timeout_s=0.5) as hub:
        threads_before = threading.active_count()
        forgotten = []
        for _ in range(12):
            conn = http.client.HTTPConnection(hub.host, hub.port, timeout=30)
            conn.request("GET", f"/{KIMI_K3}/resolve/main/config.json")
            assert conn.getresponse().read()
            forgotten.append(conn)  # kept open, never used again
        assert threading.active_count() >= threads_before + 12  # a thread apiece while they are open
        assert wait_until(lambda: all(_closed_by_peer(c.sock) for c in forgotten), timeout_s=20)
        assert wait_until(lambda: threading.active_count() <= threads_before, timeout_s=20)
        for conn in forgotten:
            conn.close()


def test_the_hubs_counters_stay_bounded(hub_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_hub, "MAX_TRACKED_RANGES", 20, raising=False)  # raising: the test runs on older code too
    with HubServer(hub_root) as hub:
        conn = http.client.HTTPConnection(hub.host, hub.port, timeout=30)
        for i in range(50):
            conn.request("GET", f"/{KIMI_K3}/resolve/main/config.json", headers={"Range": f"bytes=0-{i}"})
            response = conn.getresponse()
            assert response.status == 206 and len(response.read()) == i + 1
            conn.request("GET", f"/{KIMI_K3}/resolve/main/missing-{i}.json")
            response = conn.getresponse()
            response.read()
            assert response.status == 404
        conn.close()
        stats = hub.stats()
    assert set(stats["files"]) == {f"{KIMI_K3}/config.json"}  # no entry per name asked for
    entry = stats["files"][f"{KIMI_K3}/config.json"]
    assert entry["requests"] == 50 and entry["bytes"] == sum(range(1, 51))
    assert len(entry["ranges"]) == 20 and stats["ranges_untracked"] == 30
    assert stats["requests"] == 100


# -- the routing trace ------------------------------------------------------------------------


def _index() -> SimpleNamespace:
    """What TraceWriter reads of an ExpertIndex: 4 MoE layers of 32 experts."""
    layers = [1, 2, 3, 4]
    return SimpleNamespace(
        repo_id=KIMI_K3, commit="0" * 40, moe_layers=layers, experts=[(la, e) for la in layers for e in range(32)]
    )


def test_a_routing_trace_stops_at_its_size_and_stays_readable(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(path, _index(), max_bytes=4096)
    for p in range(500):  # 2,000 layer calls: about 80 kB unbounded
        for layer in (1, 2, 3, 4):
            writer.record(layer, [p % 32, (p + 7) % 32, (p + 11) % 32, (p + 13) % 32])
    writer.close()
    assert writer.stopped is not None
    assert 4096 <= path.stat().st_size < 4096 + 200  # the cap, and at most the line that crossed it
    trace = read_trace(path)
    assert 0 < len(trace.calls) < 2000 and trace.experts_per_layer == {1: 32, 2: 32, 3: 32, 4: 32}


def test_a_failing_trace_disk_stops_the_trace_not_the_generation(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "trace.jsonl", _index())

    class FullDisk:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        flush = close = lambda self: None

    writer._file = FullDisk()
    writer.record(1, [0, 1])  # raised into the store's get before: the generation failed
    writer.record(2, [3])
    assert writer.stopped is not None and "No space left" in writer.stopped
    writer.close()


def test_nodes_that_leave_the_household_leave_no_client_or_entry_behind_in_the_api() -> None:
    """Nodes come and go on new addresses for weeks (DHCP, restarts): the API keeps a client, a
    load count and a slot count only for nodes still in the household."""
    from expertmesh.coordinator.generation import Coordinator, CoordinatorConfig
    from expertmesh.coordinator.node_pool import NodePool

    members: list[str] = []
    coordinator = Coordinator(CoordinatorConfig(secret="s", models=lambda: ["m"]), NodePool([], lambda: list(members)))
    try:
        for n in range(20):  # each visitor is asked its health (/healthz) and its slots, then leaves
            members[:] = [f"127.0.0.1:{1 + n}"]  # nothing listens there: the calls fail at once
            coordinator.healthy_nodes()
            coordinator._learn_new_nodes()
        members.clear()
        coordinator.healthy_nodes()
        assert coordinator._clients == {}
        assert coordinator.pool.busy() == {} and coordinator.pool._asked == {} and coordinator.pool._failed == {}
    finally:
        coordinator.close()


def test_peers_that_leave_the_table_leave_no_channel_or_entry_behind(tmp_path: Path) -> None:
    from expertmesh.node.household.membership import Peer, PeerTable
    from expertmesh.node.household.peers_tier import PeerSource

    table = PeerTable(self_id="me", self_weight=1.0)
    source = PeerSource(SimpleNamespace(repo_id="r", commit="c" * 40, experts={}), table, "s")
    try:
        for n in range(20):
            peer = Peer(f"visitor-{n}", f"127.0.0.1:{1 + n}", weight=1.0)
            table.add(peer)
            source.check_health()  # nobody listens: each visitor is skipped for its failed health
            table.remove(peer.node_id)
        stay = Peer("stays", "127.0.0.1:999", weight=1.0)
        table.add(stay)
        source.check_health()
        assert set(source._clients) == {stay.address}
        assert set(source._skips) <= {stay.node_id}  # a health skip ends once the peer is gone
        assert set(source._inventories) <= {stay.node_id}
    finally:
        source.close()
