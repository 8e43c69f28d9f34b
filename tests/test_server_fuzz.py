"""Random JSON bodies at the inference routes never produce a 5xx or a traceback (in-memory engine)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_fakes import FakeEngine

from appliance.config import ApplianceConfig
from appliance.server.app import build_app
from appliance.server.context import make_context
from appliance.tokenization import load_tokenizer

KEYS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "stop_token_ids", "temperature",
        "top_p", "top_k", "min_p", "seed", "logprobs", "top_logprobs", "echo", "stream", "stream_options",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "model", "tools",
        "tool_choice", "chat_template_kwargs", "continue_final_message", "add_generation_prompt", "tokens",
        "min_tokens", "best_of", "logit_bias", "response_format"]
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"])
                                        | st.text(max_size=4), inner, max_size=3), max_leaves=10)
bodies = st.dictionaries(st.sampled_from(KEYS), values, max_size=6) | values


@pytest.fixture(scope="module")
def app(tiny_tokenizer_dir: Path) -> Any:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    config = ApplianceConfig.model_validate({"model": {"path": "tiny"}, "api": {
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}})
    return build_app(make_context(config, tok, FakeEngine([5, 6, 7]), max_model_len=64, vocab_size=384))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), body=bodies)
def test_no_5xx(app: Any, path: str, body: Any) -> None:
    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            # json.dumps, not httpx's encoder: NaN / Infinity go out raw, as a hostile client would send them
            return await c.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})

    r = asyncio.run(post())
    assert r.status_code < 500, (body, r.text)
    assert "Traceback" not in r.text
