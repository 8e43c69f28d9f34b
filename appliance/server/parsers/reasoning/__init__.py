"""Reasoning parsers, chosen by name (api.reasoning_parser). See appliance/server/parsers/__init__.py for the API."""
from __future__ import annotations

import dataclasses

from appliance.server.parsers.reasoning.budget import (
    REASONING_EFFORT_BUDGETS,
    ThinkingBudget,
    ThinkingDecision,
    resolve_thinking,
)
from appliance.server.parsers.reasoning.harmony import HarmonyParser
from appliance.server.parsers.reasoning.parser import ReasoningFormat, ReasoningParser, prompt_opens_reasoning

_FORMATS: dict[str, ReasoningFormat] = {
    # R1's template ends the prompt with "<think>\n": the output starts inside the block.
    "deepseek_r1": ReasoningFormat(starts_in_reasoning=True),
    # Qwen3: the model opens the block itself, or the template does (2507 thinking models); with
    # enable_thinking=False the template closes an empty block in the prompt and the output is all content.
    "qwen3": ReasoningFormat(),
    # DeepSeek V3.1 and Kimi K2: the template opens the block when thinking is on (found from the prompt).
    "deepseek_v31": ReasoningFormat(),
    "kimi_k2": ReasoningFormat(),
    "kimi_k25": ReasoningFormat(),
    # DeepSeek V3.2 opens the block in its template like V3.1; GLM-4.5/4.6/4.7 open it themselves or get an
    # empty one in the prompt when thinking is off, as Qwen3 does
    "deepseek_v32": ReasoningFormat(),
    "glm45": ReasoningFormat(),
    # MiniMax-M2 never writes the start tag: its output starts inside the block
    "minimax_m2": ReasoningFormat(starts_in_reasoning=True),
    "minimax": ReasoningFormat(starts_in_reasoning=True),  # SGLang's name
    # gpt-oss: harmony messages, the analysis channel is the reasoning (the tags serve the thinking budget)
    "gpt_oss": ReasoningFormat(start="<|channel|>analysis<|message|>", end="<|end|>", needs_special_tokens=True,
                               harmony=True),
    "base": ReasoningFormat(),
    # Magistral / Mistral v13+ reasoning models use special tokens [THINK]...[/THINK].
    "mistral": ReasoningFormat(start="[THINK]", end="[/THINK]", needs_special_tokens=True),
}


_FORMATS["openai_gptoss"] = _FORMATS["gpt_oss"]  # vLLM's name (SGLang's gpt-oss arrives as gpt_oss: config/Name)


def reasoning_parser_names() -> list[str]:
    return sorted(_FORMATS)


def get_reasoning_format(name: str, *, start: str | None = None, end: str | None = None) -> ReasoningFormat:
    """The named format; `start` / `end` override its tags (the configurable `base` parser)."""
    try:
        fmt = _FORMATS[name]
    except KeyError:
        choices = ", ".join(reasoning_parser_names())
        raise ValueError(f"unknown reasoning_parser {name!r}; choose one of {choices}") from None
    if start is not None or end is not None:
        fmt = dataclasses.replace(fmt, start=start or fmt.start, end=end or fmt.end)
    if not fmt.start or not fmt.end:
        raise ValueError("reasoning tags must be non-empty")
    return fmt


def get_reasoning_parser(
    name: str,
    *,
    thinking_enabled: bool = True,
    prompt_text: str | None = None,
    start: str | None = None,
    end: str | None = None,
) -> ReasoningParser:
    fmt = get_reasoning_format(name, start=start, end=end)
    cls = HarmonyParser if fmt.harmony else ReasoningParser
    return cls(fmt, thinking_enabled=thinking_enabled, prompt_text=prompt_text)


__all__ = [
    "REASONING_EFFORT_BUDGETS",
    "ReasoningFormat",
    "ReasoningParser",
    "ThinkingBudget",
    "ThinkingDecision",
    "get_reasoning_format",
    "get_reasoning_parser",
    "prompt_opens_reasoning",
    "reasoning_parser_names",
    "resolve_thinking",
]
