"""Reading a request body: JSON content type (415), size cap (413), read deadline (408), JSON (400), valid
Unicode (400 naming the field); never a traceback.

A 413 or 408 answer closes the connection: the rest of the body is never read, so the connection cannot carry
another request. The read deadline (api.body_read_timeout) is enforced by `BodyDeadline`, which wraps the ASGI
`receive` of every HTTP request, so a client that sends headers and then nothing holds a connection that long
at most.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.server.errors import ApiError

CLOSE = {"Connection": "close"}
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyTimeout(Exception):
    """The client did not send its whole body within api.body_read_timeout."""


async def read_json(request: Request, max_bytes: int) -> Any:
    _check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid Content-Length", headers=CLOSE)
        if int(declared) > max_bytes:
            raise ApiError(413, f"request body exceeds {max_bytes} bytes", headers=CLOSE)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"request body exceeds {max_bytes} bytes", headers=CLOSE)
            chunks.append(chunk)
    except BodyTimeout as exc:
        raise ApiError(408, str(exc), code="body_timeout", headers=CLOSE) from None
    raw = b"".join(chunks)
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise ApiError(400, f"request body is not valid JSON: {msg}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    field = invalid_unicode_field(body)
    if field is not None:
        raise ApiError(400, f"{field or 'the body'} holds invalid Unicode (a lone surrogate such as \\ud800)",
                       param=field or None)
    return body


def _check_content_type(value: str | None) -> None:
    """JSON or no Content-Type at all (curl -d aside, clients send application/json). A form or text/plain body
    is refused: a browser sends those cross-site without a CORS preflight."""
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, f"unsupported Content-Type {media or value!r}; send application/json",
                       code="unsupported_media_type")


def invalid_unicode_field(body: Any) -> str | None:
    """The path (`messages[0].content`) of the first key or string holding a lone surrogate, "" for the body
    itself; None when all text is valid Unicode. JSON's `\\ud800` escapes decode to such strings, which no
    tokenizer or UTF-8 encoder accepts."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                child = f"{path}.{k}" if path else str(k)
                if _SURROGATE.search(k):
                    return path or ""
                stack.append((child, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


class BodyDeadline:
    """ASGI middleware: the request body must arrive within `timeout` seconds of the request's start; past it
    the app's next `receive()` raises BodyTimeout (read_json answers 408 and closes the connection)."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout <= 0:
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:  # afterwards receive() only waits for a disconnect: no deadline on that
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(f"the request body did not arrive within {self.timeout:g} s "
                                  "(api.body_read_timeout)") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)
