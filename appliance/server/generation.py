"""One API request's generation: n engine requests (one per choice) merged into one stream of ChoiceDeltas.

Each choice is detokenized incrementally (tokenization.Detokenizer: multi-byte characters held back until whole,
stop strings matched across tokens and cut). A stop string ends the choice here and aborts its engine request,
which frees its KV blocks; so does closing the stream early (client gone, timeout).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from appliance.engine.sampling_params import SamplingParams
from appliance.server.engine_client import EngineClient, EngineDead, QueueFull, RequestOutput
from appliance.server.errors import ApiError
from appliance.server.sampling import child_sampling
from appliance.server.text import TextStream, token_text


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: list[tuple[str, int, float]]  # (token text, id, logprob), best first


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self, cache_report: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                             "total_tokens": self.prompt_tokens + self.completion_tokens}
        if cache_report:
            d["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return d


@dataclass
class Generation:
    engine: EngineClient
    tokenizer: Any
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int
    index_offset: int = 0  # choices of prompt k of a batched completion start at k * n
    usage: Usage = field(default_factory=Usage)
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    stream_interval: int = 1

    def stream(self) -> AsyncIterator[ChoiceDelta]:
        self.usage.prompt_tokens = len(self.prompt_token_ids)
        return merge([self._choice(i) for i in range(self.n)])

    async def _choice(self, i: int) -> AsyncIterator[ChoiceDelta]:
        params = child_sampling(self.params, i)
        text = TextStream(self.tokenizer, self.prompt_token_ids, params)
        rid = self.request_id if self.n == 1 else f"{self.request_id}-{i}"
        index = self.index_offset + i
        try:
            async with contextlib.aclosing(self.engine.generate(rid, self.prompt_token_ids, params)) as outputs, \
                    contextlib.aclosing(self._deltas(outputs, index, i, text)) as deltas:
                async for delta in deltas:
                    yield delta
                    if delta.finish_reason is not None:
                        note = getattr(self.engine, "note_stop_string", None)  # metrics: "stop", not "abort"
                        if note is not None and delta.stop_reason is not None and isinstance(delta.stop_reason, str):
                            note(rid)
                        return  # a stop string: leaving the `async with` aborts the engine request
        except EngineDead as exc:
            raise ApiError(503, f"the engine is unavailable: {exc}") from None

    async def _deltas(self, outputs: AsyncIterator[RequestOutput], index: int, i: int,
                      text: TextStream) -> AsyncIterator[ChoiceDelta]:
        first = True
        pending: ChoiceDelta | None = None
        held: list[int] = []
        async for out in outputs:
            if out.error is not None:
                if out.error_status == 429:  # the scheduler's own queue check: the same answer as the server's
                    raise QueueFull(out.error)
                raise ApiError(out.error_status or 500, out.error if 0 < out.error_status < 500 else
                               "the engine failed to run this request")
            if first:
                first = False
                if i == 0:
                    self.usage.cached_tokens = out.num_cached_tokens
                    self.prompt_logprobs = out.prompt_logprobs
            piece, stop_str, kept = text.add(out.new_token_ids)
            if kept < len(out.new_token_ids):  # tokens past a stop string are not part of the answer
                out = _first_tokens(out, kept)
            self.usage.completion_tokens += len(out.new_token_ids)
            delta = self._delta(index, out, piece, stop_str, text)
            if delta is None:  # no text to show yet: its tokens go with the next delta (return_token_ids)
                held += out.new_token_ids
                continue
            if held:
                delta, held = dataclasses.replace(delta, token_ids=held + delta.token_ids), []
            pending = delta if pending is None else _combine(pending, delta)
            # api.stream_interval: hold deltas until that many tokens are ready (or the choice ends)
            if len(pending.token_ids) >= self.stream_interval or pending.finish_reason is not None:
                yield pending
                pending = None
        if pending is not None:
            yield pending

    def _delta(self, index: int, out: RequestOutput, piece: str, stop_str: str | None,
               text: TextStream) -> ChoiceDelta | None:
        finish, stop_reason = out.finish_reason, None
        if stop_str is not None:
            finish, stop_reason = "stop", stop_str
        elif finish is not None:
            piece += text.flush()
            last = out.new_token_ids[-1] if out.new_token_ids else None
            if finish == "stop" and last is not None and last in self.params.stop_token_ids:
                stop_reason = last
        logprobs = self._logprobs(out) if self.params.logprobs is not None else None
        if not piece and finish is None and not logprobs:
            return None
        return ChoiceDelta(index, piece, list(out.new_token_ids), logprobs, finish, stop_reason)

    def _logprobs(self, out: RequestOutput) -> list[TokenLogprob]:
        lps = out.logprobs or [0.0] * len(out.new_token_ids)
        tops = out.top_logprobs or [[] for _ in out.new_token_ids]
        k = self.params.logprobs or 0
        result = []
        for tid, lp, top in zip(out.new_token_ids, lps, tops):
            top_items = [(token_text(self.tokenizer, t), t, p) for t, p in top[:k]]
            result.append(TokenLogprob(token_text(self.tokenizer, tid), tid, lp, top_items))
        return result


def _first_tokens(out: RequestOutput, n: int) -> RequestOutput:
    """`out` cut to its first n tokens (ids, logprobs and top logprobs alike)."""
    return dataclasses.replace(
        out, new_token_ids=out.new_token_ids[:n], logprobs=None if out.logprobs is None else out.logprobs[:n],
        top_logprobs=None if out.top_logprobs is None else out.top_logprobs[:n])


def _combine(a: ChoiceDelta, b: ChoiceDelta) -> ChoiceDelta:
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return ChoiceDelta(a.index, a.text + b.text, a.token_ids + b.token_ids, logprobs, b.finish_reason, b.stop_reason)


def merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """Interleave several streams as items arrive; an error in one ends all (each is closed, so aborted). One
    stream is returned as it is: a layer of async generator costs every chunk of every stream a resumption."""
    return streams[0] if len(streams) == 1 else _interleave(streams)


async def _interleave(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(stream) as it:
                async for item in it:
                    await queue.put((item, None))
            await queue.put((_END, None))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((None, exc))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        done = 0
        while done < len(streams):
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                done += 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_END = object()


async def with_deadline(stream: AsyncIterator[Any], timeout: float | None) -> AsyncIterator[Any]:
    """Yield from `stream` until `timeout` seconds have passed since the start; then close it (aborting the
    engine requests behind it) and raise a 408.

    Each item is awaited in this task, never in a task of its own: a waiter task could still be running `stream`
    when a disconnect cancels us, and closing a running generator fails ("aclose(): asynchronous generator is
    already running"). One timer covers the whole stream (a timeout context per item cost ~4 us of every chunk):
    at the deadline it cancels this task if it is waiting for an item, else the next item is refused."""
    async with contextlib.aclosing(stream) as it:
        if timeout is None:
            async for item in it:
                yield item
            return
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        waiting = expired = cancelled = False

        def expire() -> None:
            nonlocal expired, cancelled
            expired = True
            if waiting:  # the task is parked in the `await` below: end that wait
                cancelled = True
                task.cancel()

        timer = loop.call_at(loop.time() + timeout, expire)
        try:
            while not expired:
                waiting = True
                try:
                    item = await anext(it)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    # ours alone becomes the 408; any other cancellation (a disconnect) goes on
                    if not cancelled or task.uncancel() > 0:
                        raise
                    break
                finally:
                    waiting = False
                yield item
        finally:
            timer.cancel()
        raise ApiError(408, f"request timed out after {timeout:g} s (api.request_timeout)", code="timeout")


def new_request_id(prefix: str) -> str:
    import uuid

    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Collected:
    """A whole non-streamed answer, per choice index: its text pieces, logprobs and (finish, stop) reasons."""

    texts: dict[int, list[str]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    finish: dict[int, tuple[str | None, Any]] = field(default_factory=dict)

    def text(self, index: int) -> str:
        return "".join(self.texts.get(index, []))

    def reasons(self, index: int) -> tuple[str | None, Any]:
        """(finish_reason, stop_reason); a choice that never finished was aborted."""
        return self.finish.get(index, ("abort", None))


async def collect_choices(stream: AsyncIterator[ChoiceDelta]) -> Collected:
    out = Collected()
    async for d in stream:
        out.texts.setdefault(d.index, []).append(d.text)
        if d.logprobs is not None:
            out.logprobs.setdefault(d.index, []).extend(d.logprobs)
        if d.finish_reason is not None:
            out.finish[d.index] = (d.finish_reason, d.stop_reason)
    return out

