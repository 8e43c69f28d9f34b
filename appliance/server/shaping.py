"""What the chat and completions answer shapers share: the answer's envelope (id, object, created, model), the
chunk events the exchange records, usage per chunk (stream_options.continuous_usage_stats), the token ids each
choice got (return_token_ids), JSON-safe logprobs, and the end of a stream (the usage chunk when asked, the
request log's record, `[DONE]`, and an ApiError on the way sent as one error event)."""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from appliance.server.context import ServerContext
from appliance.server.errors import ApiError
from appliance.server.exchange import Exchange
from appliance.server.generation import ChoiceDelta
from appliance.server.sse import DONE, sse
from appliance.server.text import token_text

# JSON has no -inf: a token a grammar or logit_bias masked out is reported with vLLM's floor instead
LOGPROB_FLOOR = -9999.0


def finite(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    return max(LOGPROB_FLOOR, logprob)  # NaN never comes from log_softmax


def prompt_logprobs_field(tokenizer: Any, entries: list[list[tuple[int, float]] | None] | None,
                          k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt token and the top k (rank known for the top k only)."""
    out: list[dict[str, Any] | None] = []
    for entry in entries or []:
        if not entry:
            out.append(None)
            continue
        pos: dict[str, Any] = {}
        for rank, (t, p) in enumerate(entry[1 : 1 + k], start=1):
            pos[str(t)] = {"logprob": finite(p), "rank": rank, "decoded_token": token_text(tokenizer, t)}
        t, p = entry[0]
        pos.setdefault(str(t), {"logprob": finite(p), "rank": None, "decoded_token": token_text(tokenizer, t)})
        out.append(pos)
    return out


@dataclass
class StreamTail:
    """What a stream's route notes for the request log as it goes: choice 0's text and finish reason."""

    texts: list[str] = field(default_factory=list)
    finish: str | None = None


class AnswerShaper:
    chunk_object = ""  # "chat.completion.chunk" or "text_completion"

    def __init__(self, ctx: ServerContext, rid: str, exchange: Exchange, stream_options: Any) -> None:
        self.ctx, self.rid, self.exchange = ctx, rid, exchange
        force = bool(getattr(ctx.config.api, "enable_force_include_usage", False))
        self.include_usage = force or bool(stream_options and stream_options.include_usage)
        self.continuous_usage = bool(self.include_usage and stream_options and stream_options.continuous_usage_stats)
        self.created = int(time.time())
        self.token_ids: dict[int, list[int]] = {}  # per choice index, as the deltas passed (recording)

    async def recording(self, stream: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
        """`stream`, noting each choice's token ids on the way."""
        async with contextlib.aclosing(stream) as it:
            async for d in it:
                self.token_ids.setdefault(d.index, []).extend(d.token_ids)
                yield d

    def envelope(self, obj: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.ctx.model_name, **fields}

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        obj = self.envelope(self.chunk_object, choices=choices)
        if usage is None and self.continuous_usage:
            usage = self.usage()  # the counts so far, on every chunk
        if usage is not None:
            obj["usage"] = usage
        self.exchange.chunk(obj)
        return sse(obj)

    def usage(self) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, tail: StreamTail) -> AsyncIterator[str]:
        """The route's own chunk events; it records choice 0's text and finish reason in `tail`."""
        raise NotImplementedError

    async def events(self) -> AsyncIterator[str]:
        tail = StreamTail()
        try:
            # closed at once when the client leaves mid-stream: its `finally`s abort the engine requests
            async with contextlib.aclosing(self.chunks(tail)) as chunks:
                async for event in chunks:
                    yield event
            usage = self.usage()
            if self.include_usage:
                yield self._chunk([], usage)
            self.exchange.done(usage, tail.finish, "".join(tail.texts))
        except ApiError as exc:
            self.ctx.http_error(exc.status)
            self.exchange.failed(exc.body(), exc.message, stream=True)
            yield exc.sse_data()
        yield DONE
