"""One chat / completions HTTP exchange as the request log and the request dump see it
(observability.enable_log_requests, observability.dump_path): request in, response or error out."""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from appliance.observability import StreamAggregator
from appliance.server.errors import ApiError
from appliance.server.request_body import read_json

if TYPE_CHECKING:
    from appliance.server.context import ServerContext


class Exchange:
    def __init__(self, obs: Any, endpoint: str, body: Any) -> None:
        self.obs = obs
        self.endpoint = endpoint
        self.started = time.monotonic()
        self.request_id: str | None = None
        self.num_prompt_tokens = 0
        self.seq = obs.dump.record_request(endpoint, body) if obs is not None and obs.dump is not None else None
        self.agg = StreamAggregator() if self.seq is not None else None
        self.closed = False

    def accepted(self, request_id: str, num_prompt_tokens: int, params: dict[str, Any], prompt: Any) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        if self.obs is not None:
            self.obs.request_log.received(request_id, self.endpoint, num_prompt_tokens, params, prompt)

    def chunk(self, obj: dict[str, Any]) -> None:
        if self.agg is not None:
            self.agg.add(obj)

    def done(self, usage: dict[str, Any], finish_reason: str | None, output: str,
             body: dict[str, Any] | None = None) -> None:
        """`body` for a non-streamed response; None when the chunks went through `chunk`."""
        if self.closed or self.obs is None:
            return
        self.closed = True
        if self.seq is not None:
            stream = body is None
            self.obs.dump.record_response(self.seq, self.endpoint, self.agg.result() if stream else body, stream)
        if self.request_id is not None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.obs.request_log.finished(self.request_id, finish_reason, usage.get("prompt_tokens", 0),
                                          usage.get("completion_tokens", 0), cached,
                                          e2e_s=time.monotonic() - self.started, output=output)

    def failed(self, error_body: dict[str, Any], message: str, stream: bool = False) -> None:
        if self.closed or self.obs is None:
            return
        self.closed = True
        if self.seq is not None:
            self.obs.dump.record_response(self.seq, self.endpoint, error_body, stream)
        if self.request_id is not None:
            self.obs.request_log.finished(self.request_id, "error", self.num_prompt_tokens, 0,
                                          e2e_s=time.monotonic() - self.started, error=message)


async def run_exchange(ctx: ServerContext, request: Request,
                       create: Callable[[ServerContext, Request, Any, Exchange], Awaitable[Response]],
                       body: Any = None) -> Response:
    """Every generation route alike: read the body (unless a dispatching route read it: /invocations), open its
    Exchange, let `create` answer; an ApiError on the way is recorded as the exchange's failure, then answered
    by the app's error handler."""
    if body is None:
        body = await read_json(request, ctx.config.api.caps.max_body_bytes)
    exchange = Exchange(ctx.obs, request.url.path, body)
    try:
        return await create(ctx, request, body, exchange)
    except ApiError as exc:
        exchange.failed(exc.body(), exc.message)
        raise
