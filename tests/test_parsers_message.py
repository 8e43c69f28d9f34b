"""The per-choice chain: reasoning first, then tool calls on the answer; streaming deltas in OpenAI's shape."""
from __future__ import annotations

import json

import pytest

from appliance.server.parsers.message import MessageDelta, MessageParser, build_message_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PROMPT = "<|im_start|>assistant\n"
TEXT = ('<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}\n</tool_call>')


def _stream(parser: MessageParser, text: str, step: int) -> list[MessageDelta]:
    out = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    return [d for d in out if d is not None]


def _fold(deltas: list[MessageDelta]) -> tuple[str | None, str | None, list[tuple[str, dict]]]:
    reasoning = "".join(d.reasoning_content or "" for d in deltas) or None
    content = "".join(d.content or "" for d in deltas) or None
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for t in d.tool_calls:
            entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
            entry["name"] += t.name or ""
            entry["arguments"] += t.arguments
    return reasoning, content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def _make() -> MessageParser:
    return build_message_parser(reasoning_parser="qwen3", tool_call_parser="hermes", tools=TOOLS, tool_choice="auto",
                                prompt_text=PROMPT)


def test_whole_message() -> None:
    parsed = _make().parse(TEXT)
    assert parsed.reasoning_content == "The user wants weather."
    assert parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert parsed.finish_reason == "tool_calls"


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_message_matches_whole(step: int) -> None:
    parsed = _make().parse(TEXT)
    deltas = _stream(_make(), TEXT, step)
    assert _fold(deltas) == (parsed.reasoning_content, parsed.content,
                             [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls])
    shapes = [d.to_openai() for d in deltas]
    assert all(s for s in shapes)  # no empty deltas are sent
    first_call = next(s for s in shapes if "tool_calls" in s)["tool_calls"][0]
    assert first_call["index"] == 0 and first_call["type"] == "function" and first_call["id"].startswith("call_")
    assert first_call["function"]["name"] == "get_weather"


def test_forced_and_disabled_tool_choices() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    parser = build_message_parser(reasoning_parser=None, tool_call_parser=None, tools=TOOLS, tool_choice=named)
    deltas = _stream(parser, '{"city": "Rome"}', 4)
    assert _fold(deltas) == (None, None, [("get_weather", {"city": "Rome"})])
    none = build_message_parser(reasoning_parser=None, tool_call_parser="hermes", tools=TOOLS, tool_choice="none")
    assert none.parse(TEXT).tool_calls == () and none.parse(TEXT).content == TEXT
    no_tools = build_message_parser(reasoning_parser="qwen3", tool_call_parser="hermes", tools=None)
    assert no_tools.parse(TEXT).content == TEXT.split("</think>\n\n")[1]
    with pytest.raises(ValueError, match="tool_call_parser"):
        build_message_parser(reasoning_parser=None, tool_call_parser=None, tools=TOOLS, tool_choice="auto")
    with pytest.raises(ValueError, match="not in tools"):
        build_message_parser(reasoning_parser=None, tool_call_parser=None, tools=TOOLS,
                             tool_choice={"type": "function", "function": {"name": "nope"}})


def test_invalid_call_is_content_with_errors() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    parser = build_message_parser(reasoning_parser=None, tool_call_parser="hermes", tools=TOOLS)
    parsed = parser.parse(text)
    assert parsed.content == text and parsed.tool_calls == () and parsed.finish_reason is None
    assert "missing required property 'city'" in parsed.errors[0]


def test_needs_special_tokens() -> None:
    assert not _make().needs_special_tokens
    mistral = build_message_parser(reasoning_parser="mistral", tool_call_parser="hermes", tools=TOOLS)
    assert mistral.needs_special_tokens
    assert build_message_parser(reasoning_parser=None, tool_call_parser="mistral", tools=TOOLS).needs_special_tokens
