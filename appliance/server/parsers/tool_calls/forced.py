"""tool_choice "required" or a named function: the constraint to generate under, and reading its output back.

Under such a tool_choice the model's own tool-call format is not used: generation is forced by the JSON schema
of appliance.structured.tool_choice, and the output is read here into tool calls.
"""
from __future__ import annotations

import json
from typing import Any

from appliance.server.parsers.tool_calls.records import (
    Delta,
    IdFactory,
    ParsedTools,
    ToolCall,
    ToolCallDelta,
    openai_call_id,
)
from appliance.server.parsers.tool_calls.tools import ToolSet
from appliance.structured.spec import StructuredSpec
from appliance.structured.tool_choice import named_function, tool_choice_spec


def forced_tool_spec(tools: ToolSet, tool_choice: Any) -> StructuredSpec | None:
    """The structured-output spec for this tool_choice, or None when the choice does not force a call."""
    return tool_choice_spec({t.name: t.parameters for t in tools}, tool_choice)


def parse_forced_output(
    text: str, tools: ToolSet, tool_choice: Any, *, id_factory: IdFactory = openai_call_id
) -> ParsedTools:
    """Tool calls from output generated under forced_tool_spec; invalid output is returned as content."""
    name = named_function(tool_choice)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return ParsedTools(content=text or None, errors=(f"forced tool call is not JSON: {e.msg}",))
    if name is not None:
        raw = [(name, value)]
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        raw = [(v.get("name"), v.get("parameters", {})) for v in value]
    else:
        return ParsedTools(content=text or None, errors=("forced tool calls must be a non-empty JSON array",))
    problems = [p for fn, args in raw for p in tools.check_arguments(str(fn), args)]
    if problems:
        return ParsedTools(content=text or None, errors=tuple(problems))
    calls = tuple(
        ToolCall(id=id_factory(), name=str(fn), arguments=json.dumps(args, ensure_ascii=False)) for fn, args in raw
    )
    return ParsedTools(content=None, tool_calls=calls)


class ForcedToolStream:
    """Streams a forced call with the same Delta records as ToolParser.feed/finish.

    Named function: the id and name go out first, then the arguments text as it is generated (the grammar
    guarantees it is the arguments object). "required": the array is read when the output is complete.
    """

    def __init__(self, tools: ToolSet, tool_choice: Any, *, id_factory: IdFactory = openai_call_id) -> None:
        self.tools = tools
        self.tool_choice = tool_choice
        self._name = named_function(tool_choice)
        self._id_factory = id_factory
        self._started = False
        self._buf: list[str] = []
        self.errors: tuple[str, ...] = ()

    def feed(self, delta_text: str) -> list[Delta]:
        self._buf.append(delta_text)
        if self._name is None:
            return []
        out: list[Delta] = []
        if not self._started:
            self._started = True
            out.append(Delta(tool_call=ToolCallDelta(index=0, id=self._id_factory(), name=self._name)))
        if delta_text:
            out.append(Delta(tool_call=ToolCallDelta(index=0, arguments=delta_text)))
        return out

    def finish(self) -> list[Delta]:
        text = "".join(self._buf)
        parsed = parse_forced_output(text, self.tools, self.tool_choice, id_factory=self._id_factory)
        self.errors = parsed.errors
        if self._name is not None:
            if not self._started:
                return [Delta(tool_call=ToolCallDelta(index=0, id=self._id_factory(), name=self._name))]
            return []
        if not parsed.tool_calls:
            return [Delta(content=text)] if text else []
        out: list[Delta] = []
        for i, call in enumerate(parsed.tool_calls):
            out.append(Delta(tool_call=ToolCallDelta(index=i, id=call.id, name=call.name)))
            out.append(Delta(tool_call=ToolCallDelta(index=i, arguments=call.arguments)))
        return out
