"""Twenty JSON schemas the trained demo model answers under the grammar: what tests/test_grammar.py
asserts valid and what `expertmesh bench --prompt-experts` counts valid under an approximate prompt,
one list so the two measure the same thing."""

from __future__ import annotations

from typing import Any

PROMPT = "Return the settings of the cache as JSON: "
# Every schema below is bounded well under it, so the JSON always closes: a string without a length
# or pattern, or a number without multipleOf, may run on until max_tokens (the demo model writes
# 1.000000... greedily), which ends as OpenAI's does, with finish_reason "length".
MAX_TOKENS = 96
_OBJ: dict[str, Any] = {"type": "object", "additionalProperties": False}
SCHEMAS: list[dict[str, Any]] = [
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
