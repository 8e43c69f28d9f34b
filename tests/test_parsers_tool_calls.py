"""Tool-call parsers: real model-format strings, whole and streamed split at every position."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from appliance.server.parsers import Delta, ParsedTools, assemble, get_tool_parser, tool_parser_names
from appliance.server.parsers.tool_calls import ToolParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "number"},
                               "append": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["path", "content"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: any object
]

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CODE = 'def f(x):\n    return "<b>" + x  # a < b\n'

# (parser, model output, expected content, expected [(name, arguments)])
CASES: list[tuple[str, str, str | None, list[tuple[str, dict]]]] = [
    (
        "hermes",
        'I will check both cities.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern", "days": 3}}\n</tool_call>',
        "I will check both cities.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Bern", "days": 3})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "content": ' + json.dumps(CODE) + "}}\n</tool_call>",
        None,
        [("write_file", {"path": "a.py", "content": CODE})],
    ),
    ("hermes", "The answer is 4. No tools needed.\n", "The answer is 4. No tools needed.\n", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "unit": "fahrenheit"}}',
        None,
        [("get_weather", {"city": "San Francisco, CA", "unit": "fahrenheit"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    ("llama3_json", 'A JSON example: {"name": "x"} is fine.', 'A JSON example: {"name": "x"} is fine.', []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}, "id": "abcDEF123"}, '
        '{"name": "get_weather", "arguments": {"city": "Bern"}, "id": "xyzXYZ789"}]',
        None,
        [("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "Bern"})],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[CALL_ID]xyzXYZ789[ARGS]{}',
        "Sure.",
        [("get_weather", {"city": "Zürich"}), ("get_time", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "celsius"}[TOOL_CALLS]write_file[ARGS]'
        '{"path": "q.txt", "content": "café \\"best\\"", "tags": ["a", "b"]}',
        None,
        [("get_weather", {"city": "Zürich", "unit": "celsius"}),
         ("write_file", {"path": "q.txt", "content": 'café "best"', "tags": ["a", "b"]})],
    ),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"} Done.', "Done.", [("get_weather", {"city": "Paris"})]),
    (
        "deepseek_v3",
        "Let me look that up." + DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP + "get_weather\n```json\n"
        '{"city": "Tokyo"}\n```' + DS_CALL_END + "\n" + DS_CALL_BEGIN + "function" + DS_SEP + "get_time\n```json\n{}\n```"
        + DS_CALL_END + DS_CALLS_END,
        "Let me look that up.",
        [("get_weather", {"city": "Tokyo"}), ("get_time", {})],
    ),
    (
        "deepseek_v31",
        DS_CALLS_BEGIN + DS_CALL_BEGIN + "get_weather" + DS_SEP + '{"city": "Osaka", "days": 2}' + DS_CALL_END + DS_CALLS_END,
        None,
        [("get_weather", {"city": "Osaka", "days": 2})],
    ),
    (
        "pythonic",
        "[get_weather(city='San Francisco', unit='celsius'), get_time(), write_file(path=\"x\", content=\"y\", "
        "mode=-1.5, append=true, tags=['a', \"b\"])]",
        None,
        [("get_weather", {"city": "San Francisco", "unit": "celsius"}), ("get_time", {}),
         ("write_file", {"path": "x", "content": "y", "mode": -1.5, "append": True, "tags": ["a", "b"]})],
    ),
    (
        "pythonic",
        'Here you go: <|python_start|>[get_weather(city="Oslo", days=5)]<|python_end|>',
        "Here you go:",
        [("get_weather", {"city": "Oslo", "days": 5})],
    ),
    ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    (
        "qwen3_coder",
        "I'll write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=content>\n"
        + CODE + "\n</parameter>\n<parameter=mode>\n420\n</parameter>\n<parameter=append>\nFalse\n</parameter>\n"
        "<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "I'll write it.",
        [("write_file", {"path": "src/a.py", "content": CODE, "mode": 420, "append": False, "tags": ["x", "y"]}),
         ("get_weather", {"city": "Paris", "days": 3})],
    ),
]


def _ids() -> itertools.count:
    return itertools.count()


def _parser(name: str) -> ToolParser:
    counter = _ids()
    return get_tool_parser(name)(TOOLS, id_factory=lambda: f"id{next(counter)}")


def _stream(name: str, chunks: list[str]) -> tuple[list[Delta], ParsedTools]:
    parser = _parser(name)
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    return deltas, assemble(deltas, errors=tuple(parser.errors))


def _calls(parsed: ParsedTools) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_text(name: str, text: str, content: str | None, calls: list[tuple[str, dict]]) -> None:
    parsed = _parser(name).parse(text)
    assert parsed.content == content
    assert _calls(parsed) == calls
    assert all(c.type == "function" and c.id for c in parsed.tool_calls)
    assert parsed.errors == () or not calls


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_streaming_split_anywhere_matches_whole(name: str, text: str, content: str | None, calls: list) -> None:
    whole = _parser(name).parse(text)
    for cut in range(1, len(text)):  # every single split position, mid-marker included
        _, streamed = _stream(name, [text[:cut], text[cut:]])
        assert streamed == whole, f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    deltas, per_char = _stream(name, list(text))
    assert per_char == whole
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _stream(name, pieces)[1] == whole
    # Shape of the streamed tool-call deltas: OpenAI's first-then-fragments pattern.
    tool_deltas = [d.tool_call for d in deltas if d.tool_call is not None]
    for index in range(len(calls)):
        mine = [t for t in tool_deltas if t.index == index]
        first = mine[0].to_openai()
        assert first["id"] == whole.tool_calls[index].id and first["type"] == "function"
        assert first["function"] == {"name": calls[index][0], "arguments": ""}
        assert all("id" not in t.to_openai() and "name" not in t.to_openai()["function"] for t in mine[1:])


def test_content_streams_before_the_call_completes() -> None:
    parser = _parser("hermes")
    out = parser.feed("Checking the weather now. <tool_")
    assert "".join(d.content or "" for d in out) == "Checking the weather now."
    assert parser.feed('call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}') == []
    out = parser.feed("\n</tool_call>")
    assert [d.tool_call.to_openai() for d in out if d.tool_call] == [
        {"index": 0, "id": "id0", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "Rome"}'}},
    ]
    assert parser.finish() == []


@pytest.mark.parametrize(
    "name,text,reason",
    [
        ("hermes", '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>', "unknown function"),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": 7}}\n</tool_call>', "expected string"),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>', "missing required"),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A", "x": 1}}\n</tool_call>', "unexpected property"),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A", "unit": "kelvin"}}\n</tool_call>', "not one of"),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"</tool_call>', "invalid JSON"),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "A"}} {"name": "get_time"}', "expected ';'"),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "A", "days": "three"}', "expected integer"),
        ("pythonic", "[get_weather(city=__import__('os').getcwd())]", "only literal"),
        ("pythonic", "[get_weather('Paris')]", "keyword arguments"),
        ("deepseek_v3", DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP + "get_weather\n{}" + DS_CALL_END + DS_CALLS_END, "json fence"),
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>", "missing required"),
    ],
)
def test_failed_blocks_come_back_as_content(name: str, text: str, reason: str) -> None:
    parsed = _parser(name).parse(text)
    assert parsed.tool_calls == ()
    assert parsed.content == text  # the raw block, markers and all
    assert len(parsed.errors) == 1 and reason in parsed.errors[0], parsed.errors
    # streaming agrees, also when fed one character at a time
    assert _stream(name, list(text))[1] == parsed


def test_one_bad_block_does_not_spoil_the_next() -> None:
    text = ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    parsed = _parser("hermes").parse(text)
    assert _calls(parsed) == [("get_time", {})]
    assert parsed.content == '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert "unknown function 'nope'" in parsed.errors[0]


def test_unterminated_block_at_end_of_output_is_still_read() -> None:
    parsed = _parser("hermes").parse('<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert _calls(parsed) == [("get_time", {})] and parsed.content is None


def test_mistral_ids_are_nine_alphanumerics_and_model_ids_are_kept() -> None:
    parser = get_tool_parser("mistral")(TOOLS)
    parsed = parser.parse('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_time[CALL_ID]abcDEF123[ARGS]{}')
    first, second = parsed.tool_calls
    assert len(first.id) == 9 and first.id.isalnum()
    assert second.id == "abcDEF123"
    assert get_tool_parser("hermes")(TOOLS).parse("<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>").tool_calls[0].id.startswith("call_")


def test_registry() -> None:
    for name in ("hermes", "llama3_json", "mistral", "deepseek_v3", "pythonic", "qwen3_coder"):
        assert name in tool_parser_names()
        assert issubclass(get_tool_parser(name), ToolParser)
    with pytest.raises(ValueError, match="unknown tool_call_parser 'nope'"):
        get_tool_parser("nope")
    assert get_tool_parser("mistral").needs_special_tokens and not get_tool_parser("hermes").needs_special_tokens


@pytest.mark.parametrize(
    "tools,match",
    [
        ([{"type": "retrieval"}], "type must be 'function'"),
        ([{"type": "function", "function": {"parameters": {}}}], "name must be a non-empty string"),
        ([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}], "duplicate"),
        ([{"type": "function", "function": {"name": "a", "parameters": [1]}}], "JSON schema object"),
    ],
)
def test_bad_tool_definitions_are_rejected(tools: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_tool_parser("hermes")(tools)


def test_feed_after_finish_is_an_error() -> None:
    parser = _parser("hermes")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
