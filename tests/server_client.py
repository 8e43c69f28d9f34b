"""The HTTP-layer tests' server on an in-memory engine (a plain module the tests import, not a conftest): the
config with a small chat template, an ASGI client on the built app, a text's token script, an SSE body's events
(the `tokenizer` and `anyio_backend` fixtures they take are conftest.py's)."""
from __future__ import annotations

import json
from typing import Any

import httpx
from test_server_fakes import FakeEngine

from appliance.config import ApplianceConfig
from appliance.server.app import build_app
from appliance.server.context import make_context

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}{% if greeting %}{{ greeting }}{% endif %}")


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
