"""Property: for any text, streaming in any chunks gives what the whole-text parse gives (tool calls and reasoning)."""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.server.parsers import assemble, get_reasoning_parser, get_tool_parser, tool_parser_names

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "call>", '{"name": "get_time", "arguments": {}}', '{"name": "nope"}',
    "<function=get_time>", "</function>", "<parameter=tz>", "UTC", "</parameter>",
    "[TOOL_CALLS]", "get_time", "[ARGS]", "{}", "<|python_tag|>", '{"name": "get_time", "parameters": {}}', ";",
    "[get_time()]", "<|python_start|>", "<|python_end|>", "[", "]", "{", "}",
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "get_time<｜tool▁sep｜>{}", "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>", "<think>", "</think>", "<th", "</", "hello", " ", "\n", "é☃",
]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join)
cuts = st.lists(st.integers(min_value=0, max_value=200), max_size=6)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _chunks(text: str, positions: list[int]) -> list[str]:
    points = sorted({min(p, len(text)) for p in positions})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@SETTINGS
@given(text=texts, positions=cuts, name=st.sampled_from(tool_parser_names()))
def test_tool_parser_streaming_equals_whole(text: str, positions: list[int], name: str) -> None:
    def make():  # type: ignore[no-untyped-def]
        counter = itertools.count()
        return get_tool_parser(name)(TOOLS, id_factory=lambda: f"id{next(counter)}")

    whole = make().parse(text)
    parser = make()
    deltas = [d for chunk in _chunks(text, positions) for d in parser.feed(chunk)] + parser.finish()
    assert assemble(deltas, errors=tuple(parser.errors)) == whole
    # nothing is lost: content plus the calls' blocks account for all non-whitespace text
    if not whole.tool_calls:
        assert (whole.content or "") == text


@SETTINGS
@given(text=texts, positions=cuts, name=st.sampled_from(["qwen3", "deepseek_r1", "mistral"]),
       prompt=st.sampled_from([None, "<think>\n", "<think></think>"]), enabled=st.booleans())
def test_reasoning_streaming_equals_whole(text: str, positions: list[int], name: str, prompt: str | None, enabled: bool) -> None:
    whole = get_reasoning_parser(name, thinking_enabled=enabled, prompt_text=prompt).parse(text)
    parser = get_reasoning_parser(name, thinking_enabled=enabled, prompt_text=prompt)
    parts = [parser.feed(chunk) for chunk in _chunks(text, positions)] + [parser.finish()]
    reasoning = "".join(r or "" for r, _ in parts) or None
    content = "".join(c or "" for _, c in parts) or None
    assert (reasoning, content) == whole
    if not enabled:
        assert whole == (None, text or None)
