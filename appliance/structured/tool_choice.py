"""The output constraint that `tool_choice` "required" or a named function puts on generation.

- Named function: the output is that function's arguments object, following its parameters schema.
- "required": the output is a JSON array of one or more `{"name": <a tool>, "parameters": {...}}` objects,
  each following its tool's schema (vLLM's shape, so clients see the same behaviour).
- "auto" and "none": no constraint (None); with "none" the server also skips tool-call parsing.
Tools are given as {name: parameters schema}; checking the request's `tools` entries is the parser's ToolSet.
"""
from __future__ import annotations

from typing import Any, Mapping

from appliance.structured.errors import StructuredOutputError
from appliance.structured.spec import StructuredSpec


def named_function(tool_choice: Any) -> str | None:
    """The function name when tool_choice names one, None for "auto"/"none"/"required"/absent."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type", "function") == "function":
        fn = tool_choice.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str) and fn["name"]:
            return fn["name"]
    raise StructuredOutputError(
        "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"
    )


def tool_choice_schema(tools: Mapping[str, Mapping[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    name = named_function(tool_choice)
    if name is not None:
        if name not in tools:
            raise StructuredOutputError(f"tool_choice names {name!r}, which is not in tools")
        return _parameters(tools[name])
    if tool_choice != "required":
        return None
    if not tools:
        raise StructuredOutputError("tool_choice 'required' needs at least one tool")
    variants = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool_name]}, "parameters": _parameters(schema)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool_name, schema in tools.items()
    ]
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {"type": "array", "items": item, "minItems": 1}


def tool_choice_spec(tools: Mapping[str, Mapping[str, Any]], tool_choice: Any) -> StructuredSpec | None:
    schema = tool_choice_schema(tools, tool_choice)
    return None if schema is None else StructuredSpec.json_schema(schema)


def _parameters(schema: Mapping[str, Any]) -> dict[str, Any]:
    # A tool without parameters takes an empty object; "type": "object" keeps the arguments an object.
    out = dict(schema) if schema else {}
    out.setdefault("type", "object")
    return out
