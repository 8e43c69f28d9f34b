"""POST /v1/completions (output constraints as on chat: server/constraints.py).

Logprobs follow OpenAI's legacy shape as vLLM fills it: each position's `top_logprobs` maps the position's own
token plus the top k (so k + 1 entries at most, one with `logprobs: 0`); with `echo` the prompt positions come
first, the first of them null (nothing scores it). `max_tokens: 0` with echo scores the prompt only: the engine
generates one token, which the answer leaves out. vLLM's `prompt_logprobs` and `return_token_ids` add their
fields to each choice."""
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
from appliance.server.sampling import build_sampling, truncate_prompt
from appliance.server.shaping import (
    AnswerShaper,
    StreamTail,
    finite,
    prompt_logprobs_field,
)
from appliance.server.sse import SSEResponse, run_until_disconnect
from appliance.server.text import token_text, tokenizer_free


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


async def create_completion(ctx: ServerContext, request: Request, body: Any = None) -> Response:
    return await run_exchange(ctx, request, _create, body)


async def _create(ctx: ServerContext, request: Request, body: Any, exchange: Exchange) -> Response:
    req: CompletionRequest = parse_body(CompletionRequest, body)
    ctx.admit(req.model, req.n, num_prompts(req.prompt) * req.n)  # before any tokenization work
    spec = await checked_output_spec(ctx, body)
    if tokenizer_free(ctx.tokenizer) and (spec is not None or req.stop):
        raise bad_request("stop strings and output constraints need a tokenizer; this server runs without one "
                          "(model.skip_tokenizer_init): use stop_token_ids", "stop" if req.stop else None)
    prompts = [truncate_prompt(ids, req, ctx.limits) for ids in await ctx.off_loop(prompt_token_lists, ctx, req.prompt)]
    rid = new_request_id("cmpl")
    gens = []
    for k, ids in enumerate(prompts):
        params = build_sampling(req, ctx.config.sampling, ctx.limits, len(ids))
        check_compatible(params, spec)
        params = with_extra(params, structured=spec.to_dict() if spec is not None else None)
        if req.echo and params.logprobs is not None and (params.prompt_logprobs or 0) < params.logprobs:
            params = params.__class__.from_dict({**params.to_dict(), "prompt_logprobs": params.logprobs})
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
        super().__init__(ctx, rid, exchange, req.stream_options)
        self.req, self.gens = req, gens
        self.prompt_only = req.echo and req.max_tokens == 0
        self.return_token_ids = req.return_token_ids or tokenizer_free(ctx.tokenizer)  # ids are the only output
        self.offsets: dict[int, int] = {}  # text_offset per choice

    def _stream(self) -> AsyncIterator[ChoiceDelta]:
        stream = with_deadline(merge([g.stream() for g in self.gens]), self.ctx.request_timeout)
        return self.recording(self._prompt_only(stream) if self.prompt_only else stream)

    @staticmethod
    async def _prompt_only(stream: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
        """max_tokens 0: the one generated token is not part of the answer."""
        async for d in stream:
            if d.finish_reason is not None:
                yield ChoiceDelta(d.index, "", [], None, "length", None)

    def usage(self) -> dict[str, Any]:
        total = Usage()
        for g in self.gens:
            total.prompt_tokens += g.usage.prompt_tokens
            total.completion_tokens += 0 if self.prompt_only else g.usage.completion_tokens
            total.cached_tokens += g.usage.cached_tokens
        return total.as_dict(self.ctx.cache_report)

    def _gen(self, index: int) -> Generation:
        return self.gens[index // self.req.n]

    def _echo(self, index: int) -> str:
        return self.ctx.decode(self._gen(index).prompt_token_ids, skip_special_tokens=False)

    def _echo_logprobs(self, index: int) -> list[TokenLogprob | None]:
        """One entry per prompt token (None for the first: nothing scores it); each entry's top holds the top k
        (the engine's entries are the prompt token's own pair, then the top k)."""
        g = self._gen(index)
        plps = g.prompt_logprobs or []
        k = g.params.logprobs or 0
        out: list[TokenLogprob | None] = []
        for pos, tid in enumerate(g.prompt_token_ids):
            entry = plps[pos] if pos < len(plps) else None
            text = token_text(self.ctx.tokenizer, tid)
            if not entry:
                out.append(TokenLogprob(text, tid, None, []) if pos else None)  # type: ignore[arg-type]
                continue
            top = [(token_text(self.ctx.tokenizer, t), t, p) for t, p in entry[1 : 1 + k]]
            out.append(TokenLogprob(text, tid, entry[0][1], top))
        return out

    def _logprobs_obj(self, index: int, lps: list[TokenLogprob | None], text_start: int) -> dict[str, Any]:
        offset = self.offsets.get(index, text_start)
        obj: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for pos, lp in enumerate(lps):
            if lp is None:  # the prompt's first token: echoed, never scored
                tid = self._gen(index).prompt_token_ids[0]
                text, logprob, top = token_text(self.ctx.tokenizer, tid), None, None
            else:
                text, logprob = lp.token, finite(lp.logprob)
                top = {lp.token: logprob} if logprob is not None else {}
                for t, _, p in lp.top:
                    top.setdefault(t, finite(p))
            obj["tokens"].append(text)
            obj["token_logprobs"].append(logprob)
            obj["top_logprobs"].append(top)
            obj["text_offset"].append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return obj

    def _choice(self, index: int, text: str, lps: list[TokenLogprob | None] | None, finish: str | None,
                stop_reason: Any, first: bool, token_ids: list[int] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "text": text,
                                  "logprobs": self._logprobs_obj(index, lps, 0) if lps is not None else None,
                                  "finish_reason": finish, "stop_reason": stop_reason}
        g = self._gen(index)
        if self.req.prompt_logprobs is not None and first:
            asked = self.req.prompt_logprobs  # the engine may score more (echo's logprobs k): show what was asked
            k = g.params.prompt_logprobs if asked == -1 else asked
            choice["prompt_logprobs"] = prompt_logprobs_field(self.ctx.tokenizer, g.prompt_logprobs, k or 0)
        if self.return_token_ids:
            if first:
                choice["prompt_token_ids"] = g.prompt_token_ids
            choice["token_ids"] = token_ids if token_ids is not None else self.token_ids.get(index, [])
        return choice

    async def collect(self) -> dict[str, Any]:
        got = await collect_choices(self._stream())
        choices = []
        want_lps = self.req.logprobs is not None
        for index in range(len(self.gens) * self.req.n):
            text = got.text(index)
            choice_lps: list[TokenLogprob | None] | None = list(got.logprobs.get(index, [])) if want_lps else None
            if self.req.echo:
                text = self._echo(index) + text
                if want_lps:
                    choice_lps = self._echo_logprobs(index) + (choice_lps or [])
            reason, stop_reason = got.reasons(index)
            choices.append(self._choice(index, text, choice_lps, reason, stop_reason, True))
        usage = self.usage()
        body = self.envelope("text_completion", choices=choices, usage=usage)
        self.exchange.done(usage, choices[0]["finish_reason"], choices[0]["text"], body)
        return body

    async def chunks(self, tail: StreamTail) -> AsyncIterator[str]:
        started: set[int] = set()
        async for d in self._stream():
            text, lps = d.text, d.logprobs
            first = d.index not in started
            if self.req.echo and first:
                text = self._echo(d.index) + text
                if self.req.logprobs is not None:
                    lps = self._echo_logprobs(d.index) + list(lps or [])
            started.add(d.index)
            if d.index == 0:
                tail.texts.append(text)
                tail.finish = d.finish_reason or tail.finish
            yield self._chunk([self._choice(d.index, text, lps, d.finish_reason, d.stop_reason, first,
                                            d.token_ids)])
