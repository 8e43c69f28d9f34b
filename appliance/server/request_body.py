"""Reading a request body: size cap (413), JSON (400), never a traceback."""
from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from appliance.server.errors import ApiError


async def read_json(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid Content-Length")
        if int(declared) > max_bytes:
            raise ApiError(413, f"request body exceeds {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body exceeds {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise ApiError(400, f"request body is not valid JSON: {msg}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
