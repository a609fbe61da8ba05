"""Structured output: the grammar (node/engine/grammar.py) makes the trained demo model's output valid
JSON of the schema asked for, on the plain path, in a batch and with speculation configured; a
schema the engine cannot compile is refused with the reason."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest

from expertmesh.assembly import open_model
from expertmesh.devtools.json_schemas import MAX_TOKENS, PROMPT, SCHEMAS
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny.demo_model import REPO_ID, make_demo_model
from expertmesh.node.config import SpeculationConfig, StoreConfig
from expertmesh.node.engine.batching import BatchEngine
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.grammar import (
    MAX_FORCED_RUN,
    MAX_NESTED_REPEATS,
    GrammarConstraint,
    GrammarError,
    GrammarFailure,
    response_format_grammar,
)
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    """The trained demo model, streamed as a node streams it."""
    root = tmp_path_factory.mktemp("grammar-hub")
    make_demo_model(root / REPO_ID)
    home = tmp_path_factory.mktemp("grammar-home")
    with HubServer(root) as server, hub_client.using_endpoint(server.url):
        pull(REPO_ID, home=home, progress=False)
        sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="100%", prefetch=False))
        try:
            yield sm
        finally:
            sm.close()


def _constraint(sm, schema: dict) -> GrammarConstraint:
    return GrammarConstraint(
        sm.tokenizer, response_format_grammar({"type": "json_schema", "json_schema": {"schema": schema}})
    )


def _text(tokens, summary: GenerationSummary) -> str:
    return "".join(t.text for t in tokens) + summary.trailing_text


def test_twenty_schemas_give_valid_json(demo) -> None:
    assert len(SCHEMAS) == 20
    ids = demo.tokenizer.encode(PROMPT)
    for schema in SCHEMAS:
        summary = GenerationSummary()
        settings = SamplingSettings(max_tokens=MAX_TOKENS, constraint=_constraint(demo, schema))
        text = _text(list(Generator(demo).generate(ids, settings, summary=summary)), summary)
        assert summary.stop_reason == "eos", (schema, text)  # the grammar closed the JSON, then ended
        jsonschema.validate(json.loads(text), schema)


def test_a_grammar_holds_in_a_batch_and_with_sampling(demo) -> None:
    batch = BatchEngine(demo, max_batch=2)
    try:
        ids = demo.tokenizer.encode(PROMPT)
        runs = []
        for schema, temp in ((SCHEMAS[9], 0.0), (SCHEMAS[12], 1.0)):
            summary = GenerationSummary()
            settings = SamplingSettings(max_tokens=MAX_TOKENS, temp=temp, seed=3, constraint=_constraint(demo, schema))
            runs.append((schema, summary, batch.generate(ids, settings, summary=summary)))
        for schema, summary, tokens in runs:
            jsonschema.validate(json.loads(_text(list(tokens), summary)), schema)
    finally:
        batch.close()


def test_a_schema_the_engine_cannot_compile_is_refused_with_why(demo) -> None:
    with pytest.raises(GrammarError, match="look-around"):
        _constraint(demo, {"type": "string", "pattern": "(?<=x)a"})


def test_a_schema_that_fails_at_its_first_token_is_refused(demo) -> None:
    """`{"$ref": "#"}` compiles, but no value of it can start: it was served as "" (not JSON)."""
    with pytest.raises(GrammarError, match="cannot start"):
        _constraint(demo, {"$ref": "#"})


def _allowed(constraint: GrammarConstraint, vocab: int) -> set[int]:
    """The ids the constraint's mask lets through now."""
    masked = constraint.mask(mx.zeros((1, vocab)))
    return {int(i) for i in np.flatnonzero(np.isfinite(np.array(masked.reshape(-1))))}


def _string_of(pattern: str, **more) -> dict:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern, **more}}, "required": ["s"]}


# Regexes llguidance compiles and masks a first token for, and then cannot enforce: the audit's
# `(a{1000}){1000}`, as a pattern and as a patternProperties name, nested repetitions elsewhere in
# a schema, and a forced run (node/engine/grammar.py, `_check_repetition`).
UNENFORCEABLE = {
    "nests": [
        {"type": "string", "pattern": "(a{1000}){1000}"},
        {"type": "string", "pattern": "^(?:a{0,100}){0,100}$"},
        {"type": "string", "pattern": "^a{0,100}{0,100}$"},  # stacked: the same nesting
        {"type": "string", "pattern": "(?x)^(?i: a{0,100} ) {0,100}$"},  # the x flag ignores the spaces
        _string_of("^([a-z]{0,33}\\.){0,32}$"),  # 1,056: just over
        {"type": "object", "patternProperties": {"^(k{1000}){1000}$": {"type": "integer"}}},
        {"type": "array", "items": {"$ref": "#/$defs/t"}, "$defs": {"t": {"pattern": "((ab){0,64}c){1,64}"}}},
        {"type": "object", "properties": {"const": _string_of("(a{1000}){1000}")}},  # a property's name is no keyword
    ],
    "forces a run": [
        {"type": "string", "pattern": "^a{1000000}$"},
        _string_of("^x(abc){4000}$"),
    ],
}


def test_a_pattern_the_engine_would_fail_partway_is_refused_before_any_token(demo) -> None:
    """llguidance builds its lexer lazily: a nested or forced repetition compiles, masks its first
    token, and runs out of lexer fuel partway through the answer (or forces no choice for a
    million characters). Such a schema is refused up front, naming the pattern and the limit."""
    for reason, schemas in UNENFORCEABLE.items():
        for schema in schemas:
            with pytest.raises(GrammarError, match=f"the pattern .* {reason} .*at most .*cannot enforce"):
                _constraint(demo, schema)
    # What the limit guards against, in llguidance itself: accepted, then failed 100 characters in.
    ll = GrammarConstraint(demo.tokenizer, 'start: "x"').ll
    grammar = llguidance.LLMatcher.grammar_from_regex("(a{0,100}){0,100}")
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll) == (False, [])
    matcher = llguidance.LLMatcher(ll, grammar)
    [a] = demo.tokenizer.encode("a")
    consumed = 0
    while consumed < 1000 and matcher.consume_token(a):
        consumed += 1
    assert matcher.is_error() and "lexer" in matcher.get_error() and consumed < 1000


def test_patterns_within_the_limits_are_accepted_and_their_masks_constrain(demo) -> None:
    """Up to the limits, a pattern is enforced token by token: its masks allow only what can go on."""
    vocab = demo.tokenizer.vocab_size
    for schema in SCHEMAS:  # the first mask of every accepted schema forbids something
        assert 0 < len(_allowed(_constraint(demo, schema), vocab)) < vocab, schema
    texts = {i: demo.tokenizer.decode([i]) for i in range(vocab)}
    side = int(MAX_NESTED_REPEATS**0.5)
    cases = {
        f"^(a{{0,{side}}}){{0,{side}}}$": "a",  # nested: MAX_NESTED_REPEATS
        f"^a{{{MAX_FORCED_RUN}}}$": "a",  # forced: MAX_FORCED_RUN
        "^[ab]{1000000}$": "ab",  # a class repeated: no forced run, cheap however many
        ".{0,1000000}": None,  # anything, up to a million characters
    }
    for pattern, letters in cases.items():
        constraint = _constraint(demo, {"type": "string", "pattern": pattern})
        assert all(texts[i].startswith('"') for i in _allowed(constraint, vocab)), pattern
        constraint.advance(demo.tokenizer.encode('"')[0])
        allowed = _allowed(constraint, vocab)
        assert 0 < len(allowed) < vocab
        if letters is not None:
            assert all(set(texts[i]) <= set(letters + '"') for i in allowed), pattern  # '"' ends it
            assert any(set(letters) & set(texts[i]) for i in allowed)
        constraint.advance(min(allowed))
        assert len(_allowed(constraint, vocab)) < vocab


def test_a_schema_the_engine_would_only_approximate_is_refused(demo) -> None:
    """llguidance's lenient mode ignores what it cannot do, with a warning: that grammar is not the
    schema asked for. A client's own x-guidance is replaced by ours, so its lenient never applies."""
    schema = {"type": "string", "format": "no-such-format"}
    lenient = "start: %json " + json.dumps({**schema, "x-guidance": {"lenient": True}})
    with pytest.raises(GrammarError, match="only approximate it: Unknown format"):
        GrammarConstraint(demo.tokenizer, lenient)
    with pytest.raises(GrammarError, match="cannot compile it.*Unknown format"):
        _constraint(demo, {**schema, "x-guidance": {"lenient": True}})


class _Breaks:
    """llguidance's matcher, as it is once it has failed partway: in an error state from the first
    token it consumes after `when()` holds."""

    def __init__(self, matcher, when: Callable[[], bool]):
        self._matcher, self._when, self._broken = matcher, when, False

    def consume_token(self, token: int) -> bool:
        self._broken = self._broken or self._when()
        return self._matcher.consume_token(token)

    def is_error(self) -> bool:
        return self._broken or self._matcher.is_error()

    def get_error(self) -> str:
        return "lexer blew up\nparser state ..."

    def __getattr__(self, name: str):
        return getattr(self._matcher, name)


def test_a_grammar_that_fails_partway_fails_the_answer(demo) -> None:
    """A failed matcher allows only the end: the answer would stop as finished with its JSON cut."""
    constraint = _constraint(demo, SCHEMAS[0])
    consumed = itertools.count(1)
    constraint.matcher = _Breaks(constraint.matcher, when=lambda: next(consumed) >= 3)
    summary = GenerationSummary()
    settings = SamplingSettings(max_tokens=MAX_TOKENS, constraint=constraint)
    with pytest.raises(GrammarFailure, match="partway through the answer .lexer blew up.$"):
        list(Generator(demo).generate(demo.tokenizer.encode(PROMPT), settings, summary=summary))
    assert summary.stop_reason != "eos"


def test_a_grammar_that_fails_partway_in_a_batch_fails_only_its_own_answer(demo) -> None:
    """Rows of a batch decode in one step: one row's grammar failing ends that row alone."""
    batch = BatchEngine(demo, max_batch=2)
    try:
        ids = demo.tokenizer.encode(PROMPT)
        broken = _constraint(demo, SCHEMAS[12])
        broken.matcher = _Breaks(broken.matcher, when=lambda: len(batch._rows) == 2)  # once both decode together
        summary = GenerationSummary()
        asks = {
            "broken": batch.generate(ids, SamplingSettings(max_tokens=MAX_TOKENS, constraint=broken)),
            "other": batch.generate(
                ids, SamplingSettings(max_tokens=MAX_TOKENS, constraint=_constraint(demo, SCHEMAS[12])), summary=summary
            ),
        }
        got: dict[str, list | BaseException] = {}

        def drain(name: str) -> None:
            try:
                got[name] = list(asks[name])
            except Exception as e:  # noqa: BLE001 - what the test looks at
                got[name] = e

        threads = [threading.Thread(target=drain, args=(name,)) for name in asks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert isinstance(got["broken"], GrammarFailure), got["broken"]
        other = got["other"]
        assert isinstance(other, list), other
        jsonschema.validate(json.loads(_text(other, summary)), SCHEMAS[12])
    finally:
        batch.close()


def test_a_constrained_request_is_served_without_speculation(demo) -> None:
    """Drafts would need a mask per position to be verified: a node that speculates serves a
    constrained request on the plain path, and says so (no speculation in its summary)."""
    generator = Generator(demo, SpeculationConfig(mode="ngram"))
    ids = demo.tokenizer.encode(PROMPT)
    summary = GenerationSummary()
    settings = SamplingSettings(max_tokens=MAX_TOKENS, constraint=_constraint(demo, SCHEMAS[13]))
    text = _text(list(generator.generate(ids, settings, summary=summary)), summary)
    jsonschema.validate(json.loads(text), SCHEMAS[13])
    assert summary.speculation is None
    free = GenerationSummary()
    list(generator.generate(demo.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=8), summary=free))
    assert free.speculation is not None  # the same generator speculates a free request
