"""The streamed /v1/responses answer: OpenAI's typed event sequence, one SSE event per step.

response.created, response.in_progress, then per output item (server/blocks.py's blocks, in order):
response.output_item.added, for text and reasoning response.content_part.added, the deltas
(response.output_text.delta, response.reasoning_text.delta, response.function_call_arguments.delta), their
.done events, response.content_part.done, response.output_item.done; last response.completed (or
response.incomplete when max_output_tokens cut the answer). Every event carries its sequence_number. A failure
on the way is one `error` event.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from appliance.server.blocks import (
    Block,
    BlockEvent,
    BlockStream,
    StreamEnd,
    stream_blocks,
)
from appliance.server.errors import ApiError
from appliance.server.responses import ResponseRun, output_item, output_text
from appliance.server.sse import SSEResponse, named_event


class _Events:
    def __init__(self, run: ResponseRun) -> None:
        self.run = run
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        self.run.exchange.chunk(obj)
        return named_event(kind, obj)

    def _ids(self, block: Block) -> dict[str, Any]:
        return {"item_id": output_item(block, self.run.rid)["id"], "output_index": block.index}

    def block_events(self, ev: BlockEvent) -> list[str]:
        b = ev.block
        if ev.type == "start":
            item = output_item(b, self.run.rid)
            item["status"] = "in_progress"
            if b.kind == "tool":
                item["arguments"] = ""
                return [self.event("response.output_item.added", output_index=b.index, item=item)]
            item["content"] = []
            return [self.event("response.output_item.added", output_index=b.index, item=item),
                    self.event("response.content_part.added", **self._ids(b), content_index=0,
                               part=self._part(b, ""))]
        if ev.type == "delta":
            if b.kind == "tool":
                return [self.event("response.function_call_arguments.delta", **self._ids(b), delta=ev.delta)]
            kind = "response.output_text.delta" if b.kind == "text" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if b.kind == "text" else {}
            return [self.event(kind, **self._ids(b), content_index=0, delta=ev.delta, **extra)]
        done = output_item(b, self.run.rid)
        if b.kind == "tool":
            return [self.event("response.function_call_arguments.done", **self._ids(b), name=b.name,
                               arguments=b.text),
                    self.event("response.output_item.done", output_index=b.index, item=done)]
        kind = "response.output_text.done" if b.kind == "text" else "response.reasoning_text.done"
        extra = {"logprobs": []} if b.kind == "text" else {}
        return [self.event(kind, **self._ids(b), content_index=0, text=b.text, **extra),
                self.event("response.content_part.done", **self._ids(b), content_index=0,
                           part=self._part(b, b.text)),
                self.event("response.output_item.done", output_index=b.index, item=done)]

    @staticmethod
    def _part(block: Block, text: str) -> dict[str, Any]:
        return output_text(text) if block.kind == "text" else {"type": "reasoning_text", "text": text}


async def _events(run: ResponseRun) -> AsyncIterator[str]:
    ev = _Events(run)
    blocks = BlockStream()
    end = StreamEnd()
    yield ev.event("response.created", response=run.response("in_progress", [], None))
    yield ev.event("response.in_progress", response=run.response("in_progress", [], None))
    try:
        events = stream_blocks(run.prepared.gen, run.prepared.processors[0], run.ctx.request_timeout, blocks, end)
        async with contextlib.aclosing(events) as block_events:
            async for block_event in block_events:
                for e in ev.block_events(block_event):
                    yield e
        body = run.finish(blocks.blocks, end.finish)
        yield ev.event("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                       response=body)
        run.record(end.finish, "".join(end.texts), None)
    except ApiError as exc:
        run.ctx.http_error(exc.status)
        run.exchange.failed(exc.body(), exc.message, stream=True)
        yield ev.event("error", code=str(exc.code or exc.status), message=exc.body()["error"]["message"],
                       param=exc.param)


def stream_response(run: ResponseRun) -> SSEResponse:
    return SSEResponse(_events(run))
