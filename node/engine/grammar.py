"""Structured output enforced at sampling: a grammar, compiled by llguidance, masks every token that
could not continue it (a TokenConstraint, node/engine/constraint.py).

Why llguidance (over xgrammar and outlines-core): it takes Hugging Face `tokenizers` JSON as it is,
added and special tokens included, so every tokenizer mlx-lm loads (our byte-level tiny ones
too) works; it compiles JSON Schema and Lark with JSON inline (`%json {...}`), which tool calls
in a model's own markup need; its mask for a token costs tens of microseconds on a CPU, measured
in benchmarks/bench_grammar.py; it is a self-contained wheel (xgrammar pulls in torch and CUDA);
and vLLM, SGLang and llama.cpp use it, so it is kept up. What a grammar is made of:

- `response_format`: `json_object` (any object) or `json_schema` (the schema as given);
- `tool_choice` "required" or a named function: the call in the model's own markup, as its
  chat template renders an assistant's call (one rendered with stand-in name and arguments,
  cut between mlx-lm's tool-call markers), with the function's name and its parameters' schema
  in place of the stand-ins. A format whose arguments are not one JSON object (DSML) cannot be
  forced this way and is refused with the reason.

JSON is compact (`", "` and `": "` between items, no other whitespace): a model that may write
any whitespace can write it forever. Control tokens in the markup are matched as those tokens.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from expertmesh.node.engine.chat import control_tokens, render_chat
from expertmesh.node.engine.tools import ToolFormat, chat_messages
from expertmesh.node.engine.vocabulary import ll_tokenizer
from expertmesh.node.errors import ExpertmeshError

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Stand-ins rendered through the template to find where a call's name and arguments go.
_NAME = "zzfunctionzz"
_ARGS_KEY = "zzargumentszz"


class GrammarError(ValueError):
    """A schema or tool choice the grammar engine cannot enforce: said to the client as a 400."""


class GrammarFailure(ExpertmeshError):
    """The grammar engine reported an error partway through an answer. Its matcher then allows
    only the end, so the answer would stop as if finished, with its JSON cut short: it fails
    instead, as a generation that could not go on."""


class GrammarConstraint:
    """A compiled grammar following one generation: masks before each sample, consumes each token."""

    def __init__(self, tokenizer: Any, grammar: str):
        self.ll = ll_tokenizer(tokenizer)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        if failed:
            raise GrammarError("the grammar engine cannot compile it: " + "; ".join(messages))
        if messages:  # an approximation (oneOf as anyOf, keys or formats ignored): not the schema asked for
            raise GrammarError("the grammar engine would only approximate it: " + "; ".join(messages))
        self.matcher = llguidance.LLMatcher(self.ll, grammar)
        if self.matcher.is_error():
            raise GrammarError("the grammar engine cannot compile it: " + self.matcher.get_error())
        # Some schemas compile and fail only at their first mask (`{"$ref": "#"}`: a value that is
        # only itself has no first byte): the matcher then allows nothing but the end, and the
        # answer was "" with finish_reason "stop", not JSON. The first mask costs tens of
        # microseconds; computed here, such a schema is refused before any token.
        self.matcher.compute_bitmask()
        if self.matcher.is_error():
            reason = self.matcher.get_error().split("\n", 1)[0]  # the rest is the parser's state dump
            raise GrammarError(f"the grammar engine cannot start a value of it ({reason})")

    def mask(self, logprobs: mx.array) -> mx.array:
        raw = self.matcher.compute_bitmask()
        self._fail_if_broken()
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        width = logprobs.shape[-1]
        allowed = mx.array(bits[: min(width, self.ll.vocab_size)].astype(np.bool_))
        if width > allowed.shape[0]:  # ids the model has and the tokenizer does not: never
            allowed = mx.concatenate([allowed, mx.zeros(width - allowed.shape[0], dtype=mx.bool_)])
        return mx.where(allowed, logprobs, -mx.inf)

    def advance(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
            self._fail_if_broken()

    def _fail_if_broken(self) -> None:
        if self.matcher.is_error():
            reason = self.matcher.get_error().split("\n", 1)[0]  # the rest is the parser's state dump
            raise GrammarFailure(f"the grammar engine failed partway through the answer ({reason})")

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


def _json(schema: dict) -> str:
    """`%json {...}` of Lark: the schema with our compact JSON style."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


def response_format_grammar(response_format: dict) -> str:
    """The grammar of OpenAI's `response_format` (json_object or json_schema).

    Raises:
        GrammarError: another type, or a json_schema that is not an object or has no schema object.
    """
    kind = response_format.get("type")
    if kind == "json_object":
        return "start: " + _json({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema must be an object")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema.schema must be an object")
        return "start: " + _json(schema)
    raise GrammarError(f"response_format of type {kind!r} has no grammar")


def tool_call_grammar(tokenizer: Any, fmt: ToolFormat, tools: list[dict], name: str | None) -> str:
    """The grammar of one call, in the model's own markup, to `name` (or to any of `tools`).

    Raises:
        GrammarError: the template does not write a call's arguments as one JSON object.
    """
    before, after = _call_markup(tokenizer, fmt)
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise GrammarError(f"no tool named {name!r}")
    rules = []
    for i, fn in enumerate(functions):
        schema = fn.get("parameters") or {"type": "object"}
        head, mid = before.split(_NAME, 1)
        rules.append(
            f"call{i}: {_literal(tokenizer, head)} {json.dumps(fn['name'])} {_literal(tokenizer, mid)} "
            f"{_json(schema)} {_literal(tokenizer, after)}"
        )
    return "start: " + " | ".join(f"call{i}" for i in range(len(functions))) + "\n" + "\n".join(rules)


def _call_markup(tokenizer: Any, fmt: ToolFormat) -> tuple[str, str]:
    """The template's text of a call around its arguments: (from the start marker through the
    name's stand-in to the arguments, after them through the end marker)."""
    args = {_ARGS_KEY: 0}
    messages: list[dict] = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": _NAME, "arguments": args}}],
        },
    ]
    text = render_chat(tokenizer, chat_messages(messages, tokenizer), add_generation_prompt=False)
    start, end = text.find(fmt.start), text.rfind(fmt.end)
    call = text[start : end + len(fmt.end)] if 0 <= start < end else ""
    for spelled in (json.dumps(args), json.dumps(args, separators=(",", ":"))):
        if _NAME in call and spelled in call:
            before, after = call.split(spelled, 1)
            if _NAME in before:
                return before, after
    raise GrammarError(
        "this model's chat template does not write a call's arguments as one JSON object, so a call "
        "cannot be forced by a grammar: use tool_choice 'auto'"
    )


def _literal(tokenizer: Any, text: str) -> str:
    """Lark for `text` exactly: control tokens as those tokens, the rest as strings."""
    ct = control_tokens(tokenizer)
    vocab = tokenizer.get_vocab()
    parts, at = [], 0
    for m in ct.pattern.finditer(text):
        if m.start() > at:
            parts.append(json.dumps(text[at : m.start()]))
        token_id = vocab.get(m.group(0))
        parts.append(f"<[{token_id}]>" if token_id is not None else json.dumps(m.group(0)))
        at = m.end()
    if at < len(text):
        parts.append(json.dumps(text[at:]))
    return " ".join(parts) or '""'


def request_constraint(
    tokenizer: Any,
    response_format: dict | None,
    tool_choice: str,
    tool_name: str,
    tools: list[dict] | None,
    fmt: ToolFormat | None,
) -> GrammarConstraint | None:
    """The grammar a request's fields ask for, compiled; None for free text.

    Raises:
        GrammarError: it cannot be compiled or enforced, and why.
    """
    if response_format is not None and response_format.get("type") != "text":
        return GrammarConstraint(tokenizer, response_format_grammar(response_format))
    if tool_choice in ("required", "function"):
        if not tools:
            raise GrammarError("tool_choice asks for a call but no tools are given")
        if fmt is None:
            raise GrammarError("this model has no tool-call format a call could be forced in")
        name = tool_name if tool_choice == "function" else None
        return GrammarConstraint(tokenizer, tool_call_grammar(tokenizer, fmt, tools, name))
    return None
