"""Who may use the API (issue 22): a node whose API listens beyond loopback (0.0.0.0, reached here
through 127.0.0.1) creates an API key in its home and refuses requests without it, with a wrong
one, from a foreign web origin or for a Host that is not this machine (DNS rebinding); the
official `openai` client works with the key; on loopback without keys the API stays open."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import stat
from pathlib import Path

import pytest
from lazy_import import lazy_import
from repos import KIMI_K3

from expertmesh.assembly import build_node
from expertmesh.coordinator.api_access import AccessPolicy, KeyRing, api_keys_path, ensure_api_key
from expertmesh.coordinator.http_server import Request
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer
from expertmesh.node.config import ApiConfig, HouseholdConfig, NodeConfig, RpcConfig, StoreConfig

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "api-access-test-secret"
IO_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def node(module_home: Path, hub):
    """A node as `serve --http-host 0.0.0.0` makes it: the API through build_node's own assembly."""
    config = NodeConfig(
        KIMI_K3,
        home=module_home,
        node_id="api-access-node",
        store=StoreConfig(prefetch=False),
        household=HouseholdConfig(secret=SECRET),
        rpc=RpcConfig(host="127.0.0.1", port=0),
        api=ApiConfig(host="0.0.0.0", port=0, allowed_hosts=["household.example"]),
    )
    with build_node(config).start() as node:
        yield node


@pytest.fixture(scope="module")
def key(node, module_home: Path) -> str:
    path = api_keys_path(module_home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # created by the node, for its owner only
    (key,) = path.read_text().split()
    return key


def _get(port: int, path: str, headers: dict[str, str]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=IO_TIMEOUT_S)
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def _post(port: int, path: str, body: dict, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=IO_TIMEOUT_S)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "text/plain", **headers})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def test_the_official_client_works_with_the_key(node, key: str) -> None:
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{node.api.port}/v1", api_key=key, max_retries=0, timeout=IO_TIMEOUT_S)
    assert [m.id for m in c.models.list().data] == [KIMI_K3]
    r = c.chat.completions.create(
        model=KIMI_K3, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    assert r.usage.completion_tokens > 0
    assert "api key" in node.api.access.describe().lower() and key not in node.api.access.describe()


def test_no_key_or_a_wrong_key_is_refused(node, key: str) -> None:
    base = f"http://127.0.0.1:{node.api.port}/v1"
    wrong = openai.OpenAI(base_url=base, api_key=key[:-1] + "x", max_retries=0, timeout=IO_TIMEOUT_S)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.completions.create(model=KIMI_K3, prompt="x", max_tokens=1)
    host = {"Host": f"127.0.0.1:{node.api.port}"}
    for path in ("/v1/models", "/metrics"):
        status, body = _get(node.api.port, path, host)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert _get(node.api.port, "/v1/models", {**host, "Authorization": key})[0] == 401  # not "Bearer KEY"
    assert _get(node.api.port, "/healthz", host)[0] == 200  # a health probe holds no key


def test_a_foreign_origin_is_refused_even_with_the_key(node, key: str) -> None:
    port = node.api.port
    auth = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {key}"}
    ask = {"model": KIMI_K3, "prompt": "x", "max_tokens": 1}
    for origin in ("http://evil.example", "null", f"https://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"):
        assert _post(port, "/v1/completions", ask, {**auth, "Origin": origin}) == 403, origin
        assert _get(port, "/healthz", {**auth, "Origin": origin})[0] == 403, origin
    assert _get(port, "/v1/models", {**auth, "Origin": f"http://127.0.0.1:{port}"})[0] == 200  # its own page


def test_a_host_that_is_not_this_machine_is_refused(node, key: str) -> None:
    port = node.api.port
    auth = {"Authorization": f"Bearer {key}"}
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1", f"127.0.0.1:{port + 1}", "[::1"):
        status, body = _get(port, "/v1/models", {**auth, "Host": host})
        assert status == 403 and body["error"]["code"] == "forbidden_host", host
    assert _get(port, "/healthz", {"Host": f"evil.example:{port}"})[0] == 403  # rebinding cannot even probe
    name = socket.gethostname().split(".")[0]
    for host in ("localhost", "127.0.0.1", name, f"{name}.local", "household.example"):
        assert _get(port, "/v1/models", {**auth, "Host": f"{host}:{port}"})[0] == 200, host


def test_no_key_is_ever_logged(node, key: str, caplog: pytest.LogCaptureFixture) -> None:
    port = node.api.port
    with caplog.at_level(logging.DEBUG):
        _get(port, "/v1/models", {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {key}"})
        _get(port, "/v1/models", {"Host": f"127.0.0.1:{port}", "Authorization": "Bearer not-the-key"})
    assert caplog.records and key not in caplog.text and "not-the-key" not in caplog.text


def test_keys_are_read_again_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "api-keys"
    assert ensure_api_key(path) and not ensure_api_key(path)  # one key, made once
    ring = KeyRing(path)
    (first,) = path.read_text().split()
    assert ring.accepts(first) and not ring.accepts("em-other")
    path.write_text(f"# the kitchen tablet\n{first}\nem-other-and-longer\n")
    assert ring.accepts("em-other-and-longer")
    path.write_text("em-other-and-longer\n")  # the first key revoked
    assert not ring.accepts(first)
    os.remove(path)
    assert not ring.accepts("em-other-and-longer") and not ring


def test_beyond_loopback_the_api_never_runs_open(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs API keys"):
        AccessPolicy("0.0.0.0")
    with pytest.raises(ValueError, match="needs API keys"):
        AccessPolicy("192.168.1.20", KeyRing(tmp_path / "api-keys"))  # a key file with no key
    assert not AccessPolicy("127.0.0.1").needs_key and not AccessPolicy("::1").needs_key


def test_on_loopback_a_configured_key_is_required_too(tmp_path: Path) -> None:
    path = tmp_path / "api-keys"
    policy = AccessPolicy("127.0.0.1", KeyRing(path))

    def ask(authorization: str) -> object:
        headers = {"host": "127.0.0.1:8000", "authorization": authorization}
        return policy.refusal(Request("GET", "/v1/models", "", headers, "1.1", "127.0.0.1:5", "127.0.0.1"), 8000)

    assert ask("") is None  # no key configured: open to this machine
    ensure_api_key(path)
    assert ask("").status == 401 and ask(f"Bearer {path.read_text().strip()}") is None


def test_loopback_without_keys_stays_open_to_any_client() -> None:
    config = CoordinatorConfig(secret=SECRET, models=lambda: [KIMI_K3])
    server = OpenAIServer(Coordinator(config, NodePool([])), "127.0.0.1", 0).start()
    try:
        c = openai.OpenAI(base_url=server.url, api_key="anything", max_retries=0, timeout=IO_TIMEOUT_S)
        assert [m.id for m in c.models.list().data] == [KIMI_K3]
    finally:
        server.stop()


def test_each_key_has_its_own_prefix_space_in_either_header() -> None:
    """The space a request's stored prefixes live in is its key's, whichever header carries it
    (OpenAI's Bearer, Anthropic's x-api-key), never another key's, and never the key itself."""
    one, two = "em-space-one-0123456789", "em-space-two-0123456789"
    policy = AccessPolicy("127.0.0.1", KeyRing(keys=[one, two]))

    def space(**headers: str) -> str:
        return policy.prefix_space(Request("POST", "/v1/messages", "", headers, "1.1", "127.0.0.1:5", "127.0.0.1"))

    assert space(authorization=f"Bearer {one}") == space(**{"x-api-key": one}) != ""
    assert space(**{"x-api-key": two}) not in (space(**{"x-api-key": one}), "")
    assert one not in space(authorization=f"Bearer {one}")
    assert AccessPolicy("127.0.0.1").prefix_space(Request("POST", "/v1/messages", "", {}, "1.1", "a", "b")) == ""
