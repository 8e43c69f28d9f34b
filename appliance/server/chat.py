"""POST /v1/chat/completions.

Parser hook: `ServerContext.chat_processor_factory(request) -> ChatOutputProcessor` turns the model's text into
message fields (content, reasoning_content, tool_calls). The default passes text through as `content`; the
tool-call / reasoning parsers (appliance/server/parsers/) plug in there, see `build_chat_processor_factory`.
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.server.chat_template import normalize_messages
from appliance.server.context import ServerContext
from appliance.server.errors import ApiError
from appliance.server.generation import ChoiceDelta, Generation, TokenLogprob, new_request_id, with_deadline
from appliance.server.protocol import ChatCompletionRequest, parse_body
from appliance.server.request_body import read_json
from appliance.server.sampling import build_sampling
from appliance.server.sse import DONE, SSEResponse, run_until_disconnect, sse


class ChatOutputProcessor(Protocol):
    def delta(self, text: str) -> dict[str, Any]:
        """Fields of a streamed `delta` for this new text ({} when nothing is ready to show yet)."""

    def final(self, text: str) -> dict[str, Any]:
        """Fields of the non-streamed `message` for the whole text."""

    def finish_reason(self, reason: str | None) -> str | None:
        """The finish_reason to report ("tool_calls" when the parser found calls)."""


class PlainText:
    def delta(self, text: str) -> dict[str, Any]:
        return {"content": text} if text else {}

    def final(self, text: str) -> dict[str, Any]:
        return {"content": text}

    def finish_reason(self, reason: str | None) -> str | None:
        return reason


def build_chat_processor_factory(config: Any, tokenizer: Any) -> Any:
    """PlainText unless api.tool_call_parser / api.reasoning_parser is set; then the parsers package must
    provide `make_chat_processor(config, tokenizer, request)` (a configured parser is never silently ignored)."""
    if not (config.api.tool_call_parser or config.api.reasoning_parser):
        return lambda request: PlainText()
    try:
        from appliance.server.parsers import make_chat_processor  # type: ignore[attr-defined]
    except ImportError as exc:
        raise ValueError("api.tool_call_parser / api.reasoning_parser are set but the parsers are not available "
                         f"({exc})") from None
    return lambda request: make_chat_processor(config, tokenizer, request)


def render_prompt(ctx: ServerContext, req: Any) -> list[int]:
    if ctx.chat_template is None:
        raise ApiError(400, "this model has no chat template; set api.chat_template or use /v1/completions",
                       param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if ctx.config.api.disable_thinking:
        kwargs["enable_thinking"] = False
    text = ctx.chat_template.render(
        normalize_messages(req.messages), add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, tools=req.tools, template_kwargs=kwargs)
    # the template writes BOS itself where the model wants it
    return ctx.encode(text, add_special_tokens=False)


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    body = await read_json(request, ctx.config.api.caps.max_body_bytes)
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
    ctx.check_model(req.model)
    ctx.engine.check_capacity(req.n)  # before any template / tokenization work
    ids = render_prompt(ctx, req)
    params = build_sampling(req, ctx.config.sampling, ctx.limits, len(ids))
    rid = new_request_id("chatcmpl")
    gen = Generation(ctx.engine, ctx.tokenizer, rid, ids, params, req.n)
    factory = ctx.chat_processor_factory or (lambda r: PlainText())
    shaper = _ChatShaper(ctx, req, rid, gen, [factory(req) for _ in range(req.n)])
    if req.stream:
        return SSEResponse(shaper.events())
    result = await run_until_disconnect(request.receive, shaper.collect)
    return JSONResponse(result) if result is not None else Response(status_code=499)


def _logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode("utf-8"))} for t, _, p in lp.top]}


class _ChatShaper:
    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, rid: str, gen: Generation,
                 processors: list[ChatOutputProcessor]) -> None:
        self.ctx, self.req, self.rid, self.gen, self.processors = ctx, req, rid, gen, processors
        self.created = int(time.time())

    def _stream(self) -> AsyncIterator[ChoiceDelta]:
        return with_deadline(self.gen.stream(), self.ctx.request_timeout)

    async def collect(self) -> dict[str, Any]:
        texts: dict[int, list[str]] = {}
        lps: dict[int, list[TokenLogprob]] = {}
        finish: dict[int, tuple[str | None, Any]] = {}
        async for d in self._stream():
            texts.setdefault(d.index, []).append(d.text)
            if d.logprobs is not None:
                lps.setdefault(d.index, []).extend(d.logprobs)
            if d.finish_reason is not None:
                finish[d.index] = (d.finish_reason, d.stop_reason)
        choices = []
        for i in range(self.req.n):
            proc = self.processors[i]
            reason, stop_reason = finish.get(i, ("abort", None))
            message = {"role": "assistant", **proc.final("".join(texts.get(i, [])))}
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": [_logprob_entry(lp) for lp in lps.get(i, [])]} if self.req.logprobs else None,
                "finish_reason": proc.finish_reason(reason), "stop_reason": stop_reason,
            })
            self.ctx.metrics.finished(reason)
        usage = self.gen.usage.as_dict(self.ctx.cache_report)
        self.ctx.metrics.tokens(usage["prompt_tokens"], usage["completion_tokens"])
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.ctx.model_name,
                "choices": choices, "usage": usage}

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        obj: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.ctx.model_name, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return sse(obj)

    async def events(self) -> AsyncIterator[str]:
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        try:
            for i in range(self.req.n):  # the role comes first, as OpenAI sends it
                yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}])
            async for d in self._stream():
                proc = self.processors[d.index]
                delta = proc.delta(d.text)
                choice: dict[str, Any] = {"index": d.index, "delta": delta, "logprobs": None, "finish_reason": None}
                if d.logprobs is not None and self.req.logprobs:
                    choice["logprobs"] = {"content": [_logprob_entry(lp) for lp in d.logprobs]}
                if d.finish_reason is not None:
                    choice["finish_reason"] = proc.finish_reason(d.finish_reason)
                    choice["stop_reason"] = d.stop_reason
                    self.ctx.metrics.finished(d.finish_reason)
                elif not delta and choice["logprobs"] is None:
                    continue
                yield self._chunk([choice])
            usage = self.gen.usage.as_dict(self.ctx.cache_report)
            self.ctx.metrics.tokens(usage["prompt_tokens"], usage["completion_tokens"])
            if include_usage:
                yield self._chunk([], usage)
        except ApiError as exc:
            self.ctx.metrics.error(exc.status)
            yield exc.sse_data()
        yield DONE
