"""An OpenAI request body, checked the way the OpenAI API checks it, and the Generate call it becomes.

Every field a client may send is validated here, with a message that names the field, so the
official clients raise their usual exceptions with our reason; what reaches a node is a
`GenerateRequest` with sane values only.

The edges follow the OpenAI API reference: a message's `content` may be a list of parts (text parts
are joined, other kinds are refused by name: the models served here read text only), `developer`
is the newer name of `system`, an assistant's `content` may be null, and `null` for any optional
field means the field is absent. Nothing that is not finite, and no string that is not Unicode
text (a lone surrogate, which JSON can spell as `"\\ud800"`), gets past `decode_body` and
`parse_ask`: either would fail later, deep in the node, as a 5xx instead of a 400.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from expertmesh.coordinator.tool_calls import ToolAsk, ToolRequestError, parse_tool_ask, tool_message
from expertmesh.node.config import PromptExperts
from expertmesh.node.constants import MAX_TOKENS_LIMIT
from expertmesh.v1 import node_pb2

MAX_STOPS = 4  # as OpenAI's
MAX_TOP_LOGPROBS = 20  # as OpenAI's
MAX_LOGIT_BIAS_TOKENS = 300  # as OpenAI's
# A stop is a short marker ("\n\n", "User:"); the scanner's work per token grows with its length.
MAX_STOP_CHARS = 512
# Values a body may hold (every key, string and number counts): a long chat is a few thousand; a
# body of millions of tiny values is an attack on the parser's time, refused before it is walked.
MAX_VALUES = 200_000
MAX_DEPTH = 64  # JSON nesting a request needs is about 5 (messages, parts); deeper is an attack
# The roles a client may send, and the role the chat template sees: `developer` is what OpenAI now
# calls the system message of its reasoning models, and templates know only `system`.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Part types of the OpenAI reference that carry no text: refused by name, so the client learns why.
NON_TEXT_PARTS = ("image_url", "input_audio", "file")
# Text parts are joined as vLLM joins them for text-only templates: a line apiece.
PART_SEPARATOR = "\n"


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


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


class _NotFinite(ValueError):
    pass


def _no_constant(name: str) -> float:
    raise _NotFinite(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 overflows to inf
        raise _NotFinite(f"{text} is too large")
    return value


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body, or an ApiError 400 that says what is wrong with it.

    Python's `json` accepts more than JSON (NaN, Infinity, numbers that overflow to inf) and fails
    in ways a server must not pass on as a 500: RecursionError on deep nesting, ValueError on an
    integer of more than 4,300 digits, strings with lone surrogates that only fail when they are
    encoded again. The HTTP server calls this for every body, so each of those is a 400.
    """
    if not raw.strip():
        raise _bad("the request body is empty: send a JSON object")
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except _NotFinite as e:
        raise _bad(f"the body is not valid JSON: {e}; numbers must be finite") from None
    except RecursionError:
        raise _bad(f"the body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise _bad(f"the body is not valid JSON: {e}") from None
    check_json(value)
    return value


def check_json(value: Any) -> None:
    """Raise ApiError 400 if a decoded body holds anything a request cannot: nesting deeper than
    MAX_DEPTH, a float that is not finite, or a string that is not Unicode text.

    `parse_ask` calls it too, so a body decoded elsewhere (with plain `json.loads`) is held to the
    same rules. Iterative: the depth it checks must not cost stack; bounded: at most MAX_VALUES values."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise _bad(f"the body holds more than {MAX_VALUES:,} values")
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise _bad(f"the body is nested more than {MAX_DEPTH} levels deep")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, float) and not math.isfinite(item):
            raise _bad("the body holds a number that is not finite (NaN or infinity)")
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad("the body holds a string that is not Unicode text (a lone surrogate)") from None


@dataclass
class Ask:
    """A validated completion request."""

    model: str
    chat: bool
    prompt: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # 0 or 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    tools: ToolAsk = field(default_factory=ToolAsk)  # tools, tool_choice, response_format (tool_calls.py)
    prefix_space: str = ""  # whose stored prefixes the nodes may reuse (AccessPolicy.prefix_space)
    # expertmesh's own: which experts the prompt uses (node/config.py's PromptExperts); "": the node's default
    prompt_experts: str = ""


# Every field of OpenAI's two request schemas (the `openai` package's CompletionCreateParams lists
# them), and what this server does with each. HONOURED fields change the answer as OpenAI says
# they do; CALLER fields describe who asks (abuse monitoring, billing, cache routing hints), not
# the answer, so accepting them changes no answer anywhere; NEUTRAL fields are accepted at the
# value that asks for nothing (their default) and refused at any other. Any other field, of the
# schemas or not (a typo, another server's extension), is refused by name: a client that asked
# for something and got an answer without it would fail later, further from the cause.
HONOURED_COMMON = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
        "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
        # not OpenAI's, but sent by chat front-ends to servers like this one (vLLM's names)
        "top_k", "min_p", "repetition_penalty",
        "prompt_experts",  # expertmesh's own: an approximate prompt, opt-in (node/config.py's PromptExperts)
    }
)  # fmt: skip
HONOURED_CHAT = HONOURED_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs",
    "tools", "tool_choice", "response_format",  # rendered by the model's template, enforced by a grammar
}  # fmt: skip
HONOURED_COMPLETIONS = HONOURED_COMMON | {"prompt"}
# What each CALLER field must be: it changes no answer, but a value of another type is the client's
# mistake all the same, a 400 naming it, as OpenAI answers it.
CALLER_TYPES: dict[str, type] = {"user": str, "metadata": dict, "safety_identifier": str, "prompt_cache_key": str}
CALLER_FIELDS = frozenset(CALLER_TYPES)
# name -> the values that ask for nothing. `parallel_tool_calls: false` asks for at most one call,
# which nothing enforces yet: only its default is accepted.
NEUTRAL_CHAT: dict[str, tuple] = {
    "parallel_tool_calls": (True,),
    "modalities": (["text"],),
    "store": (False,),
    "service_tier": ("auto", "default"),
}
NEUTRAL_COMPLETIONS: dict[str, tuple] = {"echo": (False,), "best_of": (1,), "suffix": ("",)}
# `stream_options`' own keys beside `include_usage`: obfuscation pads each chunk with an
# `obfuscation` field, which is not sent here, so only its `false` asks for nothing.
STREAM_OPTIONS_NEUTRAL: dict[str, tuple] = {"include_obfuscation": (False,)}


def is_neutral(value: Any, neutral: tuple) -> bool:
    """Whether `value` is one of the `neutral` values, of the same JSON type too: Python's `==`
    takes `0` for `False` and `1` for `True`, so `store: 0` or `parallel_tool_calls: 1` (a
    wrong type, which OpenAI refuses) would otherwise pass as the value that asks for nothing."""
    return any(type(value) is type(n) and value == n for n in neutral)


def unsupported_fields(
    body: dict, honoured: frozenset[str] | set[str], caller: frozenset[str], neutral: dict[str, tuple]
) -> list[str]:
    """The fields of `body` that are neither honoured, the caller's, nor neutral at their value
    (null means absent): what an API refuses by name (this one's, and the Messages API's)."""
    return [
        name
        for name, value in body.items()
        if value is not None
        and name not in honoured
        and name not in caller
        and not is_neutral(value, neutral.get(name, ()))
    ]


def mistyped_caller_field(body: dict, types: dict[str, type]) -> str | None:
    """The first caller field of `body` whose value is not of its JSON type (null means absent):
    a string, or an object of strings (OpenAI's `metadata`, Anthropic's `metadata` and
    `cache_control`). Their values are not read, so nothing else would notice a wrong one."""
    for name, kind in types.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, kind):
            return name
        if isinstance(value, dict) and not all(isinstance(v, str | None) for v in value.values()):
            return name
    return None


def caller_type_message(name: str, types: dict[str, type]) -> str:
    """What `mistyped_caller_field`'s field must be, for the 400 that names it."""
    return f"'{name}' must be " + ("an object of strings" if types[name] is dict else "a string")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Refuse by name every field that is neither honoured nor neutral at its value (null means absent)."""
    honoured = HONOURED_CHAT if chat else HONOURED_COMPLETIONS
    asked = unsupported_fields(body, honoured, CALLER_FIELDS, NEUTRAL_CHAT if chat else NEUTRAL_COMPLETIONS)
    if asked:
        names = ", ".join(f"'{a}'" for a in asked)
        raise _bad(
            f"{names} {'is' if len(asked) == 1 else 'are'} not supported here: expertmesh answers with generated "
            "text only",
            param=asked[0],
            code="unsupported_parameter",
        )
    mistyped = mistyped_caller_field(body, CALLER_TYPES)
    if mistyped is not None:
        raise _bad(caller_type_message(mistyped, CALLER_TYPES), param=mistyped)


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    """`body[name]` checked to lie in [lo, hi]; absent or null: `default` (null means absent)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi:  # NaN fails the comparison too
        kind = "an integer" if integer else "a number"
        raise _bad(f"'{name}' must be {kind} from {lo:g} to {hi:g}", param=name)
    return value


def _parts_text(i: int, role: str, parts: list) -> str:
    """The text of a message given as content parts: text parts (and an assistant's refusal
    parts) joined; any other kind is refused by name, as these models read no images or audio."""
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in NON_TEXT_PARTS:
            raise _bad(
                f"{where} is an '{kind}' part, which is not supported: the models served here read text "
                "only; send text parts ({'type': 'text', 'text': ...})",
                param="messages",
                code="unsupported_content",
            )
        else:
            raise _bad(f"{where} must be a text part: {{'type': 'text', 'text': '...'}}", param="messages")
    return PART_SEPARATOR.join(texts)


def _message(i: int, m: Any) -> dict[str, Any]:
    """One message as the chat template takes it: a template role and a string content."""
    if not isinstance(m, dict):
        raise _bad(f"messages[{i}] must be an object with a role and a content", param="messages")
    role = m.get("role")
    if role == "function":
        raise _bad(f"messages[{i}]: 'function' messages are not supported: send 'tool' messages", param="messages")
    if role not in ROLES and role != "tool":
        raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, tool", param="messages")
    if role == "assistant" and m.get("function_call"):
        raise _bad(f"messages[{i}]: 'function_call' is not supported: send 'tool_calls'", param="messages")
    content = m.get("content")
    if content is None and role == "assistant":  # the reference allows it (with tool_calls): no text
        content = ""
    elif isinstance(content, list):
        content = _parts_text(i, role, content)
    elif not isinstance(content, str):
        allowed = "a string or a list of text parts" + (" or null" if role == "assistant" else "")
        raise _bad(f"messages[{i}].content must be {allowed}", param="messages")
    if role == "tool" or (role == "assistant" and m.get("tool_calls")):
        try:
            return tool_message(i, m, content)
        except ToolRequestError as e:
            raise _bad(str(e), param=e.param) from None
    return {"role": ROLES[role], "content": content}


def parse_ask(body: Any, chat: bool, models: list[str], default_max_tokens: int, *, checked: bool = False) -> Ask:
    """Check a request body the way the OpenAI API does, with a message that says what is wrong.

    `checked`: the body came from `decode_body`, which ran `check_json` already."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if not checked:
        check_json(body)
    _refuse_unsupported(body, chat)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required: one of " + ", ".join(models), param="model")
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
            raise _bad("'messages' must be a non-empty list", param="messages")
        ask.messages = [_message(i, m) for i, m in enumerate(messages)]
        try:
            ask.tools = parse_tool_ask(body)
        except ToolRequestError as e:
            raise _bad(str(e), param=e.param) from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _bad("'prompt' must be a non-empty string", param="prompt")
        ask.prompt = prompt
    if _number(body, "n", 1, 1, 1, integer=True) != 1:
        raise _bad("'n' must be 1", param="n")
    # The newer name wins, but only when it is given: null means absent, so `max_tokens` then counts.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    ask.max_tokens = _number(body, name, default_max_tokens, 1, MAX_TOKENS_LIMIT, integer=True)
    ask.temperature = float(_number(body, "temperature", 1.0, 0, 2))
    ask.top_p = float(_number(body, "top_p", 1.0, 0, 1))
    # The reference takes any 64-bit integer, negative ones too; the node maps it onto MLX's seed.
    ask.seed = _number(body, "seed", None, -(2**63), 2**63 - 1, integer=True)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise _bad(f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"a stop sequence may be at most {MAX_STOP_CHARS} characters long", param="stop")
    ask.stop = stops
    _sampling(body, ask)
    _logprobs(body, ask, chat)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", param="stream")
    ask.stream = bool(stream)
    ask.include_usage = _stream_options(body.get("stream_options"), ask.stream)
    mode = body.get("prompt_experts")
    if mode is not None:
        if not isinstance(mode, str):
            raise _bad(
                "'prompt_experts' must be a string: exact, held, keep, drop, topp:P or budget:SECONDS",
                param="prompt_experts",
            )
        try:
            ask.prompt_experts = str(PromptExperts.parse(mode))
        except ValueError as e:
            raise _bad(f"'prompt_experts': {e}", param="prompt_experts") from None
    return ask


def _stream_options(options: Any, stream: bool) -> bool:
    """Whether `stream_options` asks for the usage chunk. Its keys are checked as the body's are:
    `include_usage` must be a boolean, `include_obfuscation` is served only at false (no
    `obfuscation` field is sent), and any other key is refused by name, never ignored."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", param="stream_options")
    if not stream:  # as OpenAI and vLLM answer: usage then comes in the body
        raise _bad("'stream_options' may be set only with 'stream': true", param="stream_options")
    asked = unsupported_fields(options, {"include_usage"}, frozenset(), STREAM_OPTIONS_NEUTRAL)
    if asked:
        names = ", ".join(f"'stream_options.{a}'" for a in asked)
        raise _bad(f"{names} {'is' if len(asked) == 1 else 'are'} not supported here", param="stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("'stream_options.include_usage' must be true or false", param="stream_options")
    return bool(include_usage)


def _sampling(body: dict, ask: Ask) -> None:
    """The sampling fields beyond temperature and top-p, in the ranges OpenAI (and vLLM, for
    top_k, min_p and repetition_penalty) take them."""
    ask.presence_penalty = float(_number(body, "presence_penalty", 0.0, -2, 2))
    ask.frequency_penalty = float(_number(body, "frequency_penalty", 0.0, -2, 2))
    ask.repetition_penalty = float(_number(body, "repetition_penalty", 0.0, 0, 10))
    ask.min_p = float(_number(body, "min_p", 0.0, 0, 1))
    top_k = _number(body, "top_k", 0, -1, 2**31 - 1, integer=True)
    ask.top_k = max(0, top_k)  # vLLM's -1: off
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise _bad(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS_TOKENS} token ids", param="logit_bias")
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= 2**32:
            raise _bad(
                f"'logit_bias' keys must be token ids (integers as strings), not {key[:20]!r}", param="logit_bias"
            )
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100
        if not ok:
            raise _bad("'logit_bias' values must be numbers from -100 to 100", param="logit_bias")
        ask.logit_bias[int(key)] = float(value)


def _logprobs(body: dict, ask: Ask, chat: bool) -> None:
    """Chat: `logprobs` true, and `top_logprobs` 0-20 with it. Completions: `logprobs` is how
    many most likely tokens to return beside each chosen one (0-20; OpenAI's legacy API takes 5)."""
    if chat:
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _bad("'logprobs' must be true or false", param="logprobs")
        ask.logprobs = bool(logprobs)
        ask.top_logprobs = _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
        if body.get("top_logprobs") is not None and not ask.logprobs:
            raise _bad("'top_logprobs' may be set only with 'logprobs': true", param="top_logprobs")
    else:
        top = _number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        ask.logprobs, ask.top_logprobs = top is not None, top or 0


def generate_request(ask: Ask) -> node_pb2.GenerateRequest:
    """The node's Generate call for `ask`.

    `top_p: 0` asks for the smallest nucleus, the most likely token alone: that is greedy decoding,
    so it goes to the node as temperature 0. (The node's `top_p` 0 means "off", as in mlx-lm's
    sampler, which applies top-p only for 0 < top_p < 1: sent as is, 0 would sample from everything.)
    """
    greedy = ask.top_p == 0
    req = node_pb2.GenerateRequest(
        model=node_pb2.ModelKey(repo_id=ask.model),
        max_tokens=ask.max_tokens,
        temperature=0.0 if greedy else ask.temperature,
        top_p=1.0 if greedy else ask.top_p,
    )
    if ask.chat:
        req.messages.extend(_chat_message(m) for m in ask.messages)
        t = ask.tools
        if t.tools:
            req.tools = json.dumps(t.tools)
        req.tool_choice, req.tool_choice_name = t.choice, t.choice_name
        if t.response_format is not None:
            req.response_format = json.dumps(t.response_format)
    else:
        req.prompt = ask.prompt
    if ask.seed is not None:
        req.seed = ask.seed
    req.top_k, req.min_p = ask.top_k, ask.min_p
    req.presence_penalty, req.frequency_penalty = ask.presence_penalty, ask.frequency_penalty
    req.repetition_penalty = ask.repetition_penalty
    req.logit_bias.update(ask.logit_bias)
    req.logprobs, req.top_logprobs = ask.logprobs, ask.top_logprobs
    req.prefix_space = ask.prefix_space
    req.prompt_experts = ask.prompt_experts
    return req


def _chat_message(m: dict[str, Any]) -> node_pb2.ChatMessage:
    msg = node_pb2.ChatMessage(role=m["role"], content=m["content"])
    if m.get("tool_calls"):
        msg.tool_calls = json.dumps(m["tool_calls"])
    msg.tool_call_id = m.get("tool_call_id", "")
    msg.name = m.get("name", "")
    return msg
