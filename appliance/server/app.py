"""The Starlette app: routes, error mapping, auth. Build with `build_app(ctx)`; serve with uvicorn."""
from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.server.auth import AuthMiddleware, load_api_keys, warn_if_exposed
from appliance.server.chat import create_chat_completion, render_prompt
from appliance.server.completions import create_completion
from appliance.server.context import ServerContext
from appliance.server.engine_client import EngineDead, QueueFull
from appliance.server.errors import ApiError, internal_error
from appliance.server.messages import (
    anthropic_error_response,
    count_tokens,
    create_message,
)
from appliance.server.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    parse_body,
    parse_tokenize,
)
from appliance.server.request_body import read_json
from appliance.server.responses import create_response
from appliance.server.text import token_text

log = logging.getLogger("appliance.server")
try:
    VERSION = importlib.metadata.version("appliance")  # the installed distribution's (pyproject.toml)
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    VERSION = "0+unknown"

Handler = Callable[[ServerContext, Request], Awaitable[Response]]


def _guarded(ctx: ServerContext, fn: Handler, shape: Callable[[ApiError], Response] = ApiError.response
             ) -> Callable[[Request], Awaitable[Response]]:
    """Every failure becomes an error response, OpenAI's shape unless `shape` says otherwise (Anthropic's on
    /v1/messages); nothing internal leaks into the body."""

    @functools.wraps(fn)
    async def endpoint(request: Request) -> Response:
        try:
            return await fn(ctx, request)
        except ApiError as exc:
            err = exc
        except QueueFull as exc:
            err = ApiError(429, f"server is at capacity: {exc}", code="queue_full", headers={"Retry-After": "1"})
        except EngineDead as exc:
            err = ApiError(503, f"the engine is unavailable: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bug: log it, answer a generic 500
            err = internal_error(exc)
        ctx.http_error(err.status)
        return shape(err)

    return endpoint


async def list_models(ctx: ServerContext, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "appliance",
        "root": str(ctx.config.model.path or ctx.model_name), "parent": None,
        "max_model_len": ctx.limits.max_model_len,
    }]})


async def health(ctx: ServerContext, request: Request) -> Response:
    state = ctx.engine.state
    if state == "ready":
        return Response(status_code=200)
    return JSONResponse({"status": state, "message": ctx.engine.error_message}, status_code=503)


async def version(ctx: ServerContext, request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def metrics(ctx: ServerContext, request: Request) -> Response:
    try:  # the scheduler answers a stats query with a fresh snapshot first
        await ctx.engine.stats()
    except Exception as exc:  # noqa: BLE001 - a scrape during a failure still answers what it knows
        log.debug("metrics: no fresh scheduler snapshot (%s)", type(exc).__name__)
    body, content_type = ctx.obs.render()
    return Response(body, headers={"content-type": content_type})


async def stats(ctx: ServerContext, request: Request) -> Response:
    """Scheduler numbers as JSON (running, waiting, KV blocks, accounting): for tests and operators."""
    return JSONResponse(await ctx.engine.stats())


async def tokenize(ctx: ServerContext, request: Request) -> Response:
    req = parse_tokenize(await read_json(request, ctx.config.api.caps.max_body_bytes))
    ctx.check_model(req.model)
    if isinstance(req, TokenizeChatRequest):
        _, ids = await ctx.off_loop(render_prompt, ctx, req)
    else:
        ids = await ctx.off_loop(ctx.encode, req.prompt, req.add_special_tokens)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.limits.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [token_text(ctx.tokenizer, t) for t in ids]
    return JSONResponse(body)


async def detokenize(ctx: ServerContext, request: Request) -> Response:
    req: DetokenizeRequest = parse_body(DetokenizeRequest, await read_json(request, ctx.config.api.caps.max_body_bytes))
    ctx.check_model(req.model)
    if any(not 0 <= t < ctx.limits.vocab_size for t in req.tokens):
        raise ApiError(400, f"token ids must be in [0, {ctx.limits.vocab_size})", param="tokens")
    return JSONResponse({"prompt": await ctx.off_loop(ctx.decode_off_loop, req.tokens, False)})


async def load(ctx: ServerContext, request: Request) -> Response:
    """vLLM's server load: the engine requests open now (queued or running)."""
    return JSONResponse({"server_load": int(getattr(ctx.engine, "num_open", 0))})


async def invocations(ctx: ServerContext, request: Request) -> Response:
    """SageMaker's one inference route: the body's shape picks chat (messages), completions (prompt) or
    responses (input)."""
    body = await read_json(request, ctx.config.api.caps.max_body_bytes)
    routes = (("messages", create_chat_completion), ("prompt", create_completion), ("input", create_response))
    for key, handler in routes:
        if isinstance(body, dict) and key in body:
            return await handler(ctx, request, body)
    raise ApiError(400, "/invocations needs a chat (messages), completions (prompt) or responses (input) body")


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = {404: "Not Found", 405: "Method Not Allowed"}.get(status, "error")
    return ApiError(status, message).response()


STARTING = "the server is starting"


class StartingGate:
    """The ASGI app while the stages behind the HTTP server load: every route answers 503, so probes see the port
    early; `open(app)` hands over to the real app once the pipeline is ready. `progress()` is the start-up's
    state ({"status": "starting", "message": ..., ...}): /health answers it as its body, the other routes put its
    message in their error."""

    def __init__(self, progress: Callable[[], dict[str, Any]] | None = None) -> None:
        self.app: Any = None
        self.progress = progress or (lambda: {"status": "starting", "message": STARTING})

    def open(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            state = self.progress()
            if scope.get("path") == "/health":
                response: Response = JSONResponse(state, status_code=503, headers={"Retry-After": "1"})
            else:
                message = state.get("message") or STARTING
                text = message if message == STARTING else f"{STARTING}: {message}"
                response = ApiError(503, text, headers={"Retry-After": "1"}).response()
            await response(scope, receive, send)


def build_app(ctx: ServerContext) -> Starlette:
    keys = load_api_keys(ctx.config.api.api_key, ctx.config.api.api_key_file)
    warn_if_exposed(ctx.config.api.host, keys)
    routes = [
        Route("/v1/models", _guarded(ctx, list_models), methods=["GET"]),
        Route("/v1/completions", _guarded(ctx, create_completion), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(ctx, create_chat_completion), methods=["POST"]),
        Route("/v1/responses", _guarded(ctx, create_response), methods=["POST"]),
        Route("/v1/messages", _guarded(ctx, create_message, anthropic_error_response), methods=["POST"]),
        Route("/v1/messages/count_tokens", _guarded(ctx, count_tokens, anthropic_error_response), methods=["POST"]),
        Route("/invocations", _guarded(ctx, invocations), methods=["POST"]),
        Route("/load", _guarded(ctx, load), methods=["GET"]),
        Route("/tokenize", _guarded(ctx, tokenize), methods=["POST"]),
        Route("/detokenize", _guarded(ctx, detokenize), methods=["POST"]),
        Route("/health", _guarded(ctx, health), methods=["GET"]),
        Route("/version", _guarded(ctx, version), methods=["GET"]),
        Route("/v1/internal/stats", _guarded(ctx, stats), methods=["GET"]),
    ]
    if ctx.obs is not None and ctx.obs.metrics is not None:  # observability.enable_metrics
        routes.append(Route("/metrics", _guarded(ctx, metrics), methods=["GET"]))
    middleware = [Middleware(AuthMiddleware, keys=keys, allowed_hosts=ctx.config.api.allowed_hosts)]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: _http_error})
