"""An OpenAI request body, checked the way the OpenAI API checks it, and the Generate call it becomes.

Every field a client may send is validated here, with a message that names the field, so the
official clients raise their usual exceptions with our reason; what reaches a node is a
`GenerateRequest` with sane values only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from expertmesh.v1 import node_pb2

MAX_TOKENS_LIMIT = 32768  # as the node's own limit
MAX_STOPS = 4  # as OpenAI's


class ApiError(Exception):
    """A request the API refuses, in OpenAI's error shape."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Ask:
    """A validated completion request."""

    model: str
    chat: bool
    prompt: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(HTTPStatus.BAD_REQUEST, f"'{name}' must be {kind} from {lo:g} to {hi:g}", param=name)
    return value


def parse_ask(body: Any, chat: bool, models: list[str], default_max_tokens: int) -> Ask:
    """Check a request body the way the OpenAI API does, with a message that says what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'model' is required: one of " + ", ".join(models), param="model")
    if model not in models:
        raise ApiError(
            HTTPStatus.NOT_FOUND,
            f"the model '{model}' is not served here; models: {', '.join(models) or 'none'}",
            param="model",
            code="model_not_found",
        )
    ask = Ask(model=model, chat=chat)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(HTTPStatus.BAD_REQUEST, "'messages' must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or m.get("role") not in ("system", "user", "assistant")
                or not isinstance(m.get("content"), str)
            ):
                raise ApiError(
                    HTTPStatus.BAD_REQUEST,
                    f"messages[{i}] must have a role (system, user or assistant) and a string content",
                    param="messages",
                )
            ask.messages.append({"role": m["role"], "content": m["content"]})
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(HTTPStatus.BAD_REQUEST, "'prompt' must be a non-empty string", param="prompt")
        ask.prompt = prompt
    if _number(body, "n", 1, 1, 1, integer=True) != 1:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'n' must be 1", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    ask.max_tokens = _number(
        {"max_tokens": max_tokens}, "max_tokens", default_max_tokens, 1, MAX_TOKENS_LIMIT, integer=True
    )
    ask.temperature = float(_number(body, "temperature", 1.0, 0, 2))
    ask.top_p = float(_number(body, "top_p", 1.0, 0, 1))
    seed = body.get("seed")
    if seed is not None:
        ask.seed = _number(body, "seed", None, -(2**63), 2**63 - 1, integer=True)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings",
            param="stop",
        )
    ask.stop = stops
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'stream' must be true or false", param="stream")
    ask.stream = stream
    options = body.get("stream_options") or {}
    ask.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    return ask


def generate_request(ask: Ask) -> node_pb2.GenerateRequest:
    req = node_pb2.GenerateRequest(
        model=node_pb2.ModelKey(repo_id=ask.model),
        max_tokens=ask.max_tokens,
        temperature=ask.temperature,
        top_p=ask.top_p,
    )
    if ask.chat:
        req.messages.extend(node_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in ask.messages)
    else:
        req.prompt = ask.prompt
    if ask.seed is not None:
        req.seed = ask.seed
    return req
