"""The tool-argument validator: hand-checked cases, and agreement with the jsonschema package where installed."""
from __future__ import annotations

from typing import Any

import pytest

from appliance.server.parsers.tool_calls.schema_check import validate

OBJ = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 1, "exclusiveMaximum": 10},
        "x": {"type": ["number", "null"]},
        "s": {"type": "string", "minLength": 2, "maxLength": 4},
        "e": {"enum": [1, "one", None]},
        "c": {"const": True},
        "l": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
        "u": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "o": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        "m": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "a": {"allOf": [{"type": "string"}, {"not": {"enum": ["bad"]}}]},
    },
    "required": ["n"],
    "additionalProperties": False,
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
}

CASES: list[tuple[Any, bool]] = [
    ({"n": 1}, True),
    ({"n": 3.0}, True),  # an integer-valued float is an integer
    ({"n": 3.5}, False),
    ({"n": True}, False),  # booleans are not numbers
    ({"n": 0}, False),
    ({"n": 10}, False),
    ({}, False),
    ({"n": 1, "zzz": 1}, False),
    ({"n": 1, "x": None}, True),
    ({"n": 1, "x": "1"}, False),
    ({"n": 1, "s": "a"}, False),
    ({"n": 1, "s": "abcde"}, False),
    ({"n": 1, "s": "abc"}, True),
    ({"n": 1, "e": 1}, True),
    ({"n": 1, "e": True}, False),  # true is not 1
    ({"n": 1, "e": None}, True),
    ({"n": 1, "c": 1}, False),
    ({"n": 1, "c": True}, True),
    ({"n": 1, "l": [{"x": 1}]}, True),
    ({"n": 1, "l": []}, False),
    ({"n": 1, "l": [{"y": 1}]}, False),
    ({"n": 1, "l": [{"x": 1}, {"x": 2}, {"x": 3}]}, False),
    ({"n": 1, "u": 5}, True),
    ({"n": 1, "u": 5.5}, False),
    ({"n": 1, "o": 2}, False),  # both branches match
    ({"n": 1, "o": 2.5}, True),
    ({"n": 1, "m": {"k": True}}, True),
    ({"n": 1, "m": {"k": 1}}, False),
    ({"n": 1, "a": "fine"}, True),
    ({"n": 1, "a": "bad"}, False),
    ([1], False),
]


@pytest.mark.parametrize("value,ok", CASES)
def test_cases(value: Any, ok: bool) -> None:
    errors = validate(value, OBJ)
    assert (errors == []) is ok, errors
    assert all(e.startswith("$") for e in errors)


@pytest.mark.parametrize("value,ok", CASES)
def test_agrees_with_jsonschema(value: Any, ok: bool) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    assert jsonschema.Draft202012Validator(OBJ).is_valid(value) is ok


def test_messages_name_the_path() -> None:
    errors = validate({"n": 1, "l": [{"x": "a"}]}, OBJ)
    assert errors == ["$.l[0].x: expected number, got str"]


def test_bad_schemas_are_errors_not_crashes() -> None:
    with pytest.raises(ValueError, match="unknown JSON-schema type"):
        validate(1, {"type": "int"})
    with pytest.raises(ValueError, match="does not resolve"):
        validate(1, {"$ref": "#/$defs/missing"})
    assert validate(1, True) == [] and validate(1, False) != []
