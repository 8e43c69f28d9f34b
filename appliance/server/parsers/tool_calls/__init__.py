"""Tool-call parsers, chosen by name (api.tool_call_parser). See appliance/server/parsers/__init__.py for the API."""
from __future__ import annotations

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.deepseek import DeepSeekV3ToolParser
from appliance.server.parsers.tool_calls.forced import ForcedToolStream, forced_tool_spec, parse_forced_output
from appliance.server.parsers.tool_calls.glm import Glm45ToolParser
from appliance.server.parsers.tool_calls.harmony import HarmonyToolParser
from appliance.server.parsers.tool_calls.hermes import HermesToolParser
from appliance.server.parsers.tool_calls.invoke_xml import (
    DeepSeekV32ToolParser,
    MiniMaxM2ToolParser,
    Step3ToolParser,
)
from appliance.server.parsers.tool_calls.kimi_k2 import KimiK2ToolParser
from appliance.server.parsers.tool_calls.llama3_json import Llama3JsonToolParser
from appliance.server.parsers.tool_calls.mistral import MistralToolParser
from appliance.server.parsers.tool_calls.pythonic import PythonicToolParser
from appliance.server.parsers.tool_calls.qwen3_coder import Qwen3CoderToolParser
from appliance.server.parsers.tool_calls.records import (
    Delta,
    ParsedTools,
    ToolCall,
    ToolCallDelta,
    assemble,
)
from appliance.server.parsers.tool_calls.tools import ToolSet

_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,  # TokenSpeed/SGLang name for the Qwen2.5/3 format
    "qwen25": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama3": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "deepseek_v32": DeepSeekV32ToolParser,
    "deepseekv32": DeepSeekV32ToolParser,  # SGLang's spelling
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,  # the same calls without the newlines
    "kimi_k2": KimiK2ToolParser,
    "kimik2": KimiK2ToolParser,  # TokenSpeed's spelling
    "minimax_m2": MiniMaxM2ToolParser,
    "step3": Step3ToolParser,
    "gpt_oss": HarmonyToolParser,
    "openai": HarmonyToolParser,  # vLLM's name for the gpt-oss (harmony) parser
}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool_call_parser {name!r}; choose one of {', '.join(tool_parser_names())}") from None


__all__ = [
    "BlockSyntax",
    "Delta",
    "ForcedToolStream",
    "ParsedTools",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolSet",
    "assemble",
    "forced_tool_spec",
    "get_tool_parser",
    "parse_forced_output",
    "tool_parser_names",
]
