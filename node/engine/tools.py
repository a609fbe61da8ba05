"""Tool calls in each model's own format: the calls the model writes, split out of its text and
parsed by the parser mlx-lm picks for the model.

mlx-lm's tokenizer wrapper knows a model's tool-call markers and parser (`tool_call_start`,
`tool_call_end`, `tool_parser`, chosen from the chat template or the vocabulary) and mlx-lm's
`TextStateMachine` finds markers in streamed text, holding back what may be the start of one. We
use both as they are. Where mlx-lm renders a format but ships no parser for it (the DSML calls
of its Python template for DeepSeek V3.2), `_dsml_parse` reads them with that template's own
decoding helper.

Tool markup never reaches the answer's text, whether or not the request declared tools: a
model that writes a call unasked gets it back as a call. A call its parser cannot read (cut by
max_tokens, or malformed) comes back as an `UnparsedCall` holding its text and the reason:
mlx-lm's server logs and drops it, which leaves an agent waiting for a call that never comes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine

Parser = Callable[[str, Any], Any]

# JSON nesting a request's tools, calls or format may have: the coordinator's bound for a whole body
# (coordinator/openai_request.py); a real schema needs a handful of levels. Deeper text is refused
# before anything recursive (json's decoder, the marking of control tokens, the chat template, the
# grammar's encoder) reaches Python's recursion limit on a gRPC thread.
MAX_JSON_DEPTH = 64


class ToolsError(ValueError):
    """Tools this model cannot take: said to the client as a 400."""


def wire_json(text: str, field: str) -> Any:
    """The JSON value of a GenerateRequest's text `field` (tools, a message's tool_calls,
    response_format), or ToolsError naming the field.

    Any household member may call a node directly, so the text is hostile: `json.loads` raises
    RecursionError, not ValueError, on deep nesting, and a value nested within its limit can still
    exhaust the stack of whatever walks it later; both are refused here, as a 400, not an
    exception inside the call."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ToolsError(f"{field} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:
        raise ToolsError(f"{field} is not JSON: {e}") from None
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise ToolsError(f"{field} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and objects more than `limit` levels; iterative, so checking
    the depth costs no stack."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object


@dataclass(frozen=True)
class UnparsedCall:
    text: str
    reason: str


@dataclass
class Split:
    """What a piece of the model's text holds: answer text, and the calls it completed."""

    text: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    unparsed: list[UnparsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolFormat:
    start: str
    end: str
    parse: Parser


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The tool-call markers and parser of `tokenizer` (mlx-lm's TokenizerWrapper); None: it has none."""
    if getattr(tokenizer, "has_tool_calling", False):
        return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)
    if _template_type(tokenizer) == "deepseek_v32":
        return ToolFormat(_DSML_START, _DSML_END, _dsml_parse)
    return None


def _template_type(tokenizer: Any) -> str | None:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return (getattr(inner, "init_kwargs", None) or {}).get("chat_template_type")


def python_template(tokenizer: Any) -> bool:
    """Whether the chat template is one of mlx-lm's Python templates (written against OpenAI's
    message format: a call's arguments a JSON string, where Jinja templates take an object)."""
    return getattr(tokenizer, "_chat_template", None) is not None


class ToolCallSplitter:
    """Splits streamed text into answer text and tool calls (see the module docstring)."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None = None):
        self.fmt, self.tools = fmt, tools
        machine = TextStateMachine({"normal": [(fmt.start, "tool")], "tool": [(fmt.end, "normal")]})
        self._state = machine.make_state("normal")
        self._call_text = ""

    def feed(self, text: str) -> Split:
        self._state, segments = TextStateMachine.split(self._state, text)
        out = Split()
        previous = None
        for state, piece in segments:
            if state == "tool":
                self._call_text += piece
            else:
                if previous == "tool":  # the end marker closed a call
                    self._close(out)
                out.text += piece
            previous = state
        return out

    def finish(self) -> Split:
        """The text held back at the end, and a call left open (cut short: unparsed)."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        out = Split()
        if state == "tool":
            self._call_text += rest
            if self._call_text:
                out.unparsed.append(UnparsedCall(self._call_text, "the call was cut before its end marker"))
            self._call_text = ""
        elif rest and self.fmt.start.startswith(rest):  # held back as the start of a call's marker
            out.unparsed.append(UnparsedCall(rest, "the call was cut inside its start marker"))
        else:
            out.text = rest
        return out

    def _close(self, out: Split) -> None:
        text, self._call_text = self._call_text, ""
        try:
            parsed = self.fmt.parse(text, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            out.calls += [_call(c) for c in calls]
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
            out.unparsed.append(UnparsedCall(text, f"{type(e).__name__}: {e}"))


def _call(parsed: Any) -> ParsedCall:
    """A parser's dict as a call; its arguments a JSON object (some parsers give a string)."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError(f"the parser gave no tool name: {parsed!r}")
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a call's arguments must be a JSON object")
    return ParsedCall(parsed["name"], json.dumps(arguments, ensure_ascii=False))


# DeepSeek V3.2's DSML, as mlx-lm's Python template renders it (mlx_lm/chat_templates/deepseek_v32.py).
_DSML = "｜DSML｜"
_DSML_START = f"<{_DSML}function_calls>"
_DSML_END = f"</{_DSML}function_calls>"
_DSML_INVOKE = re.compile(rf'<{_DSML}invoke name="(?P<name>[^"]+)">(?P<body>.*?)</{_DSML}invoke>', re.DOTALL)
_DSML_PARAM = re.compile(
    rf'<{_DSML}parameter name="(?P<key>[^"]+)" string="(?P<str>true|false)">(?P<value>.*?)</{_DSML}parameter>',
    re.DOTALL,
)


def _dsml_parse(text: str, tools: Any = None) -> list[dict]:
    from mlx_lm.chat_templates.deepseek_v32 import decode_dsml_to_arguments

    calls = []
    for invoke in _DSML_INVOKE.finditer(text):
        args = {p["key"]: (p["value"], p["str"]) for p in _DSML_PARAM.finditer(invoke["body"])}
        call = decode_dsml_to_arguments(invoke["name"], args)
        calls.append({"name": call["name"], "arguments": json.loads(call["arguments"])})
    if not calls:
        raise ValueError("no DSML invoke block found")
    return calls


def chat_messages(messages: list[dict], tokenizer: Any) -> list[dict]:
    """Messages as the chat template takes them: an assistant's `tool_calls` with arguments as an
    object for Jinja templates (transformers' convention, as mlx-lm's server converts them), left
    as OpenAI's JSON string for mlx-lm's Python templates.

    Raises:
        ToolsError: a call's arguments are not a JSON object.
    """
    as_text = python_template(tokenizer)
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = c.get("function") or {}
                if not isinstance(fn, dict):  # a call the template would read as an object
                    raise ToolsError(f"messages[{i}].tool_calls: a call's function must be an object")
                fn = dict(fn)
                args = fn.get("arguments", "{}")
                try:
                    value = json.loads(args) if isinstance(args, str) else args
                except ValueError as e:
                    raise ToolsError(f"messages[{i}].tool_calls: arguments are not JSON ({e})") from None
                if not isinstance(value, dict):
                    raise ToolsError(f"messages[{i}].tool_calls: arguments must be a JSON object")
                fn["arguments"] = json.dumps(value, ensure_ascii=False) if as_text else value
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def tools_from_json(text: str) -> list[dict]:
    """The request's `tools` (JSON text from the wire), or ToolsError: a list of OpenAI's function
    tools, each `{"function": {"name": str, "parameters": object (optional)}}`, as the coordinator
    checks them (coordinator/tool_calls.py). The node checks them too, since a member may call it
    directly, and a forced call's grammar (engine/grammar.py) reads each tool's function, name and
    parameters."""
    tools = wire_json(text, "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ToolsError("tools must be a list of objects")
    for i, t in enumerate(tools):
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolsError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def check_renders_tools(tokenizer: Any, with_tools: str, without: str) -> ToolFormat:
    """The model's tool format, if its template rendered the tools (`with_tools` differs from
    `without`) and a parser can read the calls it writes back.

    Raises:
        ToolsError: it cannot take tools, and why.
    """
    fmt = tool_format(tokenizer)
    if fmt is None:
        raise ToolsError(
            "this model cannot take tools: mlx-lm finds no tool-call format in its chat template or "
            "vocabulary, so a call it wrote could not be read back"
        )
    if with_tools == without:
        raise ToolsError(
            "this model's chat template does not render tools for this conversation (some render "
            "them only with a system message): the model would never see them"
        )
    return fmt
