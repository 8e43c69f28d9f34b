"""Tool calls as `invoke` elements with one `parameter` element per argument: MiniMax-M2, DeepSeek-V3.2, Step-3.

MiniMax-M2 (minimax_m2):

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Beijing</parameter>
    </invoke>
    </minimax:tool_call>

DeepSeek-V3.2 (deepseek_v32), DSML tags with U+FF5C bars and each parameter saying whether it is a string:

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Beijing</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Step-3 (step3) wraps each invoke in DeepSeek-style call markers, `steptml:` tags inside:

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather">
    <steptml:parameter name="city">Beijing</steptml:parameter></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>

A block may hold several invokes. Values are typed by the tool's schema (qwen3_coder.typed_value); a DSML
parameter with string="false" is read as JSON.
"""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.qwen3_coder import typed_value
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall


class InvokeToolParser(ToolParser):
    prefix: ClassVar[str] = ""  # the tag namespace ("" or the DSML marker)

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        return BlockParse(calls=tuple(self._invokes(syntax.body(block))))

    def _invokes(self, body: str) -> list[RawCall]:
        p = re.escape(self.prefix)
        invoke = re.compile(rf'\s*<{p}invoke name="([^"]+)">(.*?)</{p}invoke>', re.DOTALL)
        calls = []
        while body.strip():
            match = invoke.match(body)
            if match is None:
                raise BlockError(f"expected <{self.prefix}invoke name=...>, got {body.strip()[:40]!r}")
            calls.append(self._call(match.group(1), match.group(2)))
            body = body[match.end():]
        return calls

    def _call(self, name: str, body: str) -> RawCall:
        p = re.escape(self.prefix)
        parameter = re.compile(rf'\s*<{p}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{p}parameter>',
                               re.DOTALL)
        spec = self.tools.get(name)
        props: dict[str, Any] = (spec.parameters.get("properties") or {}) if spec else {}
        args: dict[str, Any] = {}
        while body.strip():
            match = parameter.match(body)
            if match is None:
                raise BlockError(f"expected <{self.prefix}parameter name=...>, got {body.strip()[:40]!r}")
            key, is_string, raw = match.groups()
            if is_string == "true":
                args[key] = raw
            elif is_string == "false":
                try:
                    args[key] = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise BlockError(f"parameter {key!r} is not JSON: {e}") from None
            else:
                prop = props.get(key)
                args[key] = typed_value(raw.strip("\n"), prop if isinstance(prop, dict) else {})
            body = body[match.end():]
        return RawCall(name=name, arguments=args)


class MiniMaxM2ToolParser(InvokeToolParser):
    name = "minimax_m2"
    blocks = (BlockSyntax("<minimax:tool_call>", "</minimax:tool_call>"),)


class DeepSeekV32ToolParser(InvokeToolParser):
    name = "deepseek_v32"
    prefix = "｜DSML｜"
    blocks = (BlockSyntax("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),)


_STEP3_CALL = re.compile(r"\s*<｜tool_call_begin｜>\s*function\s*<｜tool_sep｜>(.*?)<｜tool_call_end｜>", re.DOTALL)


class Step3ToolParser(InvokeToolParser):
    name = "step3"
    prefix = "steptml:"
    blocks = (BlockSyntax("<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"),)
    needs_special_tokens = True

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        body, calls = syntax.body(block), []
        while body.strip():
            match = _STEP3_CALL.match(body)
            if match is None:
                raise BlockError(f"expected <｜tool_call_begin｜>function<｜tool_sep｜>..., got {body.strip()[:40]!r}")
            calls.extend(self._invokes(match.group(1)))
            body = body[match.end():]
        return BlockParse(calls=tuple(calls))
