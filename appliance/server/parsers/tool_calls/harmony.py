"""gpt-oss tool calls, as the harmony reasoning parser (reasoning/harmony.py) passes them on:

    <|channel|>commentary to=functions.get_weather<|message|>{"city": "SF"}<|call|>

One block per call; the arguments are a JSON object. Needs api.reasoning_parser = gpt_oss in front of it, which
turns the model's harmony messages into this form (the markers are special tokens of the o200k_harmony
vocabulary).
"""
from __future__ import annotations

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.json_text import arguments_value, decode_whole
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall

CALL = BlockSyntax("<|channel|>commentary to=", "<|call|>")


class HarmonyToolParser(ToolParser):
    name = "gpt_oss"
    blocks = (CALL,)
    needs_special_tokens = True

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        recipient, sep, args = syntax.body(block).partition("<|message|>")
        if not sep or not recipient.startswith("functions.") or not recipient[len("functions."):]:
            raise BlockError(f"expected functions.NAME<|message|>, got {recipient[:40]!r}")
        return BlockParse(calls=(RawCall(name=recipient[len("functions."):], arguments=arguments_value(
            decode_whole(args))),))
