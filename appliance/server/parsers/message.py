"""Reasoning and tool-call parsing chained for one choice of a chat completion: the piece the chat route calls.

The reasoning parser splits the generated text first; only the answer (content) goes on to the tool-call
parser. Streaming yields MessageDelta records whose `to_openai()` is a `choices[i].delta` body.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from appliance.server.parsers.reasoning import ReasoningParser, get_reasoning_parser
from appliance.server.parsers.tool_calls import (
    Delta,
    ForcedToolStream,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolSet,
    get_tool_parser,
    parse_forced_output,
)
from appliance.structured.tool_choice import named_function


@dataclass(frozen=True)
class MessageDelta:
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [t.to_openai() for t in self.tool_calls]
        return out


@dataclass(frozen=True)
class ParsedMessage:
    reasoning_content: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def finish_reason(self) -> str | None:
        """"tool_calls" when the message calls tools (it replaces "stop"), else None (keep the engine's)."""
        return "tool_calls" if self.tool_calls else None


class MessageParser:
    """One per choice. `feed` text deltas and `finish` once, or `parse` the whole text."""

    def __init__(self, *, reasoning: ReasoningParser | None = None, tools: ToolParser | ForcedToolStream | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self._tool_deltas: list[Delta] = []

    @property
    def needs_special_tokens(self) -> bool:
        """Detokenize this choice with skip_special_tokens=False: some marker is a special token."""
        reasoning = self.reasoning is not None and self.reasoning.format.needs_special_tokens
        tools = isinstance(self.tools, ToolParser) and self.tools.needs_special_tokens
        return reasoning or tools

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(self.tools.errors) if self.tools is not None else ()

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text or None)
        if self.tools is None:
            return ParsedMessage(reasoning, content)
        if isinstance(self.tools, ForcedToolStream):
            parsed = parse_forced_output(content or "", self.tools.tools, self.tools.tool_choice)
        else:
            parsed = self.tools.parse(content or "")
        return ParsedMessage(reasoning, parsed.content, parsed.tool_calls, parsed.errors)

    def feed(self, delta_text: str) -> MessageDelta | None:
        reasoning, content = self.reasoning.feed(delta_text) if self.reasoning else (None, delta_text or None)
        return self._merge(reasoning, self._tool_step(content, final=False))

    def finish(self) -> MessageDelta | None:
        reasoning, content = self.reasoning.finish() if self.reasoning else (None, None)
        return self._merge(reasoning, self._tool_step(content, final=True))

    def _tool_step(self, content: str | None, *, final: bool) -> list[Delta]:
        if self.tools is None:
            return [Delta(content=content)] if content else []
        deltas = self.tools.feed(content) if content else []
        return deltas + self.tools.finish() if final else deltas

    @staticmethod
    def _merge(reasoning: str | None, deltas: list[Delta]) -> MessageDelta | None:
        content = "".join(d.content for d in deltas if d.content is not None) or None
        calls = tuple(d.tool_call for d in deltas if d.tool_call is not None)
        if reasoning is None and content is None and not calls:
            return None
        return MessageDelta(reasoning_content=reasoning, content=content, tool_calls=_coalesce(calls))


def _coalesce(calls: tuple[ToolCallDelta, ...]) -> tuple[ToolCallDelta, ...]:
    """Deltas of one call that arrive in the same step become one entry, as OpenAI sends them."""
    out: list[ToolCallDelta] = []
    for c in calls:
        if out and out[-1].index == c.index and c.id is None and c.name is None:
            last = out[-1]
            out[-1] = ToolCallDelta(index=last.index, id=last.id, name=last.name, arguments=last.arguments + c.arguments)
        else:
            out.append(c)
    return tuple(out)


def build_message_parser(
    *,
    reasoning_parser: str | None,
    tool_call_parser: str | None,
    tools: list[Mapping[str, Any]] | None,
    tool_choice: Any = None,
    thinking_enabled: bool = True,
    prompt_text: str | None = None,
) -> MessageParser:
    """The parser for one choice of one request (ValueError for a bad request or an unusable setting -> 400).

    - No tools, or tool_choice "none": no tool-call parsing.
    - tool_choice "required" or a named function: the output was forced by forced_tool_spec; read it as such.
    - tool_choice "auto" (the default with tools): needs api.tool_call_parser.
    """
    reasoning = (
        get_reasoning_parser(reasoning_parser, thinking_enabled=thinking_enabled, prompt_text=prompt_text)
        if reasoning_parser
        else None
    )
    toolset = ToolSet(tools)
    if not len(toolset) or tool_choice == "none":
        return MessageParser(reasoning=reasoning)
    name = named_function(tool_choice)
    if name is not None and name not in toolset:
        raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    if tool_choice == "required" or name is not None:
        return MessageParser(reasoning=reasoning, tools=ForcedToolStream(toolset, tool_choice))
    if not tool_call_parser:
        raise ValueError('tool_choice "auto" needs a tool-call parser: set api.tool_call_parser')
    return MessageParser(reasoning=reasoning, tools=get_tool_parser(tool_call_parser)(toolset))
