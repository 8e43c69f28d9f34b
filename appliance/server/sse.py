"""Server-sent events for streaming responses, with client disconnects turned into cancellation.

`stream_until_disconnect` runs the event generator and a listener for `http.disconnect` side by side; when the
client goes away the generator is closed, so its `finally` aborts the request and the scheduler frees its KV
blocks within a step. Starlette's StreamingResponse does this only for some ASGI servers, so it is explicit.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"
log = logging.getLogger("appliance.server")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def named_event(kind: str, obj: Any) -> str:
    """An event with its name line, as the Responses and Anthropic Messages streams send them."""
    return f"event: {kind}\n{sse(obj)}"


class SSEResponse:
    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.headers = headers or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass  # the connection broke under us: same as a disconnect
                except Exception:
                    log.exception("stream failed")
                    err = b'data: {"error": {"message": "internal server error", "type": "InternalServerError", ' \
                          b'"param": null, "code": 500}}\n\n' + DONE.encode()
                    await send({"type": "http.response.body", "body": err, "more_body": False})
                finally:
                    await _aclose(self.events)
                    tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await wait_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _aclose(it: Any) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def run_until_disconnect(receive: Receive, coro_fn: Any) -> Any:
    """Await `coro_fn()` unless the client disconnects first (then it is cancelled and None returned)."""
    result: list[Any] = []
    error: list[BaseException] = []
    async with anyio.create_task_group() as tg:

        async def work() -> None:
            try:
                result.append(await coro_fn())
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
                error.append(exc)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            await wait_for_disconnect(receive)
            tg.cancel_scope.cancel()

        tg.start_soon(work)
        tg.start_soon(watch)
    if error:
        raise error[0]
    return result[0] if result else None
