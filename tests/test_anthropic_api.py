"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by the official
`anthropic` client: the same answers as the chat completions endpoint, its streaming events in
Anthropic's order, its error shape for 400, 401, 413 and 429, the same keys through `x-api-key`, and
every request field honoured or refused by name."""

from __future__ import annotations

import http.client
import json
import socket

import pytest
from lazy_import import lazy_import
from nodes import api_server, node_with_api, serving
from repos import JSON_TOOLS, KIMI_K3
from tool_forcing import FORCE_MARK, ForcingService

from expertmesh.coordinator import anthropic_request
from expertmesh.coordinator.api_access import AccessPolicy, KeyRing
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer
from expertmesh.node.engine.chat import chat_token_ids

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)
anthropic = lazy_import("anthropic")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "anthropic-test-secret"
KEY = "em-test-key-0123456789"
QUESTION = "What is a cache?"
SYSTEM = "You answer briefly."


@pytest.fixture(scope="module")
def node(module_home):
    with serving(KIMI_K3, module_home, SECRET, node_id="anthropic-node") as served:
        yield served


@pytest.fixture(scope="module")
def api(node):
    server = api_server([node.rpc.address], SECRET, [KIMI_K3])
    try:
        yield server
    finally:
        server.stop()


def _base(server: OpenAIServer) -> str:
    return f"http://{server.host}:{server.port}"


@pytest.fixture(scope="module")
def client(api) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=_base(api), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_answer(api) -> str:
    c = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    r = c.chat.completions.create(model=KIMI_K3, messages=messages, max_tokens=8, temperature=0)
    return r.choices[0].message.content


def _create(client: anthropic.Anthropic, **kwargs):
    kwargs = {"model": KIMI_K3, "max_tokens": 8, "system": SYSTEM, "extra_body": {"temperature": 0}, **kwargs}
    return client.messages.create(messages=[{"role": "user", "content": QUESTION}], **kwargs)


def test_a_message_is_the_chat_completions_answer(client: anthropic.Anthropic, chat_answer: str) -> None:
    m = _create(client)
    assert m.type == "message" and m.role == "assistant" and m.model == KIMI_K3 and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat_answer
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0 and m.usage.input_tokens > 0


def test_content_blocks_and_a_system_list_are_text(client: anthropic.Anthropic, chat_answer: str) -> None:
    m = client.messages.create(
        model=KIMI_K3,
        max_tokens=8,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        extra_body={"temperature": 0},
    )
    assert m.content[0].text == chat_answer


def test_streaming_events_come_in_anthropics_order(client: anthropic.Anthropic, chat_answer: str) -> None:
    with client.messages.stream(
        model=KIMI_K3, max_tokens=8, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0},
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    raw = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_delta",
                                     "content_block_stop", "message_delta", "message_stop")]  # fmt: skip
    deltas = raw.count("content_block_delta")
    assert raw == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                   "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert deltas > 0 and final.content[0].text == chat_answer
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0


def test_the_ping_comes_after_the_first_block_starts(api: OpenAIServer) -> None:
    body = {"model": KIMI_K3, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    status, text = _raw(api, "/v1/messages", body)
    names = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    assert status == 200 and names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]


def test_a_stream_is_kept_alive_with_pings_while_the_prompt_is_prefilled(
    api: OpenAIServer, client: anthropic.Anthropic, chat_answer: str, monkeypatch
) -> None:
    """A cold prompt at K3's size takes minutes before its first token; a Messages stream sent
    nothing until then (a chat stream has its keep-alive comments), so a client or proxy with an
    idle timeout gave it up. Now the stream starts with message_start and pings meanwhile."""
    from expertmesh.coordinator import openai_api

    monkeypatch.setattr(openai_api, "SSE_KEEPALIVE_S", 0.005)  # here any prefill outlasts the interval
    body = {"model": KIMI_K3, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    status, text = _raw(api, "/v1/messages", body)
    names = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    opened = names.index("content_block_start")
    assert status == 200 and names[0] == "message_start" and set(names[1:opened]) == {"ping"} and opened > 1
    assert names[-2:] == ["message_delta", "message_stop"]
    # the official client skips the pings: the same text, and the prompt's tokens, counted after
    # message_start went out, come in message_delta
    with client.messages.stream(
        model=KIMI_K3, max_tokens=8, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.content[0].text == chat_answer
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0 and final.usage.output_tokens > 0


def test_a_stop_sequence_is_named_in_the_stop_reason(client: anthropic.Anthropic, chat_answer: str) -> None:
    stop = chat_answer[2:4]
    m = _create(client, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == chat_answer[: chat_answer.index(stop)]


def test_count_tokens_counts_the_templated_prompt(client: anthropic.Anthropic, oracle) -> None:
    counted = client.messages.count_tokens(
        model=KIMI_K3, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    _, tokenizer = oracle.load("kimi_k3")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    assert counted.input_tokens == len(chat_token_ids(tokenizer, messages))
    usage = _create(client).usage  # what the prefix cache held is counted apart, as Anthropic does
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens


def test_count_tokens_while_every_node_counts_already_is_a_429(api: OpenAIServer, node) -> None:
    """A node counts COUNT_CALLS at once and refuses more as busy; with every node busy the API
    answers 429 with Retry-After in Anthropic's shape (a burst for the client to pace), not a 503."""
    slots = node.service.count_slots
    held = [slots.enter() for _ in range(slots.capacity)]
    try:
        assert all(held)
        conn = http.client.HTTPConnection(api.host, api.port, timeout=120)
        body = {"model": KIMI_K3, "messages": [{"role": "user", "content": QUESTION}]}
        conn.request(
            "POST", "/v1/messages/count_tokens", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        answer = json.loads(r.read())
        conn.close()
    finally:
        for _ in held:
            slots.leave()
    assert r.status == 429 and r.getheader("Retry-After", "").isdigit(), answer
    assert answer["type"] == "error" and answer["error"]["type"] == "rate_limit_error"


def _billing(cch: str) -> dict:
    """Claude Code's first system block, whose `cch=` changes on every request."""
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch={cch};"}


def test_a_billing_line_that_changes_does_not_defeat_prefix_reuse(client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "You are a coding agent. " * 12}]
    usages = [_create(client, system=[_billing(cch), *system]).usage for cch in ("1f2e3", "9a8b7")]
    assert usages[0].cache_read_input_tokens == 0  # this system prompt is new to the node
    prompt = usages[1].input_tokens + usages[1].cache_read_input_tokens
    assert usages[1].cache_read_input_tokens > prompt // 2, usages


def test_only_the_billing_line_that_opens_a_system_block_is_dropped() -> None:
    later = "Quote this: x-anthropic-billing-header: cch=1;"
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": _billing("1")["text"]}],
            "system": [_billing("1f2e3"), {"type": "text", "text": _billing("2")["text"] + "\nBe brief.\n" + later}]}  # fmt: skip
    chat = anthropic_request.openai_body(body)["messages"]
    assert chat == [{"role": "system", "content": "Be brief.\n" + later}, body["messages"][0]]
    alone = anthropic_request.openai_body({**body, "system": _billing("3")["text"]})["messages"]
    assert alone == body["messages"]  # a system of the billing line alone is no system


def test_messages_are_counted_under_their_own_endpoint(client: anthropic.Anthropic, api: OpenAIServer) -> None:
    from prometheus_client import generate_latest

    _create(client)
    text = generate_latest(api.coordinator.metrics.registry).decode()
    assert 'expertmesh_api_responses_total{code="200",endpoint="/v1/messages"}' in text


def test_errors_come_in_anthropics_shape(client: anthropic.Anthropic, api: OpenAIServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=KIMI_K3, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="someone/else", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"


def test_a_prefilled_assistant_turn_is_a_400_not_a_new_answer(client: anthropic.Anthropic) -> None:
    """Anthropic continues a conversation's final assistant message (a prefill: `{` to get JSON);
    the template here would close that turn and answer afresh, which was served as a 200."""
    prefilled = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The answer is"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=KIMI_K3, max_tokens=2, messages=prefilled)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[1]" in e.value.body["error"]["message"] and "prefill" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        with client.messages.stream(model=KIMI_K3, max_tokens=2, messages=prefilled) as stream:
            stream.get_final_message()


def _refused(api: OpenAIServer, path: str, *headers: str, body: bytes = b"") -> tuple[int, dict]:
    """The HTTP server's answer to a request head (and `body`) it refuses before any API reads it."""
    head = "".join(f"{h}\r\n" for h in (f"POST {path} HTTP/1.1", f"Host: {api.host}:{api.port}", *headers))
    with socket.create_connection((api.host, api.port), timeout=60) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, json.loads(r.read())


def test_refusals_of_the_http_server_come_in_anthropics_shape(api: OpenAIServer) -> None:
    """A body over the cap, or a malformed one, is refused by the HTTP server before any API sees
    it; on /v1/messages it came in OpenAI's shape, without the `error.type` Anthropic's clients
    read (`request_too_large` for a 413)."""
    status, body = _refused(api, "/v1/messages", "Content-Length: 999999999")
    assert status == 413 and body["type"] == "error" and body["error"]["type"] == "request_too_large"
    status, body = _refused(api, "/v1/messages/count_tokens", "Transfer-Encoding: chunked", body=b"zz\r\n")
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "malformed" in body["error"]["message"]
    # the OpenAI API keeps its own shape
    status, body = _refused(api, "/v1/chat/completions", "Content-Length: 999999999")
    assert status == 413 and body["error"]["type"] == "invalid_request_error" and "over" in body["error"]["message"]


def test_a_full_queue_is_a_429_rate_limit_error(node) -> None:
    config = CoordinatorConfig(secret=SECRET, models=lambda: [KIMI_K3], max_waiting=0)
    server = OpenAIServer(Coordinator(config, NodePool([node.rpc.address])), "127.0.0.1", 0).start()
    try:
        c = anthropic.Anthropic(base_url=_base(server), api_key="unused", max_retries=0, timeout=60)
        with server.coordinator.queue.slot():  # the household's one slot is taken
            with pytest.raises(anthropic.RateLimitError) as e:
                c.messages.create(model=KIMI_K3, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "rate_limit_error"
        assert e.value.response.headers["retry-after"].isdigit()
    finally:
        server.stop()


def test_the_same_keys_work_through_x_api_key_or_authorization(node) -> None:
    config = CoordinatorConfig(secret=SECRET, models=lambda: [KIMI_K3])
    access = AccessPolicy("127.0.0.1", KeyRing(keys=[KEY]))
    server = OpenAIServer(Coordinator(config, NodePool([node.rpc.address])), "127.0.0.1", 0, access=access).start()
    try:
        ask = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert anthropic.Anthropic(base_url=_base(server), api_key=KEY, max_retries=0).messages.create(**ask).content
        bearer = anthropic.Anthropic(base_url=_base(server), auth_token=KEY, max_retries=0)
        assert bearer.messages.create(**ask).content
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=_base(server), api_key=KEY + "x", max_retries=0).messages.create(**ask)
        assert e.value.body["error"]["type"] == "authentication_error" and KEY not in str(e.value.body)
        c = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
        assert c.chat.completions.create(model=KIMI_K3, messages=ask["messages"], max_tokens=2).choices
    finally:
        server.stop()


def test_tools_are_translated_to_the_chat_apis_shapes() -> None:
    tool = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}
    body = anthropic_request.openai_body(
        {
            "model": KIMI_K3,
            "max_tokens": 4,
            "tools": [tool],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}],
                },  # fmt: skip
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                        {"type": "text", "text": "thanks"},
                    ],
                },  # fmt: skip
            ],
        }
    )
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object"}, "description": "Weather"},
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    }
    assert body["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "thanks"},
    ]


def test_tool_calls_in_an_answer_become_tool_use_blocks() -> None:
    from expertmesh.coordinator.anthropic_api import EventStream, message
    from expertmesh.coordinator.generation import Finish, Usage

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    completion = {"choices": [{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}]}
    m = message(completion, Finish("tool_calls"), Usage(3, 2), KIMI_K3, "msg_1")
    assert m["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}]
    assert m["stop_reason"] == "tool_use"
    events = EventStream(KIMI_K3, "msg_1", Usage(3, 2))
    streamed = events.start()
    for delta in ({"content": "ok"}, {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"x"'}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}):  # fmt: skip
        streamed += events.chunk({"choices": [{"delta": delta, "finish_reason": None}]})
    streamed += events.chunk({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    streamed += events.end(Finish("tool_calls"))
    names = [n for n, _ in streamed]
    assert names == ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    assert streamed[5][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert streamed[-2][1]["delta"]["stop_reason"] == "tool_use"


# -- every field -------------------------------------------------------------------------------

REFUSED = {
    "container": "c1",
    "diagnostics": {"x": 1},
    "inference_geo": "eu",
    "output_config": {"effort": "high"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "service_tier": "priority",
    "speed": "fast",
    "not_a_field": 1,
}


def test_the_table_covers_every_field_of_the_schema() -> None:
    from anthropic.types import message_create_params

    schema = set(message_create_params.MessageCreateParamsBase.__annotations__) | {"stream"}
    classified = anthropic_request.HONOURED | anthropic_request.CALLER_FIELDS | set(REFUSED)
    assert schema <= classified, f"fields neither honoured nor refused: {sorted(schema - classified)}"


def _raw(api: OpenAIServer, path: str, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection(api.host, api.port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize("field", list(REFUSED))
def test_a_field_not_honoured_is_a_400_naming_it(api: OpenAIServer, field: str) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: REFUSED[field]}
    status, text = _raw(api, "/v1/messages", body)
    answer = json.loads(text)
    assert status == 400 and answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert f"'{field}'" in answer["error"]["message"]


def test_caller_fields_and_neutral_values_are_accepted(api: OpenAIServer) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"}, "service_tier": "auto",
            "top_k": 5, "top_p": 0.9, "temperature": 0.5}  # fmt: skip
    assert _raw(api, "/v1/messages", body)[0] == 200


@pytest.mark.parametrize(("field", "value"), [("metadata", "u"), ("metadata", {"user_id": 5}), ("cache_control", [])])
def test_a_caller_field_of_another_type_is_a_400_naming_it(api: OpenAIServer, field: str, value) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value}
    status, text = _raw(api, "/v1/messages", body)
    assert status == 400 and f"'{field}'" in json.loads(text)["error"]["message"], text


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("temperature", 1.5, "from 0 to 1"),  # Anthropic's range, not the chat request's 0 to 2
        ("temperature", True, "from 0 to 1"),
        ("stop_sequences", [1], "'stop_sequences'"),  # not the chat request's 'stop'
        ("stop_sequences", [""], "'stop_sequences'"),
    ],
)
def test_a_sampling_field_out_of_anthropics_terms_is_a_400_in_them(api: OpenAIServer, field: str, value, said) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value}
    status, text = _raw(api, "/v1/messages", body)
    message = json.loads(text)["error"]["message"]
    assert status == 400 and said in message and f"'{field}'" in message, text


@pytest.mark.parametrize("content", ["", []])
def test_a_message_of_nothing_is_a_400(api: OpenAIServer, content) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    status, text = _raw(api, "/v1/messages", body)
    assert status == 400 and "non-empty content" in json.loads(text)["error"]["message"], text


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}], "image"),
        ([{"type": "thinking", "thinking": "x", "signature": "s"}], "thinking"),
        ([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "tool_result"),  # a user's tool_use
    ],
)
def test_blocks_that_are_not_text_are_refused_by_name(api: OpenAIServer, content: list, named: str) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    status, text = _raw(api, "/v1/messages", body)
    assert status == 400 and named in json.loads(text)["error"]["message"]


TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def tools_client(tool_repos, pulled_home, hub, tmp_path_factory):
    """An anthropic client of a node serving the `json_tools` family, whose sampler writes the
    text after "FORCE:" (tests/tool_forcing.py): random tiny weights never write a call."""
    hub.rescan()  # the module's Hub may have started before the tool repos were written
    home = pulled_home(JSON_TOOLS.split("tiny-", 1)[1], tmp_path_factory.mktemp("anthropic-tools"))
    with node_with_api(JSON_TOOLS, home, SECRET, "anthropic-tools", service_class=ForcingService) as server:
        yield anthropic.Anthropic(base_url=_base(server), api_key="unused", max_retries=0, timeout=120)


def test_a_tool_use_and_its_tool_result_make_a_round_trip(tools_client: anthropic.Anthropic) -> None:
    """The model's call (forced through its sampler) comes back as a tool_use block, whole and
    streamed; the tool_result sent back is rendered by the template and the next turn answers."""
    ask = {"model": JSON_TOOLS, "max_tokens": 240, "tools": [WEATHER_TOOL], "system": "Be brief."}
    first = [{"role": "user", "content": FORCE_MARK + "Sure. " + TOOL_CALL}]
    whole = tools_client.messages.create(**ask, messages=first)
    assert whole.stop_reason == "tool_use"
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})]
    assert all("<tool_call>" not in b.text for b in whole.content if b.type == "text")

    with tools_client.messages.stream(**ask, messages=first) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [("get_weather", {"city": "Paris"})]

    follow = [
        *first,
        {"role": "assistant", "content": [u.model_dump(exclude_none=True) for u in uses]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"},
                {"type": "text", "text": FORCE_MARK + "It is sunny."},
            ],
        },
    ]
    answer = tools_client.messages.create(**ask, messages=follow)
    assert answer.stop_reason == "end_turn"
    assert [b.text for b in answer.content if b.type == "text"] == ["It is sunny."]
    counted = tools_client.messages.count_tokens(model=JSON_TOOLS, tools=[WEATHER_TOOL], messages=follow)
    without_result = tools_client.messages.count_tokens(model=JSON_TOOLS, tools=[WEATHER_TOOL], messages=first)
    assert counted.input_tokens > without_result.input_tokens  # the tool result is in the prompt
