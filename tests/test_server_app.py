"""The HTTP layer against an in-memory engine: OpenAI shapes of completions and chat (streamed or not), logprobs,
chat templates, stop strings and stop token ids, reasoning and tool-call parsers, tokenize / detokenize. Errors and
guards: test_server_errors.py; metrics and the request dump: test_server_observability.py."""
from __future__ import annotations

import json
from typing import Any

import pytest
from server_client import client_for, script_for, sse_events
from test_server_fakes import FakeEngine

pytestmark = pytest.mark.anyio


async def test_completion_text_and_usage(tokenizer: Any) -> None:
    script = script_for(tokenizer, "Hello world! Hello there")
    engine = FakeEngine(script, cached_tokens=3)
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "The quick", "max_tokens": len(script)})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["text"] == "Hello world! Hello there"
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_len = len(tokenizer.encode("The quick"))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(script),
                             "total_tokens": prompt_len + len(script), "prompt_tokens_details": {"cached_tokens": 3}}
    assert engine.submitted[0][1] == tokenizer.encode("The quick")


async def test_stop_string_spanning_tokens_is_cut_and_aborts(tokenizer: Any) -> None:
    engine = FakeEngine(script_for(tokenizer, "Hello world! Hello there"))
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "stop": ["ld! He"]})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello wor"
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "ld! He"
    assert engine.aborted == [engine.submitted[0][0]]  # the engine request was stopped, its blocks freed


async def test_streaming_chunks_join_to_text_with_usage(tokenizer: Any) -> None:
    engine = FakeEngine(script_for(tokenizer, "Café, naïve 🙂 done"))
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "stream": True,
                                                  "stream_options": {"include_usage": True}, "stop": "done"})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Café, naïve 🙂 "
    assert all("\ufffd" not in e["choices"][0]["text"] for e in events if e["choices"])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_n_choices_get_distinct_seeds(tokenizer: Any) -> None:
    engine = FakeEngine(script_for(tokenizer, "Hello"))
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3, "seed": 7})
    assert sorted(ch["index"] for ch in r.json()["choices"]) == [0, 1, 2]
    assert sorted(s.seed for _, _, s in engine.submitted) == [7, 8, 9]
    assert len({rid for rid, _, _ in engine.submitted}) == 3


async def test_completion_logprobs_and_echo(tokenizer: Any) -> None:
    engine = FakeEngine(script_for(tokenizer, "Hello world"))
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2, "logprobs": 2, "echo": True})
    choice = r.json()["choices"][0]
    prompt_ids = tokenizer.encode("The")
    assert choice["text"].startswith(tokenizer.decode(prompt_ids))
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt_ids) + 2 == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][-1] == -0.5 and len(lp["top_logprobs"][-1]) == 2
    assert engine.submitted[0][2].prompt_logprobs == 2


async def test_chat_template_kwargs_and_streaming_roles(tokenizer: Any) -> None:
    engine = FakeEngine(script_for(tokenizer, "Hello"))
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "stream": True,
            "chat_template_kwargs": {"greeting": "Hey"}, "logprobs": True, "top_logprobs": 1})
        plain = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 1})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "HelloHelloHello"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[1]["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    rendered = tokenizer.decode(engine.submitted[0][1])
    assert rendered == "<s>user: hi</s><s>assistant:Hey"
    body = plain.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}


async def test_chat_continue_final_message(tokenizer: Any) -> None:
    engine = FakeEngine(script_for(tokenizer, "Hello"))
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The quick"}],
            "max_tokens": 1, "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert tokenizer.decode(engine.submitted[0][1]) == "<s>user: hi</s><s>assistant: The quick"


async def test_stop_token_ids_end_the_choice_with_the_id_as_stop_reason(tokenizer: Any) -> None:
    script = script_for(tokenizer, "Hello world! Hello there")
    engine = FakeEngine(script)
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "stop_token_ids": [script[2]]})
        bad = await c.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [100000]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == script[2]
    assert choice["text"] == tokenizer.decode(script[:3])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


async def test_stream_interval_batches_tokens(tokenizer: Any) -> None:
    script = script_for(tokenizer, "Numbers 0123456789 and symbols")
    n = len(script)
    assert n > 4 and n % 3
    engine = FakeEngine(script)
    async with client_for(tokenizer, engine, stream_interval=3) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": n, "stream": True, "logprobs": 0})
    chunks = [e["choices"][0] for e in sse_events(r.text)]
    assert [len(ch["logprobs"]["tokens"]) for ch in chunks] == [3] * (n // 3) + [n % 3]
    assert "".join(ch["text"] for ch in chunks) == "Numbers 0123456789 and symbols"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_OUTPUT = '<think>Need weather.</think>Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def test_reasoning_and_tool_call_parsers(tokenizer: Any) -> None:
    script = script_for(tokenizer, TOOL_OUTPUT)
    engine = FakeEngine(script + [1], eos=1)
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "max_tokens": 200}
    async with client_for(tokenizer, engine, 512, reasoning_parser="qwen3", tool_call_parser="hermes") as c:
        r = await c.post("/v1/chat/completions", json=body)
        s = await c.post("/v1/chat/completions", json={**body, "stream": True})
        forced = await c.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls", msg
    assert msg["message"]["reasoning_content"] == "Need weather."
    assert msg["message"]["content"] == "Let me check."
    call = msg["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    events = sse_events(s.text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Need weather."
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    streamed_calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed_calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"]["arguments"] for tc in streamed_calls)) == {"city": "Paris"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a forced call is generated under a grammar the workers enforce (this fake engine does not): the schema of
    # the forced call travels in the request's extra, and output that is not a valid call stays content
    assert forced.status_code == 200, forced.text
    structured = engine.submitted[-1][2].extra["structured"]
    assert structured["kind"] == "json_schema" and json.loads(structured["value"])["type"] == "array"
    forced_msg = forced.json()["choices"][0]
    assert forced_msg["message"]["content"] == TOOL_OUTPUT and forced_msg["message"].get("tool_calls") is None
    assert forced_msg["finish_reason"] == "stop"


async def test_tokenize_detokenize_shapes(tokenizer: Any) -> None:
    async with client_for(tokenizer, FakeEngine([5])) as c:
        t = await c.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
        chat = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        d = await c.post("/detokenize", json={"tokens": t.json()["tokens"]})
        bad = await c.post("/detokenize", json={"tokens": [-1]})
    body = t.json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 64 and len(body["token_strs"]) == body["count"]
    assert tokenizer.decode(chat.json()["tokens"]) == "<s>user: hi</s><s>assistant:"
    assert d.json() == {"prompt": tokenizer.decode(body["tokens"])}
    assert bad.status_code == 400
