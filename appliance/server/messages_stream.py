"""The streamed /v1/messages answer: Anthropic's event types, `event: NAME` + `data: JSON` per step.

message_start (the message with empty content and the input usage), then per content block (server/blocks.py's
blocks, in order) content_block_start, content_block_delta (text_delta, thinking_delta, input_json_delta) and
content_block_stop; message_delta with stop_reason, stop_sequence and the output usage; message_stop. A failure
on the way is one `error` event in Anthropic's error shape.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from appliance.server.blocks import BlockEvent, BlockStream, merged_fields
from appliance.server.errors import ApiError
from appliance.server.generation import with_deadline
from appliance.server.messages import MessageRun, anthropic_error_body, stop_reason
from appliance.server.sse import SSEResponse, named_event


def _event(run: MessageRun, kind: str, **fields: Any) -> str:
    obj = {"type": kind, **fields}
    run.exchange.chunk(obj)
    return named_event(kind, obj)


def _block_event(run: MessageRun, ev: BlockEvent) -> str:
    b = ev.block
    if ev.type == "start":
        start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""} if b.kind == "reasoning" \
            else {"type": "text", "text": ""} if b.kind == "text" \
            else {"type": "tool_use", "id": b.call_id, "name": b.name, "input": {}}
        return _event(run, "content_block_start", index=b.index, content_block=start)
    if ev.type == "delta":
        delta = {"type": "thinking_delta", "thinking": ev.delta} if b.kind == "reasoning" \
            else {"type": "text_delta", "text": ev.delta} if b.kind == "text" \
            else {"type": "input_json_delta", "partial_json": ev.delta}
        return _event(run, "content_block_delta", index=b.index, delta=delta)
    return _event(run, "content_block_stop", index=b.index)


async def _events(run: MessageRun) -> AsyncIterator[str]:
    blocks = BlockStream()
    proc = run.prepared.processors[0]
    texts: list[str] = []
    finish: str | None = None
    stop: Any = None
    start = run.message([], None, None)
    yield _event(run, "message_start", message=start)
    try:
        stream = with_deadline(run.prepared.gen.stream(), run.ctx.request_timeout)
        async with contextlib.aclosing(stream) as deltas:
            async for d in deltas:
                texts.append(d.text)
                fields = proc.delta(d.text)
                if d.finish_reason is not None:
                    fields = merged_fields(fields, proc.end())
                    finish, stop = proc.finish_reason(d.finish_reason), d.stop_reason
                for ev in blocks.feed(fields):
                    yield _block_event(run, ev)
        for ev in blocks.close():
            yield _block_event(run, ev)
        reason, sequence = stop_reason(finish, stop)
        usage = run.usage()
        yield _event(run, "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": usage["output_tokens"]})
        yield _event(run, "message_stop")
        run.record(finish, "".join(texts), None)
    except ApiError as exc:
        run.ctx.http_error(exc.status)
        run.exchange.failed(exc.body(), exc.message, stream=True)
        body = anthropic_error_body(exc)
        yield named_event("error", body)


def stream_message(run: MessageRun) -> SSEResponse:
    return SSEResponse(_events(run))
