"""The agentic API end to end through the real pipeline on the CPU, driven by the official openai client.

The tiny model's weights are random: every valid tool call, JSON document, regex or choice below is valid
only because the workers' grammar forces it (executor/logits_processors.py). One server for the module, with
a reasoning parser (deepseek_r1) and a server-wide thinking budget.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from agentic_fixtures import SERVER_BUDGET, WEATHER, agentic_server

from appliance.server.parsers.tool_calls.schema_check import validate

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": s}}
         for n, s in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with agentic_server(tmp_path_factory.mktemp("agentic")) as (url, _):
        yield url


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    args = json.loads(arguments)
    assert validate(args, SCHEMAS[name]) == [], (name, args)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls(base: str, choice: Any) -> None:
    resp = client(base).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
        max_tokens=160, seed=7, n=2)
    for c in resp.choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None
        calls = c.message.tool_calls
        assert calls and len(calls) == 1  # parallel_tool_calls=False
        if isinstance(choice, dict):
            assert calls[0].function.name == "add"
        check_call(calls[0].function.name, calls[0].function.arguments)
        assert calls[0].id and calls[0].type == "function"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_streamed(base: str, choice: Any) -> None:
    stream = client(base).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=3, stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    assert not entry["id"], "a call's id comes once"
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert calls and sorted(calls) == list(range(len(calls)))
    for entry in calls.values():
        assert entry["id"]
        check_call(entry["name"], entry["arguments"])
    if isinstance(choice, dict):
        assert [e["name"] for e in calls.values()] == ["get_weather"]


def test_response_format_json_schema(base: str) -> None:
    resp = client(base).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=120, seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    c = resp.choices[0]
    assert c.finish_reason == "stop"
    assert validate(json.loads(c.message.content), WEATHER) == []
    # a grammar-constrained request does not think: no reasoning block although the server has a parser
    assert getattr(c.message, "reasoning_content", None) is None


def test_regex_choice_and_grammar_extensions(base: str) -> None:
    cl = client(base)
    out = cl.completions.create(model="tiny", prompt="code:", max_tokens=30, seed=5,
                                extra_body={"structured_outputs": {"regex": "[a-z]{2,5}-[0-9]{1,3}"}})
    assert re.fullmatch("[a-z]{2,5}-[0-9]{1,3}", out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    chat = cl.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, seed=5, n=3,
                                      extra_body={"guided_choice": ["sunny", "rainy"]})
    assert {c.message.content for c in chat.choices} <= {"sunny", "rainy"}
    ebnf = cl.completions.create(model="tiny", prompt="x", max_tokens=10, seed=1,
                                 extra_body={"ebnf": 'root ::= "<" [0-9] [0-9] ">"'})
    assert re.fullmatch(r"<[0-9]{2}>", ebnf.choices[0].text), ebnf.choices[0].text


def _think_end(base: str, extra: dict[str, Any]) -> tuple[int, Any]:
    """Index of the first `</think>` among the generated tokens (ignore_eos: the output always runs on)."""
    resp = client(base).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, seed=2, logprobs=True,
        extra_body={"ignore_eos": True, **extra})
    tokens = [t.token for t in resp.choices[0].logprobs.content]
    assert len(tokens) == 24
    assert "</think>" in tokens, tokens
    return tokens.index("</think>"), resp.choices[0].message


@pytest.mark.parametrize("budget", [0, 3, None])
def test_thinking_budget_forces_end_of_thinking(base: str, budget: int | None) -> None:
    extra = {} if budget is None else {"thinking": {"type": "enabled", "budget_tokens": budget}}
    end, message = _think_end(base, extra)
    limit = SERVER_BUDGET if budget is None else budget
    # the forced sequence is "\n</think>\n\n": at most `limit` reasoning tokens, then "\n", then the tag
    assert end <= limit + 1
    assert message.content  # the answer after the block


def test_tool_results_go_through_the_template(base: str) -> None:
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    ids = httpx.post(f"{base}/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=30).json()["tokens"]
    text = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert "system: tools get_weather,add" in text
    assert '[call get_weather {"city": "Paris", "unit": "c"}]' in text  # arguments passed as an object
    assert "tool: 18 degrees (id call_1)" in text
    # and the same conversation generates (under a forced call again)
    resp = client(base).chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=120,
                                                tool_choice={"type": "function", "function": {"name": "add"}})
    check_call("add", resp.choices[0].message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("body,param,needle", [
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs", "regex"),
    ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "at most one"),
])
def test_bad_constraints_are_400(base: str, body: dict[str, Any], param: str, needle: str) -> None:
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
