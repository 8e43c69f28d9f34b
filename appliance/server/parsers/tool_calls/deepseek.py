"""DeepSeek V3 / R1-0528 and V3.1 tool calls, inside `<｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>`.

V3:   `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`
V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`
Both forms are read by one parser (registered as deepseek_v3 and deepseek_v31); calls are separated by
optional whitespace. The markers use U+FF5C (fullwidth bar) and U+2581 (lower one-eighth block).
"""
from __future__ import annotations

import re

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.json_text import arguments_value, decode_whole
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
TOOL_CALLS = BlockSyntax(CALLS_BEGIN, CALLS_END)
_V3_BODY = re.compile(r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*\Z", re.DOTALL)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    blocks = (TOOL_CALLS,)
    needs_special_tokens = True  # the markers are special tokens of the DeepSeek tokenizer

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        body = syntax.body(block)
        calls: list[RawCall] = []
        rest = body
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith(CALL_BEGIN):
                raise BlockError(f"expected {CALL_BEGIN}, got {rest[:30]!r}")
            end = rest.find(CALL_END)
            if end < 0:
                raise BlockError(f"a call without {CALL_END}")
            calls.append(self._call(rest[len(CALL_BEGIN) : end]))
            rest = rest[end + len(CALL_END) :]
        return BlockParse(calls=tuple(calls))

    @staticmethod
    def _call(text: str) -> RawCall:
        head, sep, tail = text.partition(SEP)
        if not sep:
            raise BlockError(f"a call without {SEP}")
        if head.strip() == "function":
            match = _V3_BODY.match(tail)
            if match is None:
                raise BlockError("expected NAME, then the arguments in a ```json fence")
            return RawCall(name=match.group(1), arguments=arguments_value(decode_whole(match.group(2))))
        name = head.strip()
        if not name:
            raise BlockError("a call without a function name")
        return RawCall(name=name, arguments=arguments_value(decode_whole(tail)))
