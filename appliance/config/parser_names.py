"""The output parsers this build implements, by the names api.reasoning_parser and api.tool_call_parser take.

appliance/server/parsers registers one implementation per name; tests/test_parser_names.py holds the two in step.
The names live here so that config can refuse a parser the build lacks without importing the server.
"""
from __future__ import annotations

REASONING_PARSERS: frozenset[str] = frozenset({
    "base", "deepseek_r1", "deepseek_v31", "deepseek_v32", "glm45", "gpt_oss", "kimi_k2", "kimi_k25", "minimax",
    "minimax_m2", "mistral", "openai_gptoss", "qwen3",
})
TOOL_CALL_PARSERS: frozenset[str] = frozenset({
    "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseekv32", "glm45", "glm47", "gpt_oss", "hermes", "kimi_k2",
    "kimik2", "llama3", "llama3_json", "minimax_m2", "mistral", "openai", "pythonic", "qwen", "qwen25", "qwen3_coder",
    "step3",
})
