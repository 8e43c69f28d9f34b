"""Kimi-K2 tool calls: a section of calls, each with the model's own id `functions.NAME:INDEX`.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>

The id is kept as the call's id (Kimi's template writes it back into the conversation); the markers are special
tokens of the Kimi tokenizer.
"""
from __future__ import annotations

import re

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.json_text import arguments_value, decode_whole
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall

SECTION = BlockSyntax("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^:<\s]+)(?::\d+)?)\s*"
                   r"<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>", re.DOTALL)


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    blocks = (SECTION,)
    needs_special_tokens = True

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        body, calls = syntax.body(block), []
        while body.strip():
            match = _CALL.match(body)
            if match is None:
                raise BlockError(f"expected <|tool_call_begin|>functions.NAME:I..., got {body.strip()[:40]!r}")
            calls.append(RawCall(name=match["name"], arguments=arguments_value(decode_whole(match["args"])),
                                 id=match["id"]))
            body = body[match.end():]
        return BlockParse(calls=tuple(calls))
