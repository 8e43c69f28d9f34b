"""Qwen3-Coder XML tool calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (the template writes one newline on each side, which is removed). They are typed
by the tool's schema: string stays text; integer, number, boolean and null are read as such; object and array
are read as JSON (or a Python literal). A value that does not read as its declared type stays text, and the
schema check then rejects the call. Without a declared type a value is read as JSON when it is JSON.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall

TOOL_CALL = BlockSyntax("<tool_call>", "</tool_call>")
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    blocks = (TOOL_CALL,)

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        body = syntax.body(block)
        calls: list[RawCall] = []
        last = 0
        for match in _FUNCTION.finditer(body):
            if body[last : match.start()].strip():
                raise BlockError(f"unexpected text in <tool_call>: {body[last:match.start()].strip()[:40]!r}")
            last = match.end()
            calls.append(self._call(match.group(1).strip(), match.group(2)))
        if body[last:].strip():
            raise BlockError(f"unexpected text in <tool_call>: {body[last:].strip()[:40]!r}")
        return BlockParse(calls=tuple(calls))

    def _call(self, name: str, body: str) -> RawCall:
        spec = self.tools.get(name)
        props: dict[str, Any] = (spec.parameters.get("properties") or {}) if spec else {}
        args: dict[str, Any] = {}
        last = 0
        for match in _PARAMETER.finditer(body):
            if body[last : match.start()].strip():
                raise BlockError(f"unexpected text in <function={name}>: {body[last:match.start()].strip()[:40]!r}")
            last = match.end()
            key = match.group(1).strip()
            prop = props.get(key)
            args[key] = typed_value(unwrap_newlines(match.group(2)), prop if isinstance(prop, dict) else {})
        if body[last:].strip():
            raise BlockError(f"unexpected text in <function={name}>: {body[last:].strip()[:40]!r}")
        return RawCall(name=name, arguments=args)


def unwrap_newlines(raw: str) -> str:
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def typed_value(raw: str, schema: dict[str, Any]) -> Any:
    declared = schema.get("type")
    names = declared if isinstance(declared, list) else [declared] if declared else []
    if "string" in names:
        return raw
    text = raw.strip()
    for name in names:
        value = _read_as(text, name)
        if value is not _FAIL:
            return value
    if not names:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return raw
    return raw


_FAIL = object()


def _read_as(text: str, type_name: str) -> Any:
    try:
        if type_name == "integer":
            return int(text)
        if type_name == "number":
            value = float(text)
            return int(value) if value.is_integer() and re.fullmatch(r"[-+]?\d+", text) else value
        if type_name == "boolean":
            return {"true": True, "false": False}.get(text.lower(), _FAIL)
        if type_name == "null":
            return None if text.lower() in ("null", "none") else _FAIL
        if type_name in ("object", "array"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return _FAIL
    return _FAIL
