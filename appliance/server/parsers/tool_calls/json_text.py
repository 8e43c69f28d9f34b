"""JSON helpers shared by the JSON-based tool-call formats."""
from __future__ import annotations

import json
from typing import Any

from appliance.server.parsers.tool_calls.records import BlockError, RawCall

_DECODER = json.JSONDecoder()


def decode_prefix(text: str) -> tuple[Any, str]:
    """Decode one JSON value at the start of `text` (leading whitespace allowed); return it and the rest."""
    stripped = text.lstrip()
    try:
        value, end = _DECODER.raw_decode(stripped)
    except json.JSONDecodeError as e:
        raise BlockError(f"invalid JSON: {e.msg} at {e.pos}") from None
    return value, stripped[end:]


def decode_whole(text: str) -> Any:
    value, rest = decode_prefix(text)
    if rest.strip():
        raise BlockError(f"unexpected text after the JSON value: {rest.strip()[:40]!r}")
    return value


def arguments_value(value: Any) -> Any:
    """Some models write the arguments object as a JSON string; read it as the object it holds."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise BlockError("arguments are a string that is not JSON") from None
    return value


def call_from_object(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> RawCall:
    """`{"name": ..., "arguments": {...}}` (or `parameters`) as a call."""
    if not isinstance(obj, dict):
        raise BlockError(f"a call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise BlockError("a call needs a string 'name'")
    for key in args_keys:
        if key in obj:
            args = arguments_value(obj[key])
            break
    else:
        args = {}
    call_id = obj.get("id")
    return RawCall(name=name, arguments=args, id=call_id if isinstance(call_id, str) and call_id else None)
