"""A small validator for the JSON-schema subset that tool definitions use.

Supported keywords: type (a name or a list; "integer" accepts 3 and 3.0, booleans are never numbers), enum,
const, properties, required, additionalProperties (bool or schema), items (a schema), minItems, maxItems,
minLength, maxLength, minimum, maximum, exclusiveMinimum, exclusiveMaximum, anyOf, oneOf, allOf, not, and
$ref to "#/$defs/..." or "#/definitions/...". Other keywords (format, pattern, description, title, default,
examples, ...) are annotations here and are not checked: a tool schema using them still works, and the
argument check is then looser than the schema, never stricter.
"""
from __future__ import annotations

from typing import Any

_MAX_DEPTH = 64

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return not isinstance(value, bool) and (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        )
    if name == "number":
        return not isinstance(value, bool) and isinstance(value, (int, float))
    kinds = _TYPES.get(name)
    if kinds is None:
        raise ValueError(f"unknown JSON-schema type {name!r}")
    return isinstance(value, kinds)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 1 is 1.0, containers compare element by element."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    numeric_a, numeric_b = isinstance(a, (int, float)), isinstance(b, (int, float))
    if numeric_a or numeric_b:
        return numeric_a and numeric_b and a == b
    return type(a) is type(b) and a == b


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref ('#/...') is supported, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"$ref {ref!r} does not resolve")
        node = node[part]
    if not isinstance(node, (dict, bool)):
        raise ValueError(f"$ref {ref!r} does not point at a schema")
    return node


def validate(value: Any, schema: dict[str, Any] | bool) -> list[str]:
    """Every violation as 'path: message'; an empty list means the value is valid."""
    errors: list[str] = []
    root = schema if isinstance(schema, dict) else {}
    _check(value, schema, root, "$", errors, 0)
    return errors


def _check(
    value: Any, schema: dict[str, Any] | bool, root: dict[str, Any], path: str, errors: list[str], depth: int
) -> None:
    if depth > _MAX_DEPTH:
        errors.append(f"{path}: schema nesting deeper than {_MAX_DEPTH}")
        return
    if schema is True or schema == {}:
        return
    if schema is False:
        errors.append(f"{path}: no value is allowed here")
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: a schema must be an object or a boolean")
    if "$ref" in schema:
        _check(value, _resolve(schema["$ref"], root), root, path, errors, depth + 1)
    _check_type(value, schema, path, errors)
    if "enum" in schema and not any(_same(value, option) for option in schema["enum"]):
        errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}")
    if "const" in schema and not _same(value, schema["const"]):
        errors.append(f"{path}: {value!r} is not {schema['const']!r}")
    _check_combinators(value, schema, root, path, errors, depth)
    if isinstance(value, dict):
        _check_object(value, schema, root, path, errors, depth)
    elif isinstance(value, list):
        _check_array(value, schema, root, path, errors, depth)
    elif isinstance(value, str):
        _check_bounds(len(value), schema, "minLength", "maxLength", "length", path, errors)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_number(value, schema, path, errors)


def _check_type(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    declared = schema.get("type")
    if declared is None:
        return
    names = declared if isinstance(declared, list) else [declared]
    if not any(_is_type(value, n) for n in names):
        errors.append(f"{path}: expected {' or '.join(names)}, got {type(value).__name__}")


def _check_combinators(
    value: Any, schema: dict[str, Any], root: dict[str, Any], path: str, errors: list[str], depth: int
) -> None:
    def ok(sub: Any) -> bool:
        found: list[str] = []
        _check(value, sub, root, path, found, depth + 1)
        return not found

    if "anyOf" in schema and not any(ok(s) for s in schema["anyOf"]):
        errors.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema:
        matched = sum(ok(s) for s in schema["oneOf"])
        if matched != 1:
            errors.append(f"{path}: matches {matched} of oneOf, expected exactly 1")
    for sub in schema.get("allOf", ()):
        _check(value, sub, root, path, errors, depth + 1)
    if "not" in schema and ok(schema["not"]):
        errors.append(f"{path}: matches a schema it must not match")


def _check_object(
    value: dict[str, Any], schema: dict[str, Any], root: dict[str, Any], path: str, errors: list[str], depth: int
) -> None:
    props: dict[str, Any] = schema.get("properties", {})
    for key in schema.get("required", ()):
        if key not in value:
            errors.append(f"{path}: missing required property {key!r}")
    extra_schema = schema.get("additionalProperties", True)
    for key, item in value.items():
        sub_path = f"{path}.{key}"
        if key in props:
            _check(item, props[key], root, sub_path, errors, depth + 1)
        elif extra_schema is False:
            errors.append(f"{path}: unexpected property {key!r}")
        elif isinstance(extra_schema, dict):
            _check(item, extra_schema, root, sub_path, errors, depth + 1)


def _check_array(
    value: list[Any], schema: dict[str, Any], root: dict[str, Any], path: str, errors: list[str], depth: int
) -> None:
    _check_bounds(len(value), schema, "minItems", "maxItems", "item count", path, errors)
    items = schema.get("items")
    if isinstance(items, (dict, bool)):
        for i, item in enumerate(value):
            _check(item, items, root, f"{path}[{i}]", errors, depth + 1)


def _check_bounds(n: int, schema: dict[str, Any], lo: str, hi: str, what: str, path: str, errors: list[str]) -> None:
    if lo in schema and n < schema[lo]:
        errors.append(f"{path}: {what} {n} is below {lo} {schema[lo]}")
    if hi in schema and n > schema[hi]:
        errors.append(f"{path}: {what} {n} is above {hi} {schema[hi]}")


def _check_number(
    value: float, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} < minimum {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        errors.append(f"{path}: {value} <= exclusiveMinimum {schema['exclusiveMinimum']}")
    if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
        errors.append(f"{path}: {value} >= exclusiveMaximum {schema['exclusiveMaximum']}")
