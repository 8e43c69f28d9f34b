"""The Responses and Messages routes against an in-memory engine (a fixed token script), served by uvicorn in a
thread and driven by the official clients over HTTP: stop sequences, sampling fields, the response store
switched off; plus unknown request fields logged once and the request conversions."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from pipeline_server import free_port
from server_client import make_config
from test_server_fakes import FakeEngine

from appliance.config import ApplianceConfig
from appliance.server.app import build_app
from appliance.server.context import make_context
from appliance.server.messages import MessagesRequest, to_chat_body
from appliance.server.protocol import CompletionRequest, warn_unknown_fields
from appliance.server.responses import input_messages

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")


@contextmanager
def _served(tokenizer: Any, engine: FakeEngine, config: ApplianceConfig | None = None) -> Iterator[str]:
    ctx = make_context(config or make_config(), tokenizer, engine, max_model_len=256, vocab_size=384)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_stop_sequence_is_reported(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer.encode("Hello world! Hello there", add_special_tokens=False))
    with _served(tokenizer, engine) as base:
        c = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
        m = c.messages.create(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "hi"}],
                              stop_sequences=["ld! He"])
        plain = c.messages.create(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "hi"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "ld! He"
    assert m.content[0].text == "Hello wor"
    assert plain.stop_reason == "max_tokens"
    assert engine.submitted[0][2].stop == ("ld! He",)


def test_sampling_fields_reach_the_engine(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer.encode("Hi", add_special_tokens=False))
    with _served(tokenizer, engine) as base:
        c = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
        c.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                          extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
        o = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
        o.responses.create(model="tiny", input="hi", temperature=0.25, top_p=0.5, max_output_tokens=2)
    first, second = engine.submitted[0][2], engine.submitted[1][2]
    assert (first.temperature, first.top_p, first.top_k, first.max_tokens) == (0.5, 0.9, 7, 3)
    assert (second.temperature, second.top_p, second.max_tokens) == (0.25, 0.5, 2)


def test_response_store_off_is_a_clear_400(tokenizer: Any) -> None:
    config = make_config(responses_store_size=0)
    with _served(tokenizer, FakeEngine([5]), config) as base:
        o = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="responses_store_size"):
            o.responses.create(model="tiny", input="hi", previous_response_id="resp_x")


def test_unknown_fields_are_logged_once_per_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="appliance.server"):
        assert warn_unknown_fields(CompletionRequest, {"prompt": "x", "frobnicate": 1, "guided_json": {}}) == \
            ["frobnicate"]
        assert warn_unknown_fields(CompletionRequest, {"prompt": "x", "frobnicate": 2}) == []
    assert [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()] == [
        "CompletionRequest: request field 'frobnicate' is not supported and is ignored (logged once)"]


def test_responses_items_become_chat_messages() -> None:
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
             {"type": "message", "role": "user", "content": "q"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"}]
    assert input_messages(items) == [
        {"role": "system", "content": "rules"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"}]


def test_anthropic_blocks_become_chat_messages() -> None:
    req = MessagesRequest.model_validate({"max_tokens": 4, "system": [{"type": "text", "text": "sys"}],
                                          "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                          "thinking": {"type": "enabled", "budget_tokens": 9},
                                          "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "r"}]}, {"type": "text", "text": "next"}]}]})
    body = to_chat_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "r"}, {"role": "user", "content": "next"}]
    assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", False)
    assert body["thinking"] == {"budget_tokens": 9} and body["chat_template_kwargs"] == {"enable_thinking": True}


def test_force_include_usage(tokenizer: Any) -> None:
    with _served(tokenizer, FakeEngine([5, 6]), make_config(enable_force_include_usage=True)) as base:
        o = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
        chunks = list(o.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_unbounded_max_logprobs_is_refused_at_start_up() -> None:
    from appliance.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="max_logprobs"):
        build_config(dotlist=["api.caps.max_logprobs=-1"])
