"""Structured output: the grammar (node/engine/grammar.py) makes the trained demo model's output valid
JSON of the schema asked for, on the plain path, in a batch and with speculation configured; a
schema the engine cannot compile is refused with the reason."""

from __future__ import annotations

import json

import jsonschema
import pytest

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny.demo_model import REPO_ID, make_demo_model
from expertmesh.node.config import SpeculationConfig, StoreConfig
from expertmesh.node.engine.batching import BatchEngine
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.grammar import GrammarConstraint, GrammarError, response_format_grammar
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull

PROMPT = "Return the settings of the cache as JSON: "
# Every schema below is bounded well under it, so the JSON always closes: a string without a length
# or pattern, or a number without multipleOf, may run on until max_tokens (the demo model writes
# 1.000000... greedily), which ends as OpenAI's does, with finish_reason "length".
MAX_TOKENS = 96
_OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    {**_OBJ, "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]},
    {**_OBJ, "properties": {"level": {"enum": ["debug", "info", "warning"]}}, "required": ["level"]},
    {**_OBJ, "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["size"]},
    {**_OBJ, "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        **_OBJ,
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}},
        "required": ["ratio"],
    },
    {
        **_OBJ,
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["tags"],
    },
    {**_OBJ, "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}, "required": ["code"]},
    {
        **_OBJ,
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"],
    },
    {
        **_OBJ,
        "properties": {
            "owner": {
                **_OBJ,
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99},
                    "role": {"enum": ["admin", "user"]},
                },
                "required": ["id", "role"],
            }
        },
        "required": ["owner"],
    },
    {
        **_OBJ,
        "properties": {
            "points": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    **_OBJ,
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                },
            }
        },
        "required": ["points"],
    },
    {
        **_OBJ,
        "properties": {"mode": {"const": "fast"}, "n": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["mode", "n"],
    },
    {
        **_OBJ,
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
        "required": ["value"],
    },
    {
        **_OBJ,
        "properties": {
            "host": {"type": "string", "pattern": "^[a-z]{1,8}\\.local$"},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        },
        "required": ["host", "port"],
    },
    {
        **_OBJ,
        "properties": {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}},
            }
        },
        "required": ["matrix"],
    },
    {
        **_OBJ,
        "properties": {
            "word": {"type": "string", "minLength": 1, "maxLength": 6},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["word", "count"],
    },
    {
        **_OBJ,
        "properties": {
            "temp": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.1},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["temp", "unit"],
    },
    {
        **_OBJ,
        "properties": {
            "a": {
                **_OBJ,
                "properties": {"b": {**_OBJ, "properties": {"c": {"type": "boolean"}}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        **_OBJ,
        "properties": {"id": {"type": "string", "pattern": "^[0-9a-f]{8}$"}, "active": {"type": "boolean"}},
        "required": ["id", "active"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    {"enum": ["red", "green", "blue"]},
]


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
