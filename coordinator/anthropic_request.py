"""An Anthropic Messages request, translated into the OpenAI chat request it asks for.

The Messages API is served as a translation at the JSON level: `system` becomes a system message,
content blocks become text (and `tool_use` blocks an assistant's `tool_calls`, `tool_result`
blocks `tool` messages), `tools` become functions, `stop_sequences` becomes `stop`; the OpenAI
parser (openai_request.py) then checks the body as it checks every chat request, so both APIs
honour and refuse the same things. Tool calling goes through the same door: the translated
request carries `tools` and the OpenAI parser decides whether they are served.

Fields are checked here in Anthropic's names first, so an error names the field the client sent.

One thing is dropped on the way: Claude Code opens its `system` with a line such as
`x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch=1f2e3;` whose `cch=`
hash changes on every request. It is accounting for Anthropic's servers and tells a local model
nothing, but as the prompt's first tokens it would make every request of one conversation differ
from the last at its start, so the node's prefix cache would reuse nothing. The line is dropped
only where Claude Code puts it, at the start of a system text block; no other text is touched.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

from expertmesh.coordinator.openai_request import (
    MAX_STOPS,
    ApiError,
    caller_type_message,
    mistyped_caller_field,
    unsupported_fields,
)

# Every field of Anthropic's MessageCreateParams (the `anthropic` package lists them), by what
# happens to it. HONOURED: translated and served; `temperature`, `top_p` and `top_k` are no longer
# in the newest client's schema but older clients and front-ends send them. CALLER: describes who
# asks or hints at caching, not the answer. NEUTRAL: accepted at the values that ask for nothing.
# Any other field is refused by name.
HONOURED = frozenset(
    {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
     "tools", "tool_choice"}
)  # fmt: skip
CALLER_TYPES: dict[str, type] = {"metadata": dict, "cache_control": dict, "user_profile_id": str, "workspace_id": str}
CALLER_FIELDS = frozenset(CALLER_TYPES)
NEUTRAL: dict[str, tuple] = {
    "thinking": ({"type": "disabled"},),
    "service_tier": ("auto", "standard_only"),
    "speed": ("standard",),
}
# count_tokens takes the prompt's fields only
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice"})
# Block kinds that carry no text the models served here can read, refused by name.
NON_TEXT_BLOCKS = ("image", "document", "search_result", "thinking", "redacted_thinking", "server_tool_use")
# Claude Code's per-request billing line, as it opens a system text block (the module's docstring)
BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)")


def _bad(message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message)


def _refuse_unsupported(body: dict, counting: bool) -> None:
    asked = unsupported_fields(body, COUNT_FIELDS if counting else HONOURED, CALLER_FIELDS, NEUTRAL)
    if asked:
        names = ", ".join(f"'{a}'" for a in asked)
        raise _bad(f"{names} {'is' if len(asked) == 1 else 'are'} not supported here")
    mistyped = mistyped_caller_field(body, CALLER_TYPES)
    if mistyped is not None:
        raise _bad(caller_type_message(mistyped, CALLER_TYPES))


def _text(blocks: Any, where: str, system: bool = False) -> str:
    """The text of a string or a list of text blocks (`system`, a tool result's content);
    `system`: without the billing line that may open each block (a block of that line alone is
    dropped whole, so it leaves no empty line behind)."""
    if isinstance(blocks, str):
        return BILLING_LINE.sub("", blocks) if system else blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(blocks):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            kind = block.get("type") if isinstance(block, dict) else None
            raise _bad(f"{where}[{j}] must be a text block" + (f", not '{kind}'" if kind else ""))
        text = BILLING_LINE.sub("", block["text"]) if system else block["text"]
        if text or not system:
            texts.append(text)
    return "\n".join(texts)


def _tool_call(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise _bad(f"{where}: a tool_use block needs an 'id' and a 'name'")
    arguments = json.dumps(block.get("input") or {})
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _message(i: int, m: Any) -> list[dict]:
    """One Anthropic message as OpenAI messages: a user turn's tool results come first, as
    `tool` messages, then its text; an assistant turn's tool_use blocks are its tool_calls."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"{where} must be an object with a role of 'user' or 'assistant' and a content")
    role, content = m["role"], m.get("content")
    if content == "" or content == []:  # as Anthropic answers: a turn of nothing is the client's mistake
        raise _bad(f"{where}: all messages must have non-empty content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{at}: a tool_result block needs a 'tool_use_id'")
            result = _text(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):  # OpenAI's tool messages have no error flag: the text says it
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind in NON_TEXT_BLOCKS:
            raise _bad(f"{at} is a '{kind}' block, which is not supported: the models served here read text only")
        else:
            raise _bad(f"{at} must be a text block" + (" or tool_use" if role == "assistant" else " or tool_result"))
    text = "\n".join(texts)
    if role == "assistant":
        message: dict = {"role": "assistant", "content": text if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return [message]
    return [*results, *([{"role": "user", "content": text}] if texts or not results else [])]


def _refuse_prefill(messages: list) -> None:
    """Refuse a conversation that ends with the assistant's turn. Anthropic reads it as a prefill:
    the answer continues that text (`{"role": "assistant", "content": "{"}` to get JSON). The
    chat template here closes every turn it is given and opens a new one, so the answer would
    start afresh after it, silently not what was asked: a 400 says so instead."""
    if messages[-1].get("role") == "assistant":
        raise _bad(
            f"messages[{len(messages) - 1}] is the assistant's: continuing a prefilled assistant turn is not "
            "supported here; end the conversation with a user message"
        )


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}] must be an object with a 'name' and an 'input_schema'")
        if tool.get("type") not in (None, "custom"):  # Anthropic's server tools (web search, bash, ...)
            raise _bad(f"tools[{i}] is a '{tool['type']}' tool, which is not supported: only custom tools are")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    return functions


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if not isinstance(choice, dict):
        raise _bad("'tool_choice' must be an object such as {'type': 'auto'}")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}")


def openai_body(body: Any, counting: bool = False) -> dict:
    """The OpenAI chat request body an Anthropic Messages body asks for (`counting`: the body of
    count_tokens, which has no max_tokens). Raises ApiError 400 naming what is wrong, in
    Anthropic's field names."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _refuse_unsupported(body, counting)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list")
    chat: list[dict] = []
    if body.get("system") is not None:
        system = _text(body["system"], "system", system=True)
        if system or not _text(body["system"], "system"):  # a system of the billing line alone is none
            chat.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        chat.extend(_message(i, m))
    out: dict = {"model": body.get("model"), "messages": chat}
    if not counting:
        _refuse_prefill(messages)
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _bad("'max_tokens' is required: a positive integer")
        out["max_tokens"] = max_tokens
        # checked here in Anthropic's terms, so that a 400 names Anthropic's field and range, not
        # the chat request's it is translated into
        temperature = body.get("temperature")
        if temperature is not None and (
            isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and 0 <= temperature <= 1)
        ):
            raise _bad("'temperature' must be a number from 0 to 1")
        stops = body.get("stop_sequences")
        if stops is not None and not (
            isinstance(stops, list) and len(stops) <= MAX_STOPS and all(isinstance(x, str) and x for x in stops)
        ):
            raise _bad(f"'stop_sequences' must be a list of at most {MAX_STOPS} non-empty strings")
        for name, to in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("stop_sequences", "stop"), ("stream", "stream")):  # fmt: skip
            if body.get(name) is not None:
                out[to] = body[name]
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    return out
