"""Llama 3.1/3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `;`.

The calls are the whole output, optionally after `<|python_tag|>`; a `{` counts as an opener only as the first
non-whitespace text of the output (mid-sentence JSON is content). The block has no closing marker, so
streamed calls (and output that merely starts with `{`) come out when the output ends.
"""
from __future__ import annotations

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.json_text import call_from_object, decode_prefix
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall

PYTHON_TAG = BlockSyntax("<|python_tag|>", None)
BARE_JSON = BlockSyntax("{", None, at_start_only=True)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    blocks = (PYTHON_TAG, BARE_JSON)
    needs_special_tokens = True  # <|python_tag|> is a special token

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        rest = block[len(PYTHON_TAG.start) :] if syntax is PYTHON_TAG else block
        calls: list[RawCall] = []
        while True:
            obj, rest = decode_prefix(rest)
            calls.append(call_from_object(obj, ("parameters", "arguments")))
            rest = rest.lstrip()
            if not rest:
                return BlockParse(calls=tuple(calls))
            if not rest.startswith(";"):
                raise BlockError(f"expected ';' between calls, got {rest[:20]!r}")
            rest = rest[1:]
