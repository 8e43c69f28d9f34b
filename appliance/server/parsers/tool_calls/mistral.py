"""Mistral: everything after `[TOOL_CALLS]` is calls, in one of the tokenizer versions' forms.

- v3/v7 (Mistral-7B-v0.3, Nemo, Mixtral): `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]`
- v11 (Mistral-Small-3.2): `[TOOL_CALLS]name[CALL_ID]abcDEF123[ARGS]{...}` repeated, one marker per call
- v13+ (Magistral-2509, Ministral-3, Devstral-2): `[TOOL_CALLS]name[ARGS]{...}` repeated
- the compact `[TOOL_CALLS]name{...}` form some renderers produce (no [ARGS])
Text after the last call's JSON is content. There is no closing marker, so streamed calls come out when the
output ends. Ids follow Mistral's rule (9 alphanumerics) because Mistral
templates reject any other id when the call comes back in the conversation.
"""
from __future__ import annotations

import re

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.json_text import arguments_value, call_from_object, decode_prefix
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall, mistral_call_id

TOOL_CALLS = BlockSyntax("[TOOL_CALLS]", None)
_HEADER = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?(?:\[ARGS\])?")


class MistralToolParser(ToolParser):
    name = "mistral"
    blocks = (TOOL_CALLS,)
    needs_special_tokens = True  # [TOOL_CALLS], [ARGS] and [CALL_ID] are control tokens

    @staticmethod
    def default_call_id() -> str:
        return mistral_call_id()

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        body = syntax.body(block)
        if body.lstrip().startswith("["):
            return self._json_array(body)
        segments = body.split(syntax.start)
        calls: list[RawCall] = []
        trailing = ""
        for i, segment in enumerate(segments):
            call, rest = self._compact_call(segment)
            calls.append(call)
            if i < len(segments) - 1 and rest.strip():
                raise BlockError(f"unexpected text between calls: {rest.strip()[:40]!r}")
            trailing = rest
        return BlockParse(calls=tuple(calls), trailing_content=trailing)

    @staticmethod
    def _json_array(body: str) -> BlockParse:
        value, rest = decode_prefix(body)
        if not isinstance(value, list):
            raise BlockError("expected a JSON array of calls")
        return BlockParse(calls=tuple(call_from_object(obj) for obj in value), trailing_content=rest)

    @staticmethod
    def _compact_call(segment: str) -> tuple[RawCall, str]:
        header = _HEADER.match(segment)
        if header is None:
            raise BlockError(f"expected a function name after [TOOL_CALLS], got {segment[:40]!r}")
        args, rest = decode_prefix(segment[header.end() :])
        return RawCall(name=header.group(1), arguments=arguments_value(args), id=header.group(2)), rest
