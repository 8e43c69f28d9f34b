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

from appliance.server.blocks import BlockEvent, BlockStream, StreamEnd, stream_blocks
from appliance.server.errors import ApiError
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
    end = StreamEnd()
    start = run.message([], None, None)
    yield _event(run, "message_start", message=start)
    try:
        events = stream_blocks(run.prepared.gen, run.prepared.processors[0], run.ctx.request_timeout, BlockStream(),
                               end)
        async with contextlib.aclosing(events) as block_events:
            async for ev in block_events:
                yield _block_event(run, ev)
        reason, sequence = stop_reason(end.finish, end.stop)
        usage = run.usage()
        yield _event(run, "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": usage["output_tokens"]})
        yield _event(run, "message_stop")
        run.record(end.finish, "".join(end.texts), None)
    except ApiError as exc:
        run.ctx.http_error(exc.status)
        run.exchange.failed(exc.body(), exc.message, stream=True)
        body = anthropic_error_body(exc)
        yield named_event("error", body)


def stream_message(run: MessageRun) -> SSEResponse:
    return SSEResponse(_events(run))
