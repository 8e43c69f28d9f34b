"""Bearer-token auth and Host-header checks as plain ASGI middleware (no BaseHTTPMiddleware: it would hide
client disconnects from streaming routes).

Guarded: /v1/*, /tokenize, /detokenize. Open: /health, /metrics, /version. Keys are compared with
hmac.compare_digest against every configured key, so timing does not reveal a key's prefix.
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from appliance.server.errors import ApiError

log = logging.getLogger("appliance.server")

GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/invocations")
# Anthropic's clients send the key as `x-api-key` and read errors in their own shape
ANTHROPIC_PREFIX = "/v1/messages"


def load_api_keys(api_key: str | None, api_key_file: str | None) -> tuple[bytes, ...]:
    """api.api_key plus the file's tokens (one per line; blanks and `#` comments skipped)."""
    keys: list[str] = []
    if api_key:
        keys.append(api_key)
    if api_key_file:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                for line in f:
                    token = line.split("#", 1)[0].strip()
                    if token:
                        keys.append(token)
        except OSError as exc:
            raise ValueError(f"api.api_key_file: cannot read {api_key_file!r}: {exc.strerror}") from None
        if not keys:
            raise ValueError(f"api.api_key_file {api_key_file!r} holds no token")
    return tuple(k.encode("utf-8") for k in keys)


def key_matches(presented: bytes, keys: Iterable[bytes]) -> bool:
    ok = False
    for key in keys:  # no early exit: every key is compared whichever matches
        ok |= hmac.compare_digest(presented, key)
    return ok


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[bytes, ...], allowed_hosts: Iterable[str] | None) -> None:
        self.app = app
        self.keys = keys
        self.allowed_hosts = {h.lower() for h in allowed_hosts} if allowed_hosts else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            if scope["path"].startswith(ANTHROPIC_PREFIX):
                from appliance.server.messages import anthropic_error_response

                await anthropic_error_response(error)(scope, receive, send)
                return
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        if self.allowed_hosts is not None:
            host = (_header(scope, b"host") or b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if host not in self.allowed_hosts and name not in self.allowed_hosts:
                return ApiError(421, "Host header not allowed")
        if not self.keys or not scope["path"].startswith(GUARDED_PREFIXES):
            return None
        auth = _header(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        x_api_key = _header(scope, b"x-api-key") if scope["path"].startswith(ANTHROPIC_PREFIX) else None
        if x_api_key is not None and not auth:
            scheme, token = b"bearer", x_api_key
        if scheme.lower() != b"bearer" or not key_matches(token.strip(), self.keys):
            return ApiError(401, "Invalid or missing API key", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")


def effective_allowed_hosts(host: str, allowed_hosts: Iterable[str] | None) -> list[str] | None:
    """api.allowed_hosts, or by default on a loopback bind the loopback names and the bound name: a page on
    another site that rebinds its DNS name to 127.0.0.1 then still sends its own name as Host. None: any Host."""
    if allowed_hosts is not None:
        return list(allowed_hosts)
    if not _is_loopback(host):
        return None
    bound = host.strip("[]")
    return [*LOOPBACK_NAMES, bound, f"[{bound}]" if ":" in bound else bound]


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, keys: tuple[Any, ...]) -> None:
    if host in ("0.0.0.0", "::", ""):
        log.warning("api.host=%r: the API listens on every interface%s", host,
                    "" if keys else " WITHOUT an api_key; anyone who can reach this host can use it")
