"""POST /v1/chat/completions.

The model's text becomes message fields through a ChatOutputProcessor per choice: PlainText (content only), or
ParsedOutput over appliance.server.parsers (reasoning_content split by api.reasoning_parser, then tool calls by
api.tool_call_parser when the request has tools; tool_choice "required" / named is generated under a grammar and
read back by ForcedToolStream). New output formats plug in as processors. Output constraints and the thinking
budget go to the workers in SamplingParams.extra (server/constraints.py).
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.engine.sampling_params import SamplingParams
from appliance.server.chat_template import normalize_messages
from appliance.server.constraints import (
    check_compatible,
    output_spec,
    thinking_budget_extra,
    with_extra,
)
from appliance.server.context import ServerContext
from appliance.server.errors import ApiError
from appliance.server.exchange import Exchange, run_exchange
from appliance.server.generation import (
    ChoiceDelta,
    Generation,
    TokenLogprob,
    collect_choices,
    new_request_id,
    with_deadline,
)
from appliance.server.protocol import ChatCompletionRequest, parse_body
from appliance.server.sampling import build_sampling, truncate_prompt
from appliance.server.shaping import (
    AnswerShaper,
    StreamTail,
    finite,
    prompt_logprobs_field,
)
from appliance.server.sse import SSEResponse, run_until_disconnect

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

log = logging.getLogger("appliance.server")


class ChatOutputProcessor(Protocol):
    def delta(self, text: str) -> dict[str, Any]:
        """Fields of a streamed `delta` for this new text ({} when nothing is ready to show yet)."""

    def end(self) -> dict[str, Any]:
        """Fields of the last streamed `delta` (text the parser held back), {} when none."""

    def final(self, text: str) -> dict[str, Any]:
        """Fields of the non-streamed `message` for the whole text."""

    def finish_reason(self, reason: str | None) -> str | None:
        """The finish_reason to report ("tool_calls" when the parser found calls)."""


class PlainText:
    def delta(self, text: str) -> dict[str, Any]:
        return {"content": text} if text else {}

    def end(self) -> dict[str, Any]:
        return {}

    def final(self, text: str) -> dict[str, Any]:
        return {"content": text}

    def finish_reason(self, reason: str | None) -> str | None:
        return reason


class ParsedOutput:
    """appliance.server.parsers' MessageParser (reasoning split, then tool calls) as a ChatOutputProcessor."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.called_tools = False

    def _fields(self, md: Any) -> dict[str, Any]:
        if md is None:
            return {}
        self.called_tools |= bool(md.tool_calls)
        return md.to_openai()

    def delta(self, text: str) -> dict[str, Any]:
        return self._fields(self.parser.feed(text)) if text else {}

    def end(self) -> dict[str, Any]:
        return self._fields(self.parser.finish())

    def final(self, text: str) -> dict[str, Any]:
        parsed = self.parser.parse(text)
        for err in parsed.errors:
            log.info("tool call kept as content: %s", err)
        self.called_tools = bool(parsed.tool_calls)
        out: dict[str, Any] = {"content": parsed.content}
        if parsed.reasoning_content is not None:
            out["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called_tools and reason in ("stop", None) else reason


def uses_parsers(config: ApplianceConfig, req: Any) -> bool:
    return bool(config.api.reasoning_parser or req.tools)


def thinking_decision(ctx: ServerContext, req: Any, structured: bool = False, max_tokens: int | None = None) -> Any:
    """Whether this request thinks and for how long (api.disable_thinking, api.thinking_budget,
    chat_template_kwargs.enable_thinking, reasoning_effort, thinking.budget_tokens; a grammar-constrained
    request does not think); used with a reasoning parser."""
    from appliance.server.parsers import resolve_thinking

    enable = (req.chat_template_kwargs or {}).get("enable_thinking")
    thinking = getattr(req, "thinking", None)
    try:
        return resolve_thinking(disable_thinking=ctx.config.api.disable_thinking,
                                enable_thinking=enable if isinstance(enable, bool) else None,
                                reasoning_effort=getattr(req, "reasoning_effort", None),
                                budget_tokens=thinking.budget_tokens if thinking is not None else None,
                                max_thinking_budget=ctx.config.api.thinking_budget,
                                max_tokens=max_tokens if max_tokens is not None
                                else getattr(req, "effective_max_tokens", None),
                                structured_output=structured)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="reasoning_effort") from None


def build_processors(ctx: ServerContext, req: ChatCompletionRequest, prompt_text: str,
                     thinking_enabled: bool) -> list[ChatOutputProcessor]:
    if not uses_parsers(ctx.config, req):
        return [PlainText() for _ in range(req.n)]
    from appliance.server.parsers.message import build_message_parser

    out: list[ChatOutputProcessor] = []
    for _ in range(req.n):
        try:
            parser = build_message_parser(
                reasoning_parser=ctx.config.api.reasoning_parser, tool_call_parser=ctx.config.api.tool_call_parser,
                tools=req.tools, tool_choice=req.tool_choice, thinking_enabled=thinking_enabled,
                prompt_text=prompt_text)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        out.append(ParsedOutput(parser))
    return out


def needs_special_tokens(processors: list[ChatOutputProcessor]) -> bool:
    """Tool formats whose markers are special tokens must see them in the detokenized text."""
    return any(getattr(getattr(getattr(p, "parser", None), "tools", None), "needs_special_tokens", False)
               for p in processors)


def render_prompt(ctx: ServerContext, req: Any, thinking_enabled: bool | None = None) -> tuple[str, list[int]]:
    if ctx.chat_template is None:
        raise ApiError(400, "this model has no chat template; set api.chat_template or use /v1/completions",
                       param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if ctx.config.api.disable_thinking:
        kwargs["enable_thinking"] = False
    elif thinking_enabled is not None:
        kwargs["enable_thinking"] = thinking_enabled
    text = ctx.chat_template.render(
        normalize_messages(req.messages), add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, tools=req.tools, template_kwargs=kwargs)
    # the template writes BOS itself where the model wants it
    return text, ctx.encode(text, add_special_tokens=getattr(req, "add_special_tokens", False))


async def create_chat_completion(ctx: ServerContext, request: Request, body: Any = None) -> Response:
    return await run_exchange(ctx, request, _create, body)


@dataclass(frozen=True)
class PreparedChat:
    """A chat request turned into its engine generation: what /v1/chat/completions, /v1/responses and
    /v1/messages all run (one path: template, constraints, thinking budget, parsers, sampling)."""

    rid: str
    gen: Generation
    processors: list[ChatOutputProcessor]
    prompt_text: str


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest, body: Any, exchange: Exchange,
                       id_prefix: str = "chatcmpl") -> PreparedChat:
    """`body`: the chat-shaped body the output constraints are read from (response_format, guided_*...)."""
    ctx.admit(req.model, req.n, req.n)  # before any template / tokenization work
    spec = output_spec(body, tools=req.tools, tool_choice=req.tool_choice,
                       parallel_tool_calls=req.parallel_tool_calls)
    if req.thinking is not None and req.thinking.budget_tokens is not None and not ctx.config.api.reasoning_parser:
        raise ApiError(400, "thinking.budget_tokens needs a reasoning model: this server has no api.reasoning_parser",
                       param="thinking")
    decision = thinking_decision(ctx, req, spec is not None) if ctx.config.api.reasoning_parser else None
    # a grammar leaves no room for a reasoning block: render the prompt that does not open one
    thinking = decision.enabled if decision is not None else (False if spec is not None else None)
    text, ids = await ctx.off_loop(render_prompt, ctx, req, thinking)
    ids = truncate_prompt(ids, req, ctx.limits)
    processors = build_processors(ctx, req, text, thinking if thinking is not None else True)
    params = build_sampling(req, ctx.config.sampling, ctx.limits, len(ids))
    check_compatible(params, spec)
    budget = None
    if decision is not None and decision.enabled:
        # the budget's safety cap (9/10 of max_tokens) holds for the max_tokens actually granted
        decision = thinking_decision(ctx, req, False, params.max_tokens)
        budget = await ctx.off_loop(thinking_budget_extra, ctx, decision.budget, text)
    params = with_extra(params, structured=spec.to_dict() if spec is not None else None, thinking_budget=budget)
    if needs_special_tokens(processors) and params.skip_special_tokens:
        params = SamplingParams.from_dict({**params.to_dict(), "skip_special_tokens": False})
    rid = new_request_id(id_prefix)
    gen = Generation(ctx.engine, ctx.tokenizer, rid, ids, params, req.n,
                     stream_interval=ctx.config.api.stream_interval)
    exchange.accepted(rid, len(ids), params.to_dict(), text)
    return PreparedChat(rid, gen, processors, text)


async def _create(ctx: ServerContext, request: Request, body: Any, exchange: Exchange) -> Response:
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
    prepared = await prepare_chat(ctx, req, body, exchange)
    shaper = _ChatShaper(ctx, req, prepared, exchange)
    if req.stream:
        return SSEResponse(shaper.events())
    result = await run_until_disconnect(request.receive, shaper.collect)
    return JSONResponse(result) if result is not None else Response(status_code=499)


def echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content when it has the answer's role (continue_final_message)."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    return last.content if last.role == role and isinstance(last.content, str) else ""


def _logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": finite(lp.logprob), "bytes": list(lp.token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": finite(p), "bytes": list(t.encode("utf-8"))}
                             for t, _, p in lp.top]}


class _ChatShaper(AnswerShaper):
    chunk_object = "chat.completion.chunk"

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, prepared: PreparedChat,
                 exchange: Exchange) -> None:
        super().__init__(ctx, prepared.rid, exchange, req.stream_options)
        self.req, self.gen, self.processors = req, prepared.gen, prepared.processors
        self.echo = echo_text(req)

    def usage(self) -> dict[str, Any]:
        return self.gen.usage.as_dict(self.ctx.cache_report)

    def _stream(self) -> AsyncIterator[ChoiceDelta]:
        return self.recording(with_deadline(self.gen.stream(), self.ctx.request_timeout))

    def _extensions(self) -> dict[str, Any]:
        """vLLM's response-level fields: prompt_token_ids (return_token_ids), prompt_logprobs."""
        out: dict[str, Any] = {}
        if self.req.return_token_ids:
            out["prompt_token_ids"] = self.gen.prompt_token_ids
        if self.req.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_field(self.ctx.tokenizer, self.gen.prompt_logprobs,
                                                           self.gen.params.prompt_logprobs or 0)
        return out

    async def collect(self) -> dict[str, Any]:
        got = await collect_choices(self._stream())
        choices = []
        for i in range(self.req.n):
            proc = self.processors[i]
            reason, stop_reason = got.reasons(i)
            message = {"role": "assistant", **proc.final(got.text(i))}
            if self.echo:
                message["content"] = self.echo + (message.get("content") or "")
            lps = got.logprobs.get(i, [])
            choice = {
                "index": i, "message": message,
                "logprobs": {"content": [_logprob_entry(lp) for lp in lps]} if self.req.logprobs else None,
                "finish_reason": proc.finish_reason(reason), "stop_reason": stop_reason,
            }
            if self.req.return_token_ids:
                choice["token_ids"] = self.token_ids.get(i, [])
            choices.append(choice)
        usage = self.usage()
        body = self.envelope("chat.completion", choices=choices, usage=usage, **self._extensions())
        self.exchange.done(usage, choices[0]["finish_reason"], got.text(0), body)
        return body

    async def chunks(self, tail: StreamTail) -> AsyncIterator[str]:
        for i in range(self.req.n):  # the role comes first, as OpenAI sends it (with echo: the echoed text)
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": self.echo},
                                "logprobs": None, "finish_reason": None}])
        async for d in self._stream():
            proc = self.processors[d.index]
            delta = proc.delta(d.text)
            choice: dict[str, Any] = {"index": d.index, "delta": delta, "logprobs": None, "finish_reason": None}
            if d.logprobs is not None and self.req.logprobs:
                choice["logprobs"] = {"content": [_logprob_entry(lp) for lp in d.logprobs]}
            if self.req.return_token_ids:
                choice["token_ids"] = d.token_ids
            if d.finish_reason is not None:
                delta.update(proc.end())
                choice["finish_reason"] = proc.finish_reason(d.finish_reason)
                choice["stop_reason"] = d.stop_reason
                if d.index == 0:
                    tail.finish = choice["finish_reason"]
            elif not delta and choice["logprobs"] is None:
                continue
            if d.index == 0:
                tail.texts.append(d.text)
            yield self._chunk([choice])
