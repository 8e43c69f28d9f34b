"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call."""
from __future__ import annotations

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.json_text import call_from_object, decode_whole
from appliance.server.parsers.tool_calls.records import BlockParse

TOOL_CALL = BlockSyntax("<tool_call>", "</tool_call>")


class HermesToolParser(ToolParser):
    name = "hermes"
    blocks = (TOOL_CALL,)

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        body = syntax.body(block)
        return BlockParse(calls=(call_from_object(decode_whole(body)),))
