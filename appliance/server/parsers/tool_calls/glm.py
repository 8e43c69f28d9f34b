"""GLM-4.5 / 4.6 (glm45) and GLM-4.7 (glm47) tool calls: one `<tool_call>` block per call.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    </tool_call>

GLM-4.7 writes the same without the newlines. Values are typed by the tool's schema as Qwen3-Coder's are
(qwen3_coder.typed_value): text for strings, JSON-ish reading for the other types.
"""
from __future__ import annotations

import re
from typing import Any

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.qwen3_coder import typed_value
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall

TOOL_CALL = BlockSyntax("<tool_call>", "</tool_call>")
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45ToolParser(ToolParser):
    name = "glm45"
    blocks = (TOOL_CALL,)

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        body = syntax.body(block)
        cut = body.find("<arg_key>")
        name = (body if cut < 0 else body[:cut]).strip()
        if not name or "\n" in name or "<" in name:
            raise BlockError(f"expected a function name, got {name[:40]!r}")
        spec = self.tools.get(name)
        props: dict[str, Any] = (spec.parameters.get("properties") or {}) if spec else {}
        args: dict[str, Any] = {}
        rest = "" if cut < 0 else body[cut:]
        while rest.strip():
            match = _PAIR.match(rest)
            if match is None:
                raise BlockError(f"expected <arg_key>/<arg_value> pairs, got {rest.strip()[:40]!r}")
            key = match.group(1).strip()
            prop = props.get(key)
            args[key] = typed_value(match.group(2), prop if isinstance(prop, dict) else {})
            rest = rest[match.end():]
        return BlockParse(calls=(RawCall(name=name, arguments=args),))
