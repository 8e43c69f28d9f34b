"""POST /v1/completions (output constraints as on chat: server/constraints.py)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.server.constraints import check_compatible, checked_output_spec, with_extra
from appliance.server.context import ServerContext
from appliance.server.errors import bad_request
from appliance.server.exchange import Exchange, run_exchange
from appliance.server.generation import (
    ChoiceDelta,
    Generation,
    TokenLogprob,
    Usage,
    collect_choices,
    merge,
    new_request_id,
    with_deadline,
)
from appliance.server.protocol import CompletionRequest, parse_body
from appliance.server.sampling import build_sampling
from appliance.server.shaping import AnswerShaper, StreamTail
from appliance.server.sse import SSEResponse, run_until_disconnect
from appliance.server.text import token_text


def prompt_token_lists(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [ctx.encode(prompt, add_special_tokens=True)]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return [ctx.encode(p, add_special_tokens=True) for p in prompt]
    lists = [prompt] if isinstance(prompt[0], int) else prompt
    vocab = ctx.limits.vocab_size
    for ids in lists:
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return [list(ids) for ids in lists]


def num_prompts(prompt: Any) -> int:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return max(1, len(prompt))


async def create_completion(ctx: ServerContext, request: Request) -> Response:
    return await run_exchange(ctx, request, _create)


async def _create(ctx: ServerContext, request: Request, body: Any, exchange: Exchange) -> Response:
    req: CompletionRequest = parse_body(CompletionRequest, body)
    ctx.admit(req.model, req.n, num_prompts(req.prompt) * req.n)  # before any tokenization work
    spec = await checked_output_spec(ctx, body)
    prompts = await ctx.off_loop(prompt_token_lists, ctx, req.prompt)
    rid = new_request_id("cmpl")
    gens = []
    for k, ids in enumerate(prompts):
        params = build_sampling(req, ctx.config.sampling, ctx.limits, len(ids))
        check_compatible(params, spec)
        params = with_extra(params, structured=spec.to_dict() if spec is not None else None)
        if req.echo and req.logprobs is not None:
            params = params.__class__.from_dict({**params.to_dict(), "prompt_logprobs": req.logprobs})
        gens.append(Generation(ctx.engine, ctx.tokenizer, f"{rid}-p{k}" if len(prompts) > 1 else rid, ids,
                               params, req.n, index_offset=k * req.n,
                               stream_interval=ctx.config.api.stream_interval))
    exchange.accepted(rid, sum(len(p) for p in prompts), gens[0].params.to_dict(), req.prompt)
    shaper = _Shaper(ctx, req, rid, gens, exchange)
    if req.stream:
        return SSEResponse(shaper.events())
    result = await run_until_disconnect(request.receive, shaper.collect)
    return JSONResponse(result) if result is not None else Response(status_code=499)


class _Shaper(AnswerShaper):
    chunk_object = "text_completion"

    def __init__(self, ctx: ServerContext, req: CompletionRequest, rid: str, gens: list[Generation],
                 exchange: Exchange) -> None:
        super().__init__(ctx, rid, exchange, bool(req.stream_options and req.stream_options.include_usage))
        self.req, self.gens = req, gens
        self.offsets: dict[int, int] = {}  # text_offset per choice

    def _stream(self) -> AsyncIterator[ChoiceDelta]:
        return with_deadline(merge([g.stream() for g in self.gens]), self.ctx.request_timeout)

    def usage(self) -> dict[str, Any]:
        total = Usage()
        for g in self.gens:
            total.prompt_tokens += g.usage.prompt_tokens
            total.completion_tokens += g.usage.completion_tokens
            total.cached_tokens += g.usage.cached_tokens
        return total.as_dict(self.ctx.cache_report)

    def _echo(self, index: int) -> str:
        g = self.gens[index // self.req.n]
        return self.ctx.decode(g.prompt_token_ids, skip_special_tokens=False)

    def _echo_logprobs(self, index: int) -> list[TokenLogprob]:
        g = self.gens[index // self.req.n]
        plps = g.prompt_logprobs or []
        out = []
        for pos, tid in enumerate(g.prompt_token_ids):
            entry = plps[pos] if pos < len(plps) else None
            own = next((p for t, p in entry or [] if t == tid), None)
            top = [(token_text(self.ctx.tokenizer, t), t, p) for t, p in (entry or [])[: self.req.logprobs or 0]]
            out.append(TokenLogprob(token_text(self.ctx.tokenizer, tid), tid, own, top))  # type: ignore[arg-type]
        return out

    def _logprobs_obj(self, index: int, lps: list[TokenLogprob], text_start: int) -> dict[str, Any]:
        offset = self.offsets.get(index, text_start)
        obj: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            obj["tokens"].append(lp.token)
            obj["token_logprobs"].append(lp.logprob)
            obj["top_logprobs"].append({t: p for t, _, p in lp.top} if lp.top or self.req.logprobs else None)
            obj["text_offset"].append(offset)
            offset += len(lp.token)
        self.offsets[index] = offset
        return obj

    def _choice(self, index: int, text: str, lps: list[TokenLogprob] | None, finish: str | None,
                stop_reason: Any) -> dict[str, Any]:
        return {"index": index, "text": text,
                "logprobs": self._logprobs_obj(index, lps, 0) if lps is not None else None,
                "finish_reason": finish, "stop_reason": stop_reason}

    async def collect(self) -> dict[str, Any]:
        got = await collect_choices(self._stream())
        choices = []
        want_lps = self.req.logprobs is not None
        for index in range(len(self.gens) * self.req.n):
            text = got.text(index)
            choice_lps = got.logprobs.get(index, []) if want_lps else None
            if self.req.echo:
                text = self._echo(index) + text
                if want_lps:
                    choice_lps = self._echo_logprobs(index) + (choice_lps or [])
            reason, stop_reason = got.reasons(index)
            choices.append(self._choice(index, text, choice_lps, reason, stop_reason))
        usage = self.usage()
        body = self.envelope("text_completion", choices=choices, usage=usage)
        self.exchange.done(usage, choices[0]["finish_reason"], choices[0]["text"], body)
        return body

    async def chunks(self, tail: StreamTail) -> AsyncIterator[str]:
        started: set[int] = set()
        async for d in self._stream():
            text, lps = d.text, d.logprobs
            if self.req.echo and d.index not in started:
                text = self._echo(d.index) + text
                if lps is not None:
                    lps = self._echo_logprobs(d.index) + lps
            started.add(d.index)
            if d.index == 0:
                tail.texts.append(text)
                tail.finish = d.finish_reason or tail.finish
            yield self._chunk([self._choice(d.index, text, lps, d.finish_reason, d.stop_reason)])
