"""The API's HTTP server under load and abuse (issue 22), on real sockets against a real node:
thousands of idle connections leave generation and gRPC alone, the connection cap closes the
idle ones, simultaneous requests get 200 or 429 and never a reset, malformed or oversized
requests get a 4xx and no traceback, chunked bodies are bodies, and a client that leaves —
streaming or not — stops its generation on the node."""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import resource
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from lazy_import import lazy_import
from nodes import serving
from repos import KIMI_K3
from waiting import wait_until

from expertmesh.coordinator.http_server import ServerLimits
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer
from expertmesh.node.config import MetricsConfig
from expertmesh.node.rpc.client import NodeClient
from expertmesh.v1 import node_pb2

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "api-server-test-secret"
PROMPT = "The household answers"
IO_TIMEOUT_S = 60  # every socket read here is bounded by this


@pytest.fixture(scope="module")
def node(module_home):
    with serving(
        KIMI_K3, module_home, SECRET, node_id="api-server-node", metrics=MetricsConfig("127.0.0.1", 0)
    ) as node:
        yield node


def _api(node, limits: ServerLimits | None = None, max_waiting: int = 16) -> OpenAIServer:
    config = CoordinatorConfig(secret=SECRET, models=lambda: [KIMI_K3], max_waiting=max_waiting)
    return OpenAIServer(Coordinator(config, NodePool([node.rpc.address])), "127.0.0.1", 0, limits=limits).start()


@pytest.fixture(scope="module")
def api(node):
    server = _api(node, ServerLimits(header_timeout_s=1.0, body_timeout_s=1.0))
    try:
        yield server
    finally:
        server.stop()


def _body(**fields) -> bytes:
    return json.dumps({"model": KIMI_K3, "prompt": PROMPT, "temperature": 0, **fields}).encode()


def _raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `data` on a new connection; the first response's status, headers and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as s:
        s.sendall(data)
        return _response(s)


def _response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    r = http.client.HTTPResponse(s)
    r.begin()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def _head(port: int, line: str, *headers: str, end: bool = True) -> bytes:
    """A request head with the Host the API accepts (this address, with its port)."""
    text = "".join(f"{h}\r\n" for h in (line + " HTTP/1.1", f"Host: 127.0.0.1:{port}", *headers))
    return (text + ("\r\n" if end else "")).encode()


def _post(port: int, path: str, body: bytes, *headers: str) -> bytes:
    return (
        _head(port, f"POST {path}", "Content-Type: application/json", f"Content-Length: {len(body)}", *headers) + body
    )


def _tokens(node) -> float:
    """Tokens the node has generated so far, counted as each one is sampled."""
    return node.metrics.registry.get_sample_value("expertmesh_tokens_generated_total") or 0.0


def _node_tokens(node, max_tokens: int) -> int:
    """How many tokens the node generates for PROMPT (greedy), left alone."""
    req = node_pb2.GenerateRequest(
        model=node_pb2.ModelKey(repo_id=KIMI_K3), prompt=PROMPT, max_tokens=max_tokens, temperature=0.0
    )
    with NodeClient(node.rpc.address, SECRET) as client:
        return sum(1 for e in client.generate(req, timeout=120) if e.HasField("token"))


def _after_the_node_is_done(node) -> None:
    """Return once the node's generation in flight has ended: Generate runs one at a time, so a
    one-token generation finishes only after it."""
    assert _node_tokens(node, 1) == 1


@contextmanager
def _open_files(n: int) -> Iterator[None]:
    """At least `n` open files for this process (macOS starts at 256), restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_thousands_of_idle_connections_leave_generation_and_grpc_alone(node) -> None:
    with _open_files(8192):
        server = _api(node, ServerLimits(idle_timeout_s=600, header_timeout_s=600))
        idle: list[socket.socket] = []
        try:
            for i in range(2000):
                s = socket.create_connection(("127.0.0.1", server.port), timeout=IO_TIMEOUT_S)
                if i % 2:  # half of them start a request and never finish its head
                    s.sendall(_head(server.port, "POST /v1/completions", end=False))
                idle.append(s)
            assert wait_until(lambda: server.http.open_connections >= 2000, timeout_s=IO_TIMEOUT_S)
            c = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=IO_TIMEOUT_S)
            r = c.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
            with NodeClient(node.rpc.address, SECRET) as fresh:  # a new gRPC connection: descriptors are left
                assert fresh.serving(IO_TIMEOUT_S)
            assert server.http.open_connections >= 2000 and server.http.evicted == 0  # all still held
        finally:
            for s in idle:
                s.close()
            server.stop()


def test_beyond_the_connection_cap_the_oldest_idle_connection_closes(node) -> None:
    server = _api(node, ServerLimits(max_connections=20))
    idle: list[socket.socket] = []
    try:
        for _ in range(30):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=IO_TIMEOUT_S))
        assert wait_until(lambda: server.http.evicted >= 10, timeout_s=IO_TIMEOUT_S)
        assert server.http.open_connections <= 20
        assert idle[0].recv(1) == b""  # the first ones were closed, quietly
        assert _raw(server.port, _head(server.port, "GET /healthz"))[0] == 200
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_thirty_simultaneous_requests_get_200_or_429_never_a_reset(node) -> None:
    server = _api(node)  # one slot (one full node) and 16 waiting: 14 of 30 are turned away
    barrier = threading.Barrier(30)

    def ask(_: int) -> tuple[int, str | None]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=IO_TIMEOUT_S)
        barrier.wait(IO_TIMEOUT_S)
        conn.request("POST", "/v1/completions", _body(max_tokens=2), {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        conn.close()
        return r.status, r.getheader("Retry-After")

    try:
        with ThreadPoolExecutor(30) as pool:
            with server.coordinator.queue.slot():  # the household's one slot is busy while they arrive
                futures = [pool.submit(ask, i) for i in range(30)]
                assert wait_until(lambda: server.coordinator.queue.depth() == (1, 16), timeout_s=IO_TIMEOUT_S)
                assert wait_until(lambda: sum(f.done() for f in futures) == 14, timeout_s=IO_TIMEOUT_S)
            answers = [f.result() for f in futures]
    finally:
        server.stop()
    assert sorted(status for status, _ in answers) == [200] * 16 + [429] * 14
    assert all(retry.isdigit() for status, retry in answers if status == 429)


def test_bodies_are_framed_strictly(api: OpenAIServer, caplog: pytest.LogCaptureFixture) -> None:
    port = api.port
    with caplog.at_level(logging.INFO):
        negative = _head(port, "POST /v1/completions", "Content-Length: -1") + _body()
        assert _raw(port, negative)[0] == 400
        status, _, body = _raw(port, _head(port, "POST /v1/completions", "Content-Length: 999999999"))
        assert status == 413 and "over" in json.loads(body)["error"]["message"]
        both = _head(port, "POST /v1/completions", "Content-Length: 5", "Transfer-Encoding: chunked")
        assert _raw(port, both)[0] == 400
        short = _head(port, "POST /v1/completions", "Content-Length: 100") + b"{}"
        assert _raw(port, short)[0] == 408  # the rest never comes: 408 after body_timeout_s, no thread held
        assert _raw(port, _head(port, "POST /v1/completions", end=False))[0] == 408  # a head never ended
        for garbage in (b"garbage\r\n\r\n", b"GET /\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"):
            assert _raw(port, garbage)[0] == 400
        assert _raw(port, _head(port, "GET /healthz", "X: " + "a" * 40000))[0] == 431
    assert not [r for r in caplog.records if r.exc_info], "a malformed request logged a traceback"


def test_an_encoded_body_is_refused_as_such(api: OpenAIServer) -> None:
    """A body under a Content-Encoding this server does not decode is a 415 that says so, not a
    400 "not JSON" (a gzipped body) nor a plain one taken as if the header were not there."""
    body = _body(max_tokens=2)
    for encoding, sent in (("gzip", gzip.compress(body)), ("gzip", body), ("br", body)):
        status, _, answer = _raw(api.port, _post(api.port, "/v1/completions", sent, f"Content-Encoding: {encoding}"))
        assert status == 415 and encoding in json.loads(answer)["error"]["message"]
    assert _raw(api.port, _post(api.port, "/v1/completions", body, "Content-Encoding: identity"))[0] == 200


def test_a_chunked_body_is_a_body_and_the_connection_goes_on(api: OpenAIServer) -> None:
    body = _body(max_tokens=2)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7))
    head = _head(api.port, "POST /v1/completions", "Transfer-Encoding: chunked")
    with socket.create_connection(("127.0.0.1", api.port), timeout=IO_TIMEOUT_S) as s:
        s.sendall(head + chunks + b"0\r\n\r\n")
        status, _, answer = _response(s)
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2
        s.sendall(_head(api.port, "GET /v1/models"))  # the same connection, the next request
        status, _, answer = _response(s)
        assert status == 200 and json.loads(answer)["data"][0]["id"] == KIMI_K3


def test_expect_100_continue_is_answered(api: OpenAIServer) -> None:
    body = _body(max_tokens=1)
    with socket.create_connection(("127.0.0.1", api.port), timeout=IO_TIMEOUT_S) as s:
        head = _post(api.port, "/v1/completions", body, "Expect: 100-continue")[: -len(body)]
        s.sendall(head)
        assert s.recv(64).startswith(b"HTTP/1.1 100 ")
        s.sendall(body)
        assert _response(s)[0] == 200


def test_a_non_streaming_client_that_leaves_stops_its_generation(node, api: OpenAIServer) -> None:
    alone = _node_tokens(node, 1000)
    assert alone >= 100  # left alone, this request generates many tokens
    before = _tokens(node)
    s = socket.create_connection(("127.0.0.1", api.port), timeout=IO_TIMEOUT_S)
    s.sendall(_post(api.port, "/v1/completions", _body(max_tokens=1000)))
    assert wait_until(lambda: _tokens(node) >= before + 3, timeout_s=IO_TIMEOUT_S, interval_s=0.01)
    s.close()  # gone before the answer
    assert wait_until(lambda: api.coordinator.queue.depth() == (0, 0), timeout_s=IO_TIMEOUT_S)
    _after_the_node_is_done(node)
    generated = _tokens(node) - before - 1
    assert generated < alone / 4, f"the node generated {generated} tokens for a client that left"


def test_a_streaming_client_that_leaves_stops_its_generation(node, api: OpenAIServer) -> None:
    alone = _node_tokens(node, 1000)
    before = _tokens(node)
    s = socket.create_connection(("127.0.0.1", api.port), timeout=IO_TIMEOUT_S)
    s.sendall(_post(api.port, "/v1/completions", _body(max_tokens=1000, stream=True)))
    seen = b""
    while b"data: " not in seen:  # the first token came
        more = s.recv(4096)
        assert more, "the stream ended before its first token"
        seen += more
    s.close()
    assert wait_until(lambda: api.coordinator.queue.depth() == (0, 0), timeout_s=IO_TIMEOUT_S)
    _after_the_node_is_done(node)
    generated = _tokens(node) - before - 1
    assert generated < alone / 4, f"the node generated {generated} tokens for a client that left"


def test_streaming_and_the_other_endpoints_still_work(api: OpenAIServer) -> None:
    c = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=IO_TIMEOUT_S)
    stream = c.chat.completions.create(
        model=KIMI_K3, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason in ("length", "stop")
    for path, status in (("/healthz", 200), ("/metrics", 200), ("/v1/models", 200), ("/nothing", 404)):
        assert _raw(api.port, _head(api.port, f"GET {path}"))[0] == status
    assert _raw(api.port, _head(api.port, "DELETE /v1/models"))[0] == 405
