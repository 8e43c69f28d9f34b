"""What the chat and completions answer shapers share: the answer's envelope (id, object, created, model), the
chunk events the exchange records, and the end of a stream (the usage chunk when asked, the request log's
record, `[DONE]`, and an ApiError on the way sent as one error event)."""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from appliance.server.context import ServerContext
from appliance.server.errors import ApiError
from appliance.server.exchange import Exchange
from appliance.server.sse import DONE, sse


@dataclass
class StreamTail:
    """What a stream's route notes for the request log as it goes: choice 0's text and finish reason."""

    texts: list[str] = field(default_factory=list)
    finish: str | None = None


class AnswerShaper:
    chunk_object = ""  # "chat.completion.chunk" or "text_completion"

    def __init__(self, ctx: ServerContext, rid: str, exchange: Exchange, include_usage: bool) -> None:
        self.ctx, self.rid, self.exchange, self.include_usage = ctx, rid, exchange, include_usage
        self.created = int(time.time())

    def envelope(self, obj: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.ctx.model_name, **fields}

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        obj = self.envelope(self.chunk_object, choices=choices)
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
