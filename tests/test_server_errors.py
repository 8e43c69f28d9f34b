"""The HTTP layer's errors and guards against an in-memory engine: OpenAI error bodies for bad requests, malformed
JSON and the body cap, a full queue, auth, a failed engine, request timeouts, the start-up gate, allowed hosts, a
bug mid-stream, and the chat template's sandbox and time bound."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_client import client_for, make_config, sse_events
from test_server_fakes import FakeEngine

from appliance.server.app import build_app
from appliance.server.context import make_context

pytestmark = pytest.mark.anyio


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


async def test_host_header_must_be_allowed(tokenizer: Any) -> None:
    async with client_for(tokenizer, FakeEngine([5]), allowed_hosts=["localhost"]) as c:
        bad = await c.get("/health", headers={"Host": "evil.example:8000"})
        good = await c.get("/health", headers={"Host": "localhost:8000"})
    assert bad.status_code == 421 and good.status_code == 200


async def test_a_bug_mid_stream_ends_with_an_error_event() -> None:
    from appliance.server.sse import SSEResponse

    async def events() -> Any:
        yield "data: {}\n\n"
        raise RuntimeError("/secret/path 0xdeadbeef")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await SSEResponse(events())(scope, receive, send)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
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
