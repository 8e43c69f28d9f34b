"""Anthropic's Messages API through the real pipeline, driven by the official anthropic client: text, thinking
blocks under the thinking budget, a forced tool_use, a tool_result round trip, streaming
(messages.stream and the raw event types), count_tokens, x-api-key auth and errors in Anthropic's shape."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentic_fixtures import WEATHER
from api_surface_fixtures import API_KEY, surface_server

from appliance.server.parsers.tool_calls.schema_check import validate

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

TOOL = {"name": "get_weather", "description": "the weather", "input_schema": WEATHER}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    with surface_server(tmp_path_factory.mktemp("surface_anthropic")) as got:
        yield got


def client(server: tuple[str, Path], key: str = API_KEY) -> Any:
    return anthropic.Anthropic(base_url=server[0], api_key=key, max_retries=0, timeout=120)


def test_text_answer(server: Any) -> None:
    m = client(server).messages.create(model="tiny", max_tokens=6, messages=ASK, system="Be brief.",
                                       thinking=NO_THINKING, extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6 and m.usage.input_tokens > 0


def test_thinking_block_under_the_budget(server: Any) -> None:
    m = client(server).messages.create(model="tiny", max_tokens=24, messages=ASK,
                                       thinking={"type": "enabled", "budget_tokens": 3})
    assert m.content[0].type == "thinking" and m.content[0].thinking
    assert m.content[1].type == "text"  # the budget ended the thinking: the answer follows


def test_forced_tool_use(server: Any) -> None:
    m = client(server).messages.create(model="tiny", max_tokens=120, messages=ASK, tools=[TOOL],
                                       tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    assert validate(uses[0].input, WEATHER) == []


def test_any_tool_choice_streamed(server: Any) -> None:
    with client(server).messages.stream(model="tiny", max_tokens=120, messages=ASK, tools=[TOOL],
                                        tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    use = next(b for b in final.content if b.type == "tool_use")
    assert json.loads(partial) == use.input and validate(use.input, WEATHER) == []
    assert final.stop_reason == "tool_use"


def test_tool_result_round_trip_and_count_tokens(server: Any) -> None:
    c = client(server)
    first = c.messages.create(model="tiny", max_tokens=120, messages=ASK, tools=[TOOL],
                              tool_choice={"type": "tool", "name": "get_weather"})
    use = next(b for b in first.content if b.type == "tool_use")
    messages = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "18 degrees"}]}]
    m = c.messages.create(model="tiny", max_tokens=4, messages=messages, tools=[TOOL], thinking=NO_THINKING)
    counted = c.messages.count_tokens(model="tiny", messages=messages, tools=[TOOL], thinking=NO_THINKING)
    assert counted.input_tokens == m.usage.input_tokens
    # the same conversation in chat form, rendered by the template: the call and its result are in the prompt
    chat = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 degrees"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                               "parameters": WEATHER}}]
    r = httpx.post(f"{server[0]}/tokenize", json={"messages": chat, "tools": tools,
                                                 "chat_template_kwargs": {"enable_thinking": False}},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert r["count"] == counted.input_tokens
    text = httpx.post(f"{server[0]}/detokenize", json={"tokens": r["tokens"]},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()["prompt"]
    assert "tool: 18 degrees (id " + use.id + ")" in text


def test_stream_event_types_and_text(server: Any) -> None:
    with client(server).messages.stream(model="tiny", max_tokens=8, messages=ASK,
                                        thinking={"type": "enabled", "budget_tokens": 2}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e.type for e in events]
    assert raw[0] == "message_start" and raw[-1] == "message_stop"
    assert "content_block_start" in raw and "content_block_stop" in raw and "message_delta" in raw
    kinds = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert "thinking_delta" in kinds
    assert final.content[0].type == "thinking" and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8


def test_errors_in_anthropic_shape(server: Any) -> None:
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(server, key="wrong").messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert auth.value.body["type"] == "error" and auth.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client(server).messages.create(model="tiny", max_tokens=2, messages=[{"role": "system", "content": "x"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client(server).messages.create(model="other", max_tokens=2, messages=ASK)

