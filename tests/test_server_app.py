"""The HTTP layer against an in-memory engine: OpenAI shapes, errors, auth, templates, stop strings."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server_fakes import FakeEngine

from appliance.config import ApplianceConfig
from appliance.server.app import build_app
from appliance.server.context import make_context
from appliance.tokenization import load_tokenizer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}{% if greeting %}{{ greeting }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path) -> Any:
    return load_tokenizer(str(tiny_tokenizer_dir))


def make_config(**api: Any) -> ApplianceConfig:
    return ApplianceConfig.model_validate({
        "model": {"path": "tiny", "device": "cpu"}, "api": {"chat_template": CHAT_TEMPLATE, **api},
        "observability": {"enable_metrics": True, "enable_cache_report": True},
    })


def client_for(tokenizer: Any, engine: FakeEngine, max_model_len: int = 64, **api: Any) -> httpx.AsyncClient:
    ctx = make_context(make_config(**api), tokenizer, engine, max_model_len=max_model_len, vocab_size=384)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://127.0.0.1")


def script_for(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def sse_events(body: str) -> list[Any]:
    events = [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


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


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "n": 99}, 400, "n"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x " * 80}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 64}, 400, "max_tokens"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": "x", "stop": ["a"] * 40}, 400, "stop"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"a": 5}}, 400, "logit_bias"),
    ({"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({"max_tokens": 3}, 400, "prompt"),
    ([1, 2], 400, None),
])
async def test_bad_requests_get_openai_errors(tokenizer: Any, body: Any, status: int, param: str | None) -> None:
    engine = FakeEngine([5])
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert "Traceback" not in r.text and engine.submitted == []


async def test_malformed_json_and_body_cap(tokenizer: Any) -> None:
    async with client_for(tokenizer, FakeEngine([5]), caps={"max_body_bytes": 2048}) as c:
        bad = await c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        big = await c.post("/v1/completions", json={"prompt": "x" * 5000})
        missing = await c.get("/v1/nothing")
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert big.status_code == 413
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


async def test_queue_full_is_429_before_tokenizing(tokenizer: Any) -> None:
    engine = FakeEngine([5], max_queued=2)
    async with client_for(tokenizer, engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "n": 3})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert engine.submitted == []


async def test_auth_guards_inference_routes_only(tokenizer: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team tokens\nsecret-a\n\nsecret-b  # ci\n")
    async with client_for(tokenizer, FakeEngine([5]), api_key="k0", api_key_file=str(keys)) as c:
        for path, method in [("/v1/models", "GET"), ("/v1/completions", "POST"), ("/tokenize", "POST"),
                             ("/detokenize", "POST"), ("/v1/chat/completions", "POST")]:
            r = await c.request(method, path, json={})
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "AuthenticationError"
            wrong = await c.request(method, path, json={}, headers={"Authorization": "Bearer secret-"})
            assert wrong.status_code == 401, path
        for key in ("k0", "secret-a", "secret-b"):
            r = await c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/version")).status_code == 200


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


async def test_failed_engine_gives_503_and_unhealthy(tokenizer: Any) -> None:
    engine = FakeEngine([5], state="failed", error_message="stage worker0 exited")
    async with client_for(tokenizer, engine) as c:
        h = await c.get("/health")
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert h.status_code == 503
    assert r.status_code == 503 and "worker0" in r.json()["error"]["message"]


async def test_request_timeout_aborts(tokenizer: Any) -> None:
    engine = FakeEngine([5], delay=0.2)
    async with client_for(tokenizer, engine, request_timeout=0.3) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})
        s = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True})
    assert r.status_code == 408
    assert "timed out" in sse_events(s.text)[-1]["error"]["message"]
    assert len(engine.aborted) == 2 and not engine.open


async def test_starting_gate_answers_503_until_opened(tokenizer: Any) -> None:
    from appliance.server.app import StartingGate

    gate = StartingGate()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://127.0.0.1") as c:
        r = await c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "starting", "message": "the server is starting"}
        r = await c.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is starting"
        gate.progress = lambda: {"status": "starting", "message": "worker0: loading weights (3.0 s)"}
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["message"] == "worker0: loading weights (3.0 s)"
        assert r.headers["retry-after"] == "1"
        r = await c.post("/v1/completions", json={})
        assert r.json()["error"]["message"] == "the server is starting: worker0: loading weights (3.0 s)"
        ctx = make_context(make_config(), tokenizer, FakeEngine([5]), max_model_len=64, vocab_size=384)
        gate.open(build_app(ctx))
        assert (await c.get("/health")).status_code == 200


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


async def test_host_header_must_be_allowed(tokenizer: Any) -> None:
    async with client_for(tokenizer, FakeEngine([5]), allowed_hosts=["localhost"]) as c:
        bad = await c.get("/health", headers={"Host": "evil.example:8000"})
        good = await c.get("/health", headers={"Host": "localhost:8000"})
    assert bad.status_code == 421 and good.status_code == 200


async def test_metrics_exposition(tokenizer: Any) -> None:
    async with client_for(tokenizer, FakeEngine([5])) as c:
        await c.post("/v1/completions", json={"prompt": "x", "model": "other"})
        text = (await c.get("/metrics")).text
    assert 'appliance:request_errors_total{model_name="tiny",status="404"} 1.0' in text
    config = ApplianceConfig.model_validate({"model": {"path": "tiny"}})  # enable_metrics off: no route
    ctx = make_context(config, tokenizer, FakeEngine([5]), max_model_len=64, vocab_size=384)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://x") as c:
        assert (await c.get("/metrics")).status_code == 404


async def test_request_dump_and_log(tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from appliance.observability import read_dump

    dump = tmp_path / "dump.jsonl"
    config = ApplianceConfig.model_validate({
        "model": {"path": "tiny"}, "api": {"chat_template": CHAT_TEMPLATE},
        "observability": {"dump_path": str(dump), "enable_log_requests": True}})
    ctx = make_context(config, tokenizer, FakeEngine(script_for(tokenizer, "Hello")), max_model_len=64, vocab_size=384)
    with caplog.at_level("INFO", logger="appliance.requests"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://x") as c:
            await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2, "stream": True})
            await c.post("/v1/completions", json={"prompt": "x", "max_tokens": "2"})
    ctx.obs.close()
    records = list(read_dump(str(dump)))
    assert [r.kind for r in records] == ["request", "response"] * 3
    assert records[1].body["choices"][0]["text"] == "HelloHello"
    assert records[3].stream and records[3].body["choices"][0]["message"]["content"] == "HelloHello"
    assert records[5].body["error"]["param"] == "max_tokens"
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.requests"]
    assert sum(line.startswith("received") for line in lines) == 2
    assert sum(line.startswith("finished") for line in lines) == 2
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


async def test_a_bug_mid_stream_ends_with_an_error_event() -> None:
    from appliance.server.sse import SSEResponse

    async def events() -> Any:
        yield "data: {}\n\n"
        raise RuntimeError("/secret/path 0xdeadbeef")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await SSEResponse(events())(scope, receive, send)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
        r = await c.get("/")
    assert sse_events(r.text)[-1]["error"]["code"] == 500
    assert "secret" not in r.text and "0xdeadbeef" not in r.text


def test_chat_template_sandbox_and_time_bound() -> None:
    from appliance.server.chat_template import RENDER_TIME_LIMIT_S, ChatTemplate
    from appliance.server.errors import ApiError

    msgs = [{"role": "user", "content": "x"}]
    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    with pytest.raises(ApiError) as exc:
        slow.render(msgs)
    assert exc.value.status == 400 and time.monotonic() - t0 < RENDER_TIME_LIMIT_S + 1
    unsafe = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ApiError) as exc:
        unsafe.render(msgs)
    assert exc.value.status == 400
    raising = ChatTemplate("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(ApiError, match="only user and assistant roles"):
        raising.render(msgs)
