"""Tool-call and reasoning formats of gpt-oss (harmony), GLM-4.5 / 4.7, Kimi-K2, MiniMax-M2, DeepSeek-V3.2 and
Step-3: each model's documented output parsed whole and streamed one character at a time (the finest a tokenizer
can split it), the two agreeing; malformed blocks come back as content with the reason."""
from __future__ import annotations

import itertools
import json

import pytest

from appliance.config import build_config
from appliance.server.parsers import assemble, get_reasoning_parser, get_tool_parser
from appliance.server.parsers.message import build_message_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"type": "object"}}, "required": ["city"]}}}]
WANT = {"city": "Beijing", "days": 3}

# parser name -> (model output, expected content); every output calls get_weather(city=Beijing, days=3)
TOOL_OUTPUTS: dict[str, tuple[str, str | None]] = {
    "glm45": ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "Let me check."),
    "glm47": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value><arg_key>days</arg_key>"
              "<arg_value>3</arg_value></tool_call>", None),
    "kimi_k2": ("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Beijing", "days": 3}<|tool_call_end|>'
                "<|tool_calls_section_end|>", "Checking."),
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Beijing</parameter>\n'
                   '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>', None),
    "deepseek_v32": ("<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                     "<｜DSML｜parameter name=\"city\" string=\"true\">Beijing</｜DSML｜parameter>\n"
                     "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
                     "</｜DSML｜invoke>\n</｜DSML｜function_calls>", None),
    "step3": ("Let me help.\n<｜tool_calls_begin｜>\n<｜tool_call_begin｜>function<｜tool_sep｜>"
              '<steptml:invoke name="get_weather">\n<steptml:parameter name="city">Beijing</steptml:parameter>\n'
              '<steptml:parameter name="days">3</steptml:parameter>\n</steptml:invoke><｜tool_call_end｜>\n'
              "<｜tool_calls_end｜>", "Let me help."),
    "gpt_oss": ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Beijing", "days": 3}<|call|>',
                None),
}


def _parser(name: str):  # type: ignore[no-untyped-def]
    counter = itertools.count()
    return get_tool_parser(name)(TOOLS, id_factory=lambda: f"id{next(counter)}")


def _streamed(name: str, text: str):  # type: ignore[no-untyped-def]
    parser = _parser(name)
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    return assemble(deltas, errors=tuple(parser.errors))


@pytest.mark.parametrize("name", list(TOOL_OUTPUTS))
def test_tool_call_whole_and_streamed(name: str) -> None:
    text, content = TOOL_OUTPUTS[name]
    whole = _parser(name).parse(text)
    assert whole.errors == ()
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", WANT)]
    assert whole.content == content
    assert _streamed(name, text) == whole


def test_kimi_keeps_the_model_call_id() -> None:
    assert _parser("kimi_k2").parse(TOOL_OUTPUTS["kimi_k2"][0]).tool_calls[0].id == "functions.get_weather:0"


@pytest.mark.parametrize("alias,name", [("kimik2", "kimi_k2"), ("minimax-m2", "minimax_m2"), ("openai", "gpt_oss"),
                                        ("gpt-oss", "gpt_oss"), ("deepseekv32", "deepseek_v32")])
def test_other_engines_spellings(alias: str, name: str) -> None:
    """vLLM's, SGLang's and TokenSpeed's names reach the same parser (the config reads `-` as `_`)."""
    configured = build_config(flat={"tool_call_parser": alias}).api.tool_call_parser
    assert get_tool_parser(configured) is get_tool_parser(name)


@pytest.mark.parametrize("name,text", [
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>"),  # a key without its value
    ("glm45", "<tool_call>nope\n<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"),  # unknown tool
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather"><parameter name="days">3</parameter>'
                   "</invoke></minimax:tool_call>"),  # misses the required city
    # the string="false" value is not JSON
    ("deepseek_v32", '<｜DSML｜function_calls><｜DSML｜invoke name="get_weather"><｜DSML｜parameter name="city" '
                     'string="false">Beijing</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>'),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0{}<|tool_call_end|>"
                "<|tool_calls_section_end|>"),  # no argument marker
    ("gpt_oss", "<|channel|>commentary to=browser.search<|message|>{}<|call|>"),  # not a function
])
def test_malformed_block_is_content(name: str, text: str) -> None:
    parsed = _parser(name).parse(text)
    assert parsed.tool_calls == () and parsed.content == text and parsed.errors
    assert _streamed(name, text) == parsed


HARMONY_CALL = ("<|channel|>analysis<|message|>User asks weather in Beijing. Use the tool.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Beijing", "days": 3}<|call|>')
HARMONY_ANSWER = ("<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>Hello! How can I help?<|return|>")


def _reasoning_streamed(name: str, text: str) -> tuple[str | None, str | None]:
    parser = get_reasoning_parser(name)
    parts = [parser.feed(ch) for ch in text] + [parser.finish()]
    return "".join(r or "" for r, _ in parts) or None, "".join(c or "" for _, c in parts) or None


def test_harmony_final_answer() -> None:
    whole = get_reasoning_parser("gpt_oss").parse(HARMONY_ANSWER)
    assert whole == ("Simple greeting.", "Hello! How can I help?")
    assert _reasoning_streamed("gpt_oss", HARMONY_ANSWER) == whole


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_tool_call_through_the_message_parser(stream: bool) -> None:
    """analysis -> reasoning_content; the commentary call (recipient in the channel part, a json constraint)
    -> one tool call; the recipient may also follow the role."""
    role_recipient = HARMONY_CALL.replace("<|start|>assistant<|channel|>commentary to=functions.get_weather",
                                          "<|start|>assistant to=functions.get_weather<|channel|>commentary")
    for text in (HARMONY_CALL, role_recipient):
        mp = build_message_parser(reasoning_parser="gpt_oss", tool_call_parser="openai", tools=TOOLS)
        if stream:
            deltas = [d for ch in text for d in [mp.feed(ch)] if d is not None] + [d for d in [mp.finish()] if d]
            reasoning = "".join(d.reasoning_content or "" for d in deltas)
            calls = [c for d in deltas for c in d.tool_calls]
            assert reasoning == "User asks weather in Beijing. Use the tool."
            assert calls[0].name == "get_weather" and json.loads("".join(c.arguments for c in calls)) == WANT
            assert not "".join(d.content or "" for d in deltas)
        else:
            parsed = mp.parse(text)
            assert parsed.reasoning_content == "User asks weather in Beijing. Use the tool."
            assert parsed.content is None and parsed.finish_reason == "tool_calls"
            assert json.loads(parsed.tool_calls[0].arguments) == WANT


def test_harmony_plain_text_and_preamble() -> None:
    assert get_reasoning_parser("gpt_oss").parse("just text") == (None, "just text")
    preamble = "<|channel|>commentary<|message|>Looking it up.<|end|>"
    assert get_reasoning_parser("gpt_oss").parse(preamble) == (None, "Looking it up.")
    cut = "<|channel|>analysis<|message|>thinking, cut off"  # max_tokens mid-analysis: all reasoning
    assert _reasoning_streamed("gpt_oss", cut) == ("thinking, cut off", None)


@pytest.mark.parametrize("name,text,want", [
    ("glm45", "<think>plan</think>answer", ("plan", "answer")),
    ("minimax_m2", "plan</think>\n\nanswer", ("plan", "answer")),  # the model never writes <think>
    ("minimax", "plan</think>answer", ("plan", "answer")),
    ("deepseek_v32", "<think>plan</think>answer", ("plan", "answer")),
    ("openai_gptoss", HARMONY_ANSWER, ("Simple greeting.", "Hello! How can I help?")),
])
def test_reasoning_formats(name: str, text: str, want: tuple[str, str]) -> None:
    assert get_reasoning_parser(name).parse(text) == want
    assert _reasoning_streamed(name, text) == want
    assert get_reasoning_parser(build_config(flat={"reasoning_parser": name}).api.reasoning_parser).format == \
        get_reasoning_parser(name).format
