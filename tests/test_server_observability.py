"""The HTTP layer's observability against an in-memory engine: the /metrics exposition (and no route with metrics
off), the request dump and the request log."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from server_client import CHAT_TEMPLATE, client_for, script_for
from test_server_fakes import FakeEngine

from appliance.config import ApplianceConfig
from appliance.server.app import build_app
from appliance.server.context import make_context

pytestmark = pytest.mark.anyio


async def test_metrics_exposition(tokenizer: Any) -> None:
    async with client_for(tokenizer, FakeEngine([5])) as c:
        await c.post("/v1/completions", json={"prompt": "x", "model": "other"})
        text = (await c.get("/metrics")).text
    assert 'appliance:request_errors_total{model_name="tiny",status="404"} 1.0' in text
    config = ApplianceConfig.model_validate({"model": {"path": "tiny"}})  # enable_metrics off: no route
    ctx = make_context(config, tokenizer, FakeEngine([5]), max_model_len=64, vocab_size=384)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://localhost") as c:
        assert (await c.get("/metrics")).status_code == 404


async def test_request_dump_and_log(tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from appliance.observability import read_dump

    dump = tmp_path / "dump.jsonl"
    config = ApplianceConfig.model_validate({
        "model": {"path": "tiny"}, "api": {"chat_template": CHAT_TEMPLATE},
        "observability": {"dump_path": str(dump), "enable_log_requests": True}})
    ctx = make_context(config, tokenizer, FakeEngine(script_for(tokenizer, "Hello")), max_model_len=64, vocab_size=384)
    with caplog.at_level("INFO", logger="appliance.requests"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://localhost") as c:
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
