"""Tool calls in the OpenAI API: the request's `tools`, `tool_choice`, `response_format` and tool
messages checked, and the calls a node parsed turned into OpenAI's `tool_calls`.

The node renders tools with the model's own chat template and parses the calls the model writes
(node/engine/tools.py); this module only checks the shapes a client sends, so a bad one is a 400
naming the field, and builds the shapes a client reads: `message.tool_calls` with
`finish_reason: "tool_calls"`, or `delta.tool_calls` when streaming. A call the node could not
parse comes back in `invalid_tool_calls` (its text and the error), never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # as OpenAI's


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote, as the node parsed it: a piece of the answer like its text."""

    name: str
    arguments: str  # a JSON object


@dataclass(frozen=True)
class UnparsedToolCall:
    text: str
    reason: str


@dataclass
class ToolAsk:
    """The tool and format fields of a chat request, checked."""

    tools: list[dict] | None = None
    choice: str = ""  # "" (auto) | "none" | "required" | "function"
    choice_name: str = ""
    response_format: dict | None = None  # json_object / json_schema; None: text


class ToolRequestError(ValueError):
    """A tool field a client sent that is wrong: openai_request.py answers it as a 400 on `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _bad(message: str, param: str) -> ToolRequestError:
    return ToolRequestError(message, param)


def parse_tool_ask(body: dict) -> ToolAsk:
    """`tools`, `tool_choice` and `response_format` of a chat body, or ToolRequestError naming the field."""
    ask = ToolAsk()
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise _bad(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
                raise _bad(
                    f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a name of "
                    "letters, digits, '_' or '-' (at most 64)",
                    "tools",
                )
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            if fn.get("description") is not None and not isinstance(fn["description"], str):
                raise _bad(f"tools[{i}].function.description must be a string", "tools")
        ask.tools = tools or None
    names = [t["function"]["name"] for t in ask.tools or []]
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        pass
    elif choice in ("none", "required"):
        ask.choice = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        ask.choice, ask.choice_name = "function", choice["function"].get("name")
        if ask.choice_name not in names:
            raise _bad(f"tool_choice names the function {ask.choice_name!r}, which is not in 'tools'", "tool_choice")
    else:
        raise _bad(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if ask.choice == "required" and not names:
        raise _bad("'tool_choice' is 'required' but no 'tools' are given", "tool_choice")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise _bad("response_format.json_schema must be an object with a 'schema' object", "response_format")
            ask.response_format = fmt
        elif kind == "json_object":
            ask.response_format = fmt
        elif kind != "text":
            raise _bad("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")
    if ask.response_format is not None and ask.choice in ("required", "function"):
        raise _bad("'response_format' and a forced 'tool_choice' cannot be combined", "response_format")
    return ask


def tool_message(i: int, m: dict, content: str) -> dict[str, Any]:
    """A `tool` message, or an assistant's with `tool_calls`, as the node takes it (OpenAI's shape)."""
    if m.get("role") == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"messages[{i}].tool_call_id must be the id of the call it answers", "messages")
        out: dict[str, Any] = {"role": "tool", "content": content, "tool_call_id": call_id}
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        return out
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise _bad(f"messages[{i}].tool_calls must be a list", "messages")
    checked = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise _bad(
                f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', 'function': {{'name', "
                "'arguments': a JSON string}}}}",
                "messages",
            )
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object", "messages")
        checked.append({"id": str(c.get("id") or ""), "type": "function", "function": dict(fn)})
    return {"role": "assistant", "content": content, "tool_calls": checked}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def openai_call(call: ToolCall, index: int | None = None) -> dict:
    """A call as OpenAI's `tool_calls` item (with `index` in a streamed delta)."""
    out: dict[str, Any] = {
        "id": call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        out["index"] = index
    return out


def invalid_call(call: UnparsedToolCall) -> dict:
    """A call the node could not parse: its text and why (LangChain's `invalid_tool_calls` shape)."""
    return {"type": "invalid_tool_call", "text": call.text, "error": call.reason}


def pieces(message: Any) -> list[ToolCall | UnparsedToolCall]:
    """The calls in a node's TokenEvent or GenerationDone."""
    out: list[ToolCall | UnparsedToolCall] = [ToolCall(c.name, c.arguments) for c in message.tool_calls]
    out += [UnparsedToolCall(c.text, c.reason) for c in message.unparsed_tool_calls]
    return out
