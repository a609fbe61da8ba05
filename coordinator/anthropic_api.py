"""Anthropic's Messages API shapes, made from the OpenAI shapes openai_api.py builds.

A whole answer is OpenAI's chat completion turned into a `message` (text and `tool_use` blocks);
a stream is OpenAI's chunks turned into Anthropic's events, in its order: `message_start`,
`content_block_start`, `ping`, `content_block_delta`..., `content_block_stop`, then
`message_delta` (stop reason, output tokens) and `message_stop`. Working from the OpenAI shapes
means whatever the chat completions endpoint learns to return (tool calls) reaches this API too.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from expertmesh.coordinator.generation import Finish, Usage
from expertmesh.coordinator.openai_request import ApiError

# OpenAI's finish_reason -> Anthropic's stop_reason
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Anthropic's error types by HTTP status (its API reference, "Errors")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


# Anthropic's keep-alive event: its streams "may include any number of" them, and clients skip them
PING = {"type": "ping"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def _stop(finish: Finish) -> tuple[str, str | None]:
    if finish.stop_sequence is not None:
        return "stop_sequence", finish.stop_sequence
    return STOP_REASONS.get(finish.reason, "end_turn"), None


def _usage(usage: Usage, output: bool = True) -> dict:
    """Anthropic's usage: its `input_tokens` are those not read from a cache, and
    `cache_read_input_tokens` those the node's prefix cache held (OpenAI's `cached_tokens`)."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens if output else 0,
    }


def _tool_use(call: dict) -> dict:
    """An OpenAI tool call as a tool_use block (arguments that are not a JSON object stay as
    text under `input`, so nothing the model wrote is dropped)."""
    function = call.get("function", {})
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = {"arguments": function.get("arguments")}
    return {"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": arguments}


def message(completion: dict, finish: Finish, usage: Usage, model: str, mid: str) -> dict:
    """A whole answer: OpenAI's chat completion as an Anthropic message."""
    reply = completion["choices"][0]["message"]
    blocks = [{"type": "text", "text": reply["content"]}] if reply.get("content") else []
    blocks += [_tool_use(call) for call in reply.get("tool_calls") or []]
    stop_reason, stop_sequence = _stop(Finish(completion["choices"][0]["finish_reason"], finish.stop_sequence))
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks or [{"type": "text", "text": ""}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(usage),
    }


class EventStream:
    """OpenAI's chunks in, Anthropic's events out, as (event name, data) pairs."""

    def __init__(self, model: str, mid: str, usage: Usage):
        self.model, self.mid, self.usage = model, mid, usage
        self._block: int = -1  # the index of the open content block, -1 before the first
        self._kind: str | None = None  # "text" or the OpenAI index of the tool call it holds
        self._finish: str = "stop"

    def start(self) -> list[tuple[str, dict]]:
        body: dict = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": _usage(self.usage, output=False)}  # fmt: skip
        return [("message_start", {"type": "message_start", "message": body})]

    def _open(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self._block += 1
        self._kind = kind
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": self._block, "content_block": block})
        )
        if self._block == 0:  # Anthropic pings once the first block is open
            events.append(("ping", PING))
        return events

    def _close(self) -> list[tuple[str, dict]]:
        if self._kind is None:
            return []
        self._kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": delta})

    def chunk(self, chunk: dict) -> list[tuple[str, dict]]:
        """The events of one OpenAI chunk."""
        events: list[tuple[str, dict]] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content"):
                if self._kind != "text":
                    events += self._open("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                kind = f"tool{call.get('index', 0)}"
                function = call.get("function") or {}
                if self._kind != kind:
                    block = {"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": {}}
                    events += self._open(kind, block)
                if function.get("arguments"):
                    events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def end(self, finish: Finish) -> list[tuple[str, dict]]:
        events = self._open("text", {"type": "text", "text": ""}) if self._block < 0 else []  # never no block
        events += self._close()
        stop_reason, stop_sequence = _stop(Finish(self._finish, finish.stop_sequence))
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        # the whole usage, as Anthropic's message_delta carries it (cumulative; its clients take
        # each count given): a stream kept alive through a long prefill started before the
        # prompt's tokens were counted, so its message_start said 0 input tokens
        usage = _usage(self.usage)
        events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def count_body(tokens: int) -> dict:
    return {"input_tokens": tokens}


def not_allowed(method: str, path: str) -> ApiError:
    return ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not allowed on {path}")
