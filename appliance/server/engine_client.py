"""What the HTTP layer needs from the engine, whatever process it lives in.

`runtime.frontend.ZmqEngineClient` implements it over the pipeline's sockets; tests use an in-memory fake.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request since the last output; `finish_reason` set on the last one."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # one per new token, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # one list per new token, best first
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None  # with the first output, when asked
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # per-request failure, finish_reason is then "error"
    error_status: int = 0  # the HTTP status that failure maps to (400 invalid, 429 queue full, 500)
    # the scheduler's time.monotonic() (system wide on Linux) when it first put the request in a batch; on the
    # first output only: queue / prefill / inference-time histograms
    first_scheduled_time: float | None = None


class EngineDead(RuntimeError):
    """The pipeline behind the HTTP server failed; requests get a 503 / an error event."""


class QueueFull(RuntimeError):
    """More requests are waiting than scheduler.max_queued_requests allows."""


class Admission:
    """Queue room one HTTP request holds from its capacity check until its engine requests are sent: a burst of
    requests checked before any of them was sent (tokenization awaits in between) cannot all pass the same
    check. `take()` as each engine request is sent, `release()` whatever is left when the HTTP request ends."""

    def __init__(self, owner: Any, count: int) -> None:
        self.owner = owner  # the client holding the room: release_reserved(n)
        self.remaining = count

    def take(self) -> None:
        if self.remaining > 0:
            self.remaining -= 1
            self.owner.release_reserved(1)

    def release(self) -> None:
        if self.remaining > 0:
            self.owner.release_reserved(self.remaining)
            self.remaining = 0


# the current HTTP request's Admission; set by check_capacity, read by generate in the same request's tasks
ADMISSION: ContextVar[Admission | None] = ContextVar("admission", default=None)


class EngineClient(Protocol):
    @property
    def state(self) -> str:
        """"ready", "draining" or "failed"."""

    @property
    def error_message(self) -> str: ...

    def check_capacity(self, num_requests: int) -> None:
        """Raise QueueFull when `num_requests` more would overflow the queue; EngineDead when failed. A client
        with a queue cap holds the room (ADMISSION) until the requests are sent."""

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit and yield outputs until one has finish_reason; closing the iterator early aborts it."""

    async def abort(self, request_ids: list[str]) -> None: ...

    async def stats(self) -> dict[str, Any]:
        """Scheduler numbers: num_running, num_waiting, kv_blocks_total, kv_blocks_free, ..."""
