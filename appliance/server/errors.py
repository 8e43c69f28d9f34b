"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`. Messages never carry tracebacks,
file paths or memory addresses; unexpected exceptions become a generic 500."""
from __future__ import annotations

import json
import logging
import re

from starlette.responses import JSONResponse

log = logging.getLogger("appliance.server")

_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
    405: "MethodNotAllowed", 408: "TimeoutError", 413: "RequestTooLarge", 421: "MisdirectedRequest",
    422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")

    def body(self) -> dict:
        # 5xx messages can carry text from deeper layers (a stage's failure, a socket error): scrub it
        message = scrub(self.message) if self.status >= 500 else self.message
        return {"error": {"message": message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_data(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


_PATH = re.compile(r"(?:[a-z]+://)?(?:/[\w.@+-]+){2,}/?|[A-Za-z]:\\[\w\\ .-]+")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def scrub(message: str) -> str:
    """Drop file paths, socket addresses and memory addresses from a message meant for clients."""
    return _ADDRESS.sub("<address>", _PATH.sub("<path>", message)).split("Traceback", 1)[0].rstrip()


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def context_length_exceeded(message: str, param: str) -> ApiError:
    """OpenAI's code for a prompt plus max_tokens beyond the context; clients (and SDK retries) key on it."""
    return ApiError(400, message, param=param, code="context_length_exceeded")


def internal_error(exc: BaseException) -> ApiError:
    log.exception("internal error: %s", type(exc).__name__, exc_info=exc)
    return ApiError(500, "internal server error")
