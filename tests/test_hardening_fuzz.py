"""Hypothesis over each route's body schema (there is no OpenAPI document, so the request models' JSON schemas
drive the generator): values near and past every bound, wrong types, unknown keys. No 5xx, no traceback, no path
or memory address in any answer. Runs on the in-memory app here; test_hardening_pipeline.py reuses `bodies` on
the real pipeline."""
from __future__ import annotations

import asyncio
import json
import re
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
from appliance.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from appliance.tokenization import load_tokenizer

ROUTES: dict[str, list[type]] = {
    "/v1/completions": [CompletionRequest],
    "/v1/chat/completions": [ChatCompletionRequest],
    "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
    "/detokenize": [DetokenizeRequest],
}
LEAKS = re.compile(r"Traceback|File \"|\b0x[0-9a-f]{6,}\b|/(usr|home|tmp|work|site-packages)/")

anything = st.recursive(st.none() | st.booleans() | st.integers(-2**65, 2**65) | st.text(max_size=6),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3), max_leaves=6)


def _number(s: dict[str, Any], integer: bool) -> st.SearchStrategy:
    lo = s.get("minimum", s.get("exclusiveMinimum"))
    hi = s.get("maximum", s.get("exclusiveMaximum"))
    edges = [v + d for v in (lo, hi) if v is not None for d in (-1, 0, 1)] + [0, 1, -1, 2**31, 2**63, -2**63]
    if integer:
        edges = [int(e) for e in edges]
        inside = st.integers(int(lo) if lo is not None else -2**40, int(hi) if hi is not None else 2**40)
    else:
        edges += [0.5, 1e308, -1e308, 1e-300, float("inf"), float("nan")]  # sent raw, as NaN / Infinity
        inside = st.floats(lo if lo is not None else -1e6, hi if hi is not None else 1e6, allow_nan=False)
    return st.one_of(inside, inside, st.sampled_from(edges))


def from_schema(s: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    """A value that mostly fits schema `s` (so the request gets deep into the handler), sometimes not."""
    if "$ref" in s:
        return from_schema(defs[s["$ref"].rsplit("/", 1)[1]], defs, depth)
    if "anyOf" in s:
        return st.one_of([from_schema(x, defs, depth) for x in s["anyOf"]])
    t = s.get("type")
    if depth > 3 or t is None:
        return anything
    if t == "null":
        return st.none()
    if t == "boolean":
        return st.booleans()
    if t in ("integer", "number"):
        return _number(s, t == "integer")
    if t == "string":
        return st.text(max_size=12) | st.sampled_from(["", "user", "assistant", "system", "tool", "x" * 3000,
                                                      "{{ 7*7 }}", "\x00\ud7ff", "<s>", "json_object"])
    if t == "array":
        return st.lists(from_schema(s.get("items", {}), defs, depth + 1), max_size=4)
    if t == "object":
        props = s.get("properties", {})
        if not props:
            return st.dictionaries(st.sampled_from(["role", "content", "type", "text", "name"]) | st.text(max_size=4),
                                   anything, max_size=3)
        return object_body(s, defs, depth + 1)
    return anything


def object_body(s: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    props = s.get("properties", {})
    required = {k: from_schema(props[k], defs, depth) for k in s.get("required", []) if k in props}
    optional = {k: from_schema(v, defs, depth) for k, v in props.items() if k not in required}
    # a few optional fields at a time, so a body is often valid as a whole and reaches the engine
    base = st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({**required, **{k: optional[k] for k in keys}})) if optional \
        else st.fixed_dictionaries(required)
    # mostly well-typed; now and then a field of the wrong type or an unknown key
    return st.one_of(base, base, base, st.builds(lambda b, k, v: {**b, k: v}, base,
                                                 st.sampled_from(sorted(props) + ["unknown_key"]), anything))


def bodies(path: str) -> st.SearchStrategy:
    strategies = []
    for model in ROUTES[path]:
        schema = model.model_json_schema()
        strategies.append(object_body(schema, schema.get("$defs", {})))
    return st.one_of(strategies * 4 + [anything])


def check_answer(r: httpx.Response, body: Any) -> None:
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
    assert not LEAKS.search(r.text), r.text[:500]


@pytest.fixture(scope="module")
def app(tiny_tokenizer_dir: Path) -> Any:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    config = ApplianceConfig.model_validate({"model": {"path": "tiny"}, "api": {
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
        "caps": {"max_n": 4, "max_logprobs": 5, "max_stop": 4, "max_body_bytes": 65536}}})
    return build_app(make_context(config, tok, FakeEngine([5, 6, 7]), max_model_len=64, vocab_size=384))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data(), path=st.sampled_from(sorted(ROUTES)))
def test_schema_driven_bodies_never_5xx(app: Any, data: st.DataObject, path: str) -> None:
    body = data.draw(bodies(path))

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return await c.post(path, content=json.dumps(body).encode(),
                                headers={"content-type": "application/json"})

    check_answer(asyncio.run(post()), body)


def test_the_generator_reaches_the_handlers(app: Any) -> None:
    """Guard against a generator that only ever produces 400s: a share of its bodies must be accepted."""
    from hypothesis import find

    ok = find(bodies("/v1/completions"), lambda b: isinstance(b, dict) and isinstance(b.get("prompt"), str)
              and b.get("n", 1) == 1 and not b.get("stream") and _status(app, "/v1/completions", b) == 200,
              settings=settings(max_examples=500, deadline=None, database=None))
    assert isinstance(ok, dict)


def _status(app: Any, path: str, body: Any) -> int:
    async def post() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return (await c.post(path, content=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})).status_code

    return asyncio.run(post())
