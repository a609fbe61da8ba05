"""The coordinator's OpenAI-compatible API, driven by the official `openai` client against a real
node on loopback: streamed chat, completions equal to mlx-lm, stop sequences, finish reasons,
usage, OpenAI-shaped 4xx errors, a bounded queue answering 429, and failover to another node."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from lazy_import import lazy_import
from nodes import api_server, serving
from repos import KIMI_K3

from expertmesh.coordinator.openai_api import OpenAIServer
from expertmesh.node.rpc.client import NodeClient
from expertmesh.v1 import node_pb2

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "api-test-secret"
PROMPT = "The household answers"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cache?"}]


@pytest.fixture(scope="module")
def node(module_home):
    with serving(KIMI_K3, module_home, SECRET, node_id="api-node") as node:
        yield node.rpc.address


def _api(addresses: list[str], max_waiting: int = 16) -> OpenAIServer:
    return api_server(addresses, SECRET, [KIMI_K3], max_waiting)


@pytest.fixture(scope="module")
def api(node):
    server = _api([node])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def completion_text(oracle) -> str:
    return oracle.text("kimi_k3", PROMPT, 16)


def _node_chat_text(address: str, max_tokens: int) -> str:
    """The node's own Generate for MESSAGES, greedy: what the API must pass through unchanged."""
    req = node_pb2.GenerateRequest(model=node_pb2.ModelKey(repo_id=KIMI_K3), max_tokens=max_tokens, temperature=0.0)
    req.messages.extend(node_pb2.ChatMessage(**m) for m in MESSAGES)
    with NodeClient(address, SECRET) as client:
        events = list(client.generate(req, timeout=120))
    return "".join(e.token.text for e in events if e.HasField("token")) + events[-1].done.trailing_text


def test_a_streamed_chat_completion_through_the_official_client(client: openai.OpenAI, node) -> None:
    stream = client.chat.completions.create(
        model=KIMI_K3,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _node_chat_text(node, 12)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    usage = chunks[-1].usage
    # as OpenAI streams: every chunk carries `usage`, null but in the last, which has no choices
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_completion_equals_mlx_lm(client: openai.OpenAI, completion_text: str) -> None:
    r = client.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == completion_text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 0
    models = client.models.list()
    assert [m.id for m in models.data] == [KIMI_K3]


def test_a_stop_sequence_cuts_the_text_and_ends_the_generation(client: openai.OpenAI, completion_text: str) -> None:
    stop = completion_text[6:9]
    expected = completion_text[: completion_text.find(stop)]
    r = client.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "never-seen"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16  # the node stopped generating at the stop sequence
    streamed = client.completions.create(
        model=KIMI_K3, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_bad_requests_get_4xx_with_a_readable_message(client: openai.OpenAI, api: OpenAIServer) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=KIMI_K3, messages=[])
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="someone/else", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=KIMI_K3, prompt="x", temperature=5)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=KIMI_K3, prompt="x", max_tokens=0)
    base = api.url.removesuffix("/v1")
    req = urllib.request.Request(
        f"{base}/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as bad_json:
        urllib.request.urlopen(req, timeout=30)
    assert bad_json.value.code == 400
    assert "not valid JSON" in json.load(bad_json.value)["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as unknown:
        urllib.request.urlopen(f"{base}/v2/nothing", timeout=30)
    assert unknown.value.code == 404 and "error" in json.load(unknown.value)
    with urllib.request.urlopen(f"{base}/healthz", timeout=30) as r:
        assert json.load(r)["status"] == "ok"


def test_a_full_queue_answers_429_with_retry_after(node) -> None:
    server = _api([node], max_waiting=0)
    try:
        with server.coordinator.queue.slot():  # the household's one slot is taken
            busy = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
            with pytest.raises(openai.RateLimitError, match="busy") as e:
                busy.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=2)
            assert e.value.response.headers["retry-after"].isdigit()
        r = busy.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=2, temperature=0)  # the slot is free again
        assert r.usage.completion_tokens == 2
    finally:
        server.stop()


def test_a_dead_node_is_passed_over_before_the_first_token(node, completion_text: str) -> None:
    server = _api(["127.0.0.1:1", node])  # the first node listed answers nothing
    try:
        c = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=16, temperature=0)
        assert r.choices[0].text == completion_text
        with urllib.request.urlopen(server.url.removesuffix("/v1") + "/healthz", timeout=30) as h:
            assert json.load(h)["full_nodes"] == 1
    finally:
        server.stop()
    nobody = _api(["127.0.0.1:1"])
    try:
        c = openai.OpenAI(base_url=nobody.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="no full node"):
            c.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=2)
    finally:
        nobody.stop()


def test_status_shows_the_node_and_the_uses_by_source(node, client: openai.OpenAI, monkeypatch, capsys) -> None:
    from expertmesh.cli import main

    client.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=4, temperature=0)
    monkeypatch.setenv("EXPERTMESH_SECRET", SECRET)
    assert main(["status", "--no-discovery", "--peer", node]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("api-node"))
    assert " full " in row and KIMI_K3 in row
    with NodeClient(node, SECRET) as c:
        info = c.info(timeout=30)
    assert info.generated_tokens >= 4 and f" {info.generated_tokens} " in row
    assert f"of {sum(info.expert_uses.values())};" in out  # the household line sums the nodes' own counts
    assert main(["status", "--no-discovery", "--peer", node, "--peer", "127.0.0.1:1"]) == 1
    assert "(unavailable)" in capsys.readouterr().out


def test_the_coordinators_metrics_count_responses_by_status(api: OpenAIServer, client: openai.OpenAI) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=KIMI_K3, prompt="")
    with urllib.request.urlopen(api.url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    counts = {
        (s.labels["endpoint"], s.labels["code"]): s.value
        for s in families["expertmesh_api_responses"].samples
        if s.name.endswith("_total")
    }
    assert counts[("/v1/completions", "200")] >= 1 and counts[("/v1/completions", "400")] >= 1
    assert not any("prompt" in k for key in counts for k in key)  # endpoints and codes only
    states = {s.labels["state"]: s.value for s in families["expertmesh_api_generations"].samples}
    assert states == {"running": 0.0, "waiting": 0.0}


def test_a_stream_is_kept_alive_with_comments_while_the_prompt_is_prefilled(
    api: OpenAIServer, client: openai.OpenAI, completion_text: str, monkeypatch
) -> None:
    from expertmesh.coordinator import openai_api

    # a cold prompt at K3's size takes minutes; here any prefill outlasts the interval
    monkeypatch.setattr(openai_api, "SSE_KEEPALIVE_S", 0.005)
    body = {"model": KIMI_K3, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        api.url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    first_data = next(i for i, e in enumerate(events) if e.startswith("data: "))
    assert first_data > 0 and all(e.startswith(": ") for e in events[:first_data])
    assert all(e.startswith("data: ") for e in events[first_data:])
    # the official client skips the comments: the same text as without them
    stream = client.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == completion_text
