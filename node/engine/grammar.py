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

What llguidance cannot enforce is refused before any token (GrammarError: a 400 over HTTP,
INVALID_ARGUMENT over gRPC), never served unconstrained: a grammar it cannot compile, one it
compiles only approximately (its warnings), one with no first token, and a schema whose regexes
repeat beyond `_check_repetition`'s limits (the one failure llguidance finds only partway through
an answer, see there). Whatever still fails partway fails the answer (GrammarFailure).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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
    """`%json {...}` of Lark: the schema with our compact JSON style.

    Raises:
        GrammarError: a regex of the schema repeats beyond what llguidance can enforce (`_check_repetition`).
    """
    for regex in _schema_regexes(schema):
        _check_repetition(regex)
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


# What a schema's regexes may repeat (`_check_repetition`); measured with llguidance 1.9.1 on the
# demo model's tokenizer, one character a token, under its default ParserLimits.
MAX_NESTED_REPEATS = 1024
MAX_FORCED_RUN = 10_000


def _check_repetition(regex: str) -> None:
    """Refuse a regex whose counted repetitions llguidance would accept and then fail to enforce.

    llguidance's lexer is a DFA built lazily from regex derivatives (derivre), one state as an
    answer reaches it (its README: "The lexer's automata in llguidance are built lazily"), and a
    counted repetition stays symbolic: `x{n,m}` weighs min(n, 10) + min(m, 10) in derivre's
    `compute_weight` (src/ast.rs), so no count, however large, costs anything at compile time or
    makes `precompute_large_lexemes` (parser/src/earley/parser.rs) explore it. The cost comes per
    token instead, out of `ParserLimits.step_lexer_fuel` (200,000 a mask, parser/src/api.rs); once
    spent, the lexer errs ("too many expressions constructed", regexvec.rs `transition_inner`) and
    the answer fails partway (GrammarFailure). So such regexes are refused before any token:

    - a repetition inside a repetition: the derivative of `(x{0,m}){0,n}` after k characters is a
      union of the ways to split k, which grows with m * n. `(a{0,100}){0,100}` (10,000), and
      `(a{0,64}){0,64}` (4,096) with a maxLength, run out of fuel about 100 characters in;
      `^(a{1000}){1000}$` takes 1.7 s for its first mask and fails at its first token, while
      `(a{0,32}){0,32}` (1,024) with a maxLength completes, its worst mask 6 ms. So the product
      of nested counts (the maximum, or the minimum where unbounded) may be at most
      MAX_NESTED_REPEATS, a quarter of the smallest product seen to fail; a realistic schema
      nests far less (an IPv6 group `([0-9a-f]{1,4}:){7}` 28, a hostname's label 61).
    - a long forced run: llguidance computes the bytes the grammar leaves no choice about (its
      docs/fast_forward.md) and walks them all at every mask: `a{100000}` costs 0.2 s a token,
      `a{1000000}` runs out of fuel at its first token, `a{10000}` 14 ms. A repetition of fixed
      text may force at most MAX_FORCED_RUN characters (a SHA-512 in hex is 128 characters of a
      class, no forced run at all).

    A large count over a class or a choice is cheap (`.{0,1000000}` and `[ab]{1000000}`: one new
    state a character, no forced bytes), as are large alternations (20,000 words). A regex this
    scan cannot read is left to llguidance, which refuses what it cannot parse.

    Raises:
        GrammarError: naming the regex and the limit.
    """
    try:
        nested, forced = _Repeats(regex).measure()
    except ValueError:
        return
    shown = regex if len(regex) <= 80 else regex[:77] + "..."
    if nested > MAX_NESTED_REPEATS:
        raise GrammarError(
            f"the pattern {shown!r} nests counted repetitions to {nested} repeats (at most "
            f"{MAX_NESTED_REPEATS}): the grammar engine cannot enforce it, its lexer would run out of "
            "its budget partway through an answer"
        )
    if forced > MAX_FORCED_RUN:
        raise GrammarError(
            f"the pattern {shown!r} forces a run of {forced} characters (at most {MAX_FORCED_RUN}): the "
            "grammar engine cannot enforce it, it would walk the whole run at every token"
        )


class _Repeats:
    """What a regex repeats, read as llguidance reads a JSON Schema pattern (Rust's regex syntax,
    after its `regex_to_lark`: parser/src/regex_rewrite.rs) and only as far as quantifiers need:
    groups, alternations, classes, escapes, stacked quantifiers (`a{9}{9}` is `(a{9}){9}`) and the
    `x` flag's ignored whitespace and comments. Where it reads a regex one way and llguidance
    might another, it counts the larger; ValueError where the regex is malformed (llguidance then
    refuses it itself).

    Each part measures (span, nested, forced, fixed): span, the largest product of counts along a
    path through it (the maximum, or the minimum where unbounded); nested, the largest span over
    two or more nested repetitions (0 if none); forced, the longest run a repetition of fixed text
    leaves no choice about (its minimum count times the text's length); fixed, the length of the
    part if it is fixed text (literal characters, exact counts, no alternation), else None.
    """

    _CLASS_ESCAPES = frozenset("dDwWsSpP")
    _ANCHOR_ESCAPES = frozenset("bBAzZG")
    _MAX_DEPTH = 300  # groups in groups: llguidance refuses 300 (regex-syntax's nest limit)

    def __init__(self, regex: str):
        self.rx, self.at, self.depth, self.verbose, self.saw_x = regex, 0, 0, False, False

    def measure(self) -> tuple[int, int]:
        """(nested, forced) of the whole regex, the larger of its readings with and without the
        `x` flag where it sets one (its scope is not followed)."""
        nested, forced = self._read(verbose=False)
        if self.saw_x:
            n, f = self._read(verbose=True)
            nested, forced = max(nested, n), max(forced, f)
        return nested, forced

    def _read(self, verbose: bool) -> tuple[int, int]:
        self.at, self.depth, self.verbose = 0, 0, verbose
        _span, nested, forced, _fixed = self._alternation()
        if self.at != len(self.rx):
            raise ValueError("unbalanced ')'")
        return nested, forced

    def _alternation(self) -> tuple[int, int, int, int | None]:
        """The branches up to the end or a ')' (not consumed)."""
        span, nested, forced, branches = 1, 0, 0, 1
        fixed: int | None = 0
        while self._skip_ignored() and self.rx[self.at] != ")":
            if self.rx[self.at] == "|":
                self.at, branches = self.at + 1, branches + 1
                continue
            s, n, f, length = self._item()
            span, nested, forced = max(span, s), max(nested, n), max(forced, f)
            fixed = None if fixed is None or length is None else fixed + length
        return span, nested, forced, fixed if branches == 1 else None

    def _item(self) -> tuple[int, int, int, int | None]:
        if self.rx[self.at] == "(":
            self.at, self.depth = self.at + 1, self.depth + 1
            if self.depth > self._MAX_DEPTH:
                raise ValueError("groups nested too deep")
            self._group_prefix()
            span, nested, forced, fixed = self._alternation()
            if self.at >= len(self.rx):
                raise ValueError("unbalanced '('")
            self.at, self.depth = self.at + 1, self.depth - 1
        else:
            span, nested, forced, fixed = 1, 0, 0, self._atom()
        while self._skip_ignored() and (counts := self._quantifier()) is not None:  # stacked: nested
            low, high = counts
            size = high if high is not None else max(low, 1)
            if size > 1 and span > 1:
                nested = max(nested, size * span)
            if fixed is not None:
                forced = max(forced, low * fixed)
            span, fixed = size * span, low * fixed if fixed is not None and low == high else None
        return span, nested, forced, fixed

    def _skip_ignored(self) -> bool:
        """Past what the `x` flag ignores (whitespace, `#` to the line's end); whether any is left."""
        rx = self.rx
        while self.verbose and self.at < len(rx) and (rx[self.at].isspace() or rx[self.at] == "#"):
            if rx[self.at] == "#":
                end = rx.find("\n", self.at)
                self.at = len(rx) if end < 0 else end + 1
            else:
                self.at += 1
        return self.at < len(rx)

    def _group_prefix(self) -> None:
        """Past what opens a group after '(': `?:`, `?=`, `?!`, `?<=`, `?<!`, `?<name>`, `?P<name>`,
        flags (`?i:`, `?x-i:`, and `?x` alone, which sets them for the rest of the group)."""
        rx = self.rx
        if not rx.startswith("?", self.at):
            return
        self.at += 1
        if rx.startswith(("<=", "<!"), self.at):
            self.at += 2
        elif rx.startswith(("P<", "<"), self.at):
            self._skip_to(">")
        elif rx.startswith(("=", "!"), self.at):
            self.at += 1
        else:
            start = self.at
            while self.at < len(rx) and (rx[self.at].isalpha() or rx[self.at] == "-"):
                self.at += 1
            self.saw_x = self.saw_x or "x" in rx[start : self.at].split("-", 1)[0]
            if rx.startswith(":", self.at):
                self.at += 1

    def _atom(self) -> int | None:
        """Past one atom: its length if it is one fixed character (0: an anchor), else None."""
        rx = self.rx
        c = rx[self.at]
        self.at += 1
        if c == "\\":
            if self.at >= len(rx):
                return 0  # a trailing backslash: regex_to_lark drops it
            escape = rx[self.at]
            self.at += 1
            if escape in "pPux" and rx.startswith("{", self.at):  # \p{L}, \u{1F600}
                self._skip_to("}")
            return None if escape in self._CLASS_ESCAPES else 0 if escape in self._ANCHOR_ESCAPES else 1
        if c == "[":  # to its first unescaped ']' (a leading one is itself): a nested class ends later
            if rx.startswith("^", self.at):
                self.at += 1
            if rx.startswith("]", self.at):
                self.at += 1
            while self.at < len(rx) and rx[self.at] != "]":
                self.at += 2 if rx[self.at] == "\\" else 1
            if self.at >= len(rx):
                raise ValueError("unbalanced '['")
            self.at += 1
            return None
        if c in "*+?":
            raise ValueError(f"{c!r} repeats nothing")
        return 0 if c in "^$" else None if c == "." else 1

    def _skip_to(self, end: str) -> None:
        found = self.rx.find(end, self.at)
        if found < 0:
            raise ValueError(f"no {end!r}")
        self.at = found + 1

    def _quantifier(self) -> tuple[int, int | None] | None:
        """The counts of the quantifier here, consumed with its lazy mark `?`, or None."""
        rx = self.rx
        c = rx[self.at]
        if c in "*+?":
            self.at += 1
            counts: tuple[int, int | None] = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            end = rx.find("}", self.at)
            low, comma, high = (rx[self.at + 1 : end] if end > 0 else "").partition(",")
            if not low.strip().isdigit() or (high.strip() and not high.strip().isdigit()):
                return None  # a '{' that counts nothing: llguidance refuses it, or it is itself
            self.at = end + 1
            counts = (int(low), int(high) if high.strip() else (None if comma else int(low)))
        else:
            return None
        self._skip_ignored()
        if rx.startswith("?", self.at):  # lazy; another quantifier after it stacks
            self.at += 1
        return counts


# Keywords whose values are instances, not schemas: a "pattern" there is data.
_INSTANCE_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: a name is never a keyword.
_NAMED_SCHEMAS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})


def _schema_regexes(schema: Any) -> Iterator[str]:
    """Every regex of a JSON Schema: its `pattern`s and the names of its `patternProperties`."""
    if isinstance(schema, list):
        for item in schema:
            yield from _schema_regexes(item)
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in _INSTANCE_KEYWORDS:
            continue
        if key == "pattern" and isinstance(value, str):
            yield value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            for sub in value.values():
                yield from _schema_regexes(sub)
        elif key == "patternProperties" and isinstance(value, dict):
            for regex, sub in value.items():
                yield regex
                yield from _schema_regexes(sub)
        else:
            yield from _schema_regexes(value)


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
