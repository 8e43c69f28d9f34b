"""The tokenizer process' EngineClient: talks to the scheduler over ZMQ, routes outputs to per-request queues.

Sends (GenerateRequest, AbortRequest, StatsQuery) go through a plain PUSH socket with NOBLOCK from the event loop
thread, so an abort can be sent from a `finally` even while the task is being cancelled. Outputs are read by one
background task. When the supervisor says the pipeline failed, every open request gets an error at once.

Request metrics (observability.FrontendObservability.on_output) are fed as the consumer takes each output, not as
it arrives, so they count what the client receives: with stop strings a multi-token output is handed over one
token at a time, and the tokens after the one that completed a stop string are never taken (nor counted).

A consumer that falls behind (hundreds of streams on one event loop) finds several outputs of its request queued:
without stop strings it takes them as one (merge_outputs), so detokenizing, SSE framing and the HTTP write are
paid once per turn of the consumer instead of once per engine step; the metrics still see each output with its
own arrival time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from appliance.engine.sampling_params import SamplingParams
from appliance.observability.stats import StatsSnapshot
from appliance.runtime.addresses import Addresses
from appliance.runtime.messages import (
    FRONTEND_CODEC,
    OUTPUT_CODEC,
    REQUEST_CODEC,
    AbortRequest,
    GenerateRequest,
    OutputBatch,
    PipelineState,
    StatsQuery,
    StatsReply,
)
from appliance.runtime.pipeline_client import PipelineClient
from appliance.server.engine_client import ADMISSION, Admission, EngineDead, QueueFull, RequestOutput

log = logging.getLogger("appliance.frontend")

_DEAD = object()  # queue sentinel: the pipeline failed


class ZmqEngineClient(PipelineClient):
    def __init__(self, addresses: Addresses, max_queued_requests: int | None, obs: Any = None) -> None:
        self._obs = obs  # observability.FrontendObservability: request-level metrics, scheduler snapshots
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(addresses.requests)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.connect(addresses.outputs)
        self._frontend = self._ctx.socket(zmq.PULL)
        self._frontend.connect(addresses.frontend)
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._max_queued = max_queued_requests
        # the queue estimate (check_capacity): waiting at the scheduler's last report, plus what it had not taken
        # in by then, plus room held by admitted HTTP requests not sent yet; it never falls short of the truth
        self._num_waiting = 0
        self._num_sent = 0
        self._received_at_report = 0
        self._reserved = 0
        self._state = "ready"
        self._error = ""
        self._tasks: list[asyncio.Task] = []
        self._stopped_by_text: set[str] = set()  # ended by a stop string: counted as "stop", not "abort"

    # -- EngineClient --------------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    @property
    def error_message(self) -> str:
        return self._error

    @property
    def num_open(self) -> int:
        return len(self._queues)

    def check_capacity(self, num_requests: int) -> None:
        if self._state == "failed":
            raise EngineDead(self._error or "the engine failed")
        if self._state == "draining":
            raise EngineDead("the server is shutting down")
        if self._max_queued is not None:
            waiting = self._num_waiting + (self._num_sent - self._received_at_report) + self._reserved
            if waiting + num_requests > self._max_queued:
                raise QueueFull(f"{waiting} requests are waiting (scheduler.max_queued_requests="
                                f"{self._max_queued})")
            self._reserved += num_requests  # decided here, at once: the room is held until the requests are sent
            ADMISSION.set(Admission(self, num_requests))

    def release_reserved(self, count: int) -> None:
        self._reserved = max(0, self._reserved - count)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._state == "failed":
            raise EngineDead(self._error)
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        engine_done = False  # the engine ended the request: nothing to abort
        reported = False  # the metrics saw the request finish
        # With stop strings the consumer may cut an output after any of its tokens; handing a multi-token output
        # (a speculative step's) over one token at a time makes the tokens it took exactly those before it closed.
        per_token = bool(sampling.stop)
        try:
            # arrival first: the scheduler may put it in a batch before this thread runs again (GIL switches)
            if self._obs is not None:
                self._obs.request_arrived(request_id, len(prompt_token_ids), sampling.max_tokens)
            admission = ADMISSION.get()
            if admission is not None:
                admission.take()
            try:
                self._send(GenerateRequest(request_id, list(prompt_token_ids), sampling.to_dict(), time.time(),
                                           seq=self._num_sent + 1))
            except EngineDead:
                engine_done = True
                self._finish_metrics(request_id, "error")
                reported = True
                raise
            self._num_sent += 1
            carry: Any = None  # the pipeline's failure, met while taking queued outputs: raised after them
            while True:
                item = carry if carry is not None else await queue.get()
                carry = None
                if item is _DEAD:
                    engine_done = True
                    self._finish_metrics(request_id, "error")
                    reported = True
                    raise EngineDead(self._error or "the engine failed")
                group = [item]
                while not per_token and group[-1][0].finish_reason is None and not queue.empty():
                    nxt = queue.get_nowait()
                    if nxt is _DEAD or nxt[0].error is not None:  # the tokens before a failure go out first
                        carry = nxt
                        break
                    group.append(nxt)
                out = group[0][0] if len(group) == 1 else merge_outputs([o for o, _ in group])
                engine_done = out.finish_reason is not None
                parts = one_per_token(out) if per_token and len(out.new_token_ids) > 1 else (out,)
                taken = 0
                try:
                    for part in parts:
                        taken += len(part.new_token_ids)
                        yield part
                finally:  # also when the consumer closes us mid-output: count only what it took
                    if self._obs is not None:
                        stopped = request_id in self._stopped_by_text
                        for o, routed_at in group:  # each output as it arrived, the tokens taken in order
                            n = min(taken, len(o.new_token_ids))
                            taken -= n
                            reported = self._obs.on_output(o, routed_at, num_taken=n, stopped_by_text=stopped)
                if engine_done:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._stopped_by_text.discard(request_id)
            if not engine_done:  # closed early: client gone, stop string, timeout -> free its blocks now
                self._send_abort([request_id])
            if self._obs is not None and not reported:
                self._obs.request_aborted(request_id)

    def _finish_metrics(self, request_id: str, reason: str) -> None:
        if self._obs is not None and self._obs.metrics is not None:
            self._obs.metrics.on_request_finished(request_id, reason)

    async def abort(self, request_ids: list[str]) -> None:
        self._send_abort(request_ids)

    def note_stop_string(self, request_id: str) -> None:
        """The detokenizer matched a stop string: the request closes early but finished with "stop"."""
        if request_id in self._queues:
            self._stopped_by_text.add(request_id)

    async def stats(self) -> dict[str, Any]:
        if self._state == "failed":
            raise EngineDead(self._error)
        qid = next(self._query_ids)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[qid] = fut
        try:
            self._send(StatsQuery(qid))
            return await asyncio.wait_for(fut, timeout=5.0)
        finally:
            self._stats_waiters.pop(qid, None)

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._read_frontend())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.fail("the server is shutting down")
        self._push.close(0)
        self._pull.close(0)
        self._frontend.close(0)
        self._ctx.term()
        self._sync_ctx.term()

    def fail(self, message: str) -> None:
        """End every open request with an error; new ones are refused."""
        if self._state != "failed":
            self._state = "failed"
            self._error = message
        for q in self._queues.values():
            q.put_nowait(_DEAD)
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(EngineDead(message))

    # -- internals -----------------------------------------------------------------------------------------

    def _send(self, msg: Any) -> None:
        try:
            self._push.send(REQUEST_CODEC.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise EngineDead(f"cannot reach the scheduler: {exc}") from None

    def _send_abort(self, request_ids: list[str]) -> None:
        try:
            self._push.send(REQUEST_CODEC.encode(AbortRequest(list(request_ids))), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the scheduler is gone; nothing is left to free

    async def _read_outputs(self) -> None:
        try:
            await self._route_outputs()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here would leave every request hanging: fail them loudly instead
            log.exception("the output reader crashed")
            self.fail("internal error in the output reader")

    async def _route_outputs(self) -> None:
        while True:
            msg = OUTPUT_CODEC.decode_or_none(await self._pull.recv())
            if isinstance(msg, OutputBatch):
                self._num_waiting = msg.num_waiting
                self._received_at_report = msg.num_received
                now = time.monotonic()  # metrics time the output by its arrival, not by when it is consumed
                for out in msg.outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:  # else: aborted by us, late output
                        q.put_nowait((out, now))
            elif isinstance(msg, StatsSnapshot):
                if self._obs is not None:
                    self._obs.on_snapshot(msg)
            elif isinstance(msg, StatsReply):
                fut = self._stats_waiters.get(msg.query_id)
                if fut is not None and not fut.done():
                    fut.set_result(dict(msg.stats))
            elif msg is None:
                log.warning("dropped a malformed output frame (%d so far)", OUTPUT_CODEC.num_malformed)

    async def _read_frontend(self) -> None:
        while True:
            msg = FRONTEND_CODEC.decode_or_none(await self._frontend.recv())
            if isinstance(msg, PipelineState):
                if msg.state == "failed":
                    log.error("pipeline failed: %s", msg.message)
                    self.fail(msg.message)
                elif msg.state == "draining" and self._state == "ready":
                    self._state = "draining"


def one_per_token(out: RequestOutput) -> list[RequestOutput]:
    """`out` as one output per token, in order: what arrives once per request (prompt logprobs, first-scheduled
    time) goes with the first, how it ended (finish reason, error) with the last."""
    n = len(out.new_token_ids)
    return [dataclasses.replace(
        out, new_token_ids=out.new_token_ids[i : i + 1],
        logprobs=None if out.logprobs is None else out.logprobs[i : i + 1],
        top_logprobs=None if out.top_logprobs is None else out.top_logprobs[i : i + 1],
        prompt_logprobs=out.prompt_logprobs if i == 0 else None,
        first_scheduled_time=out.first_scheduled_time if i == 0 else None,
        finish_reason=out.finish_reason if i == n - 1 else None,
        error=out.error if i == n - 1 else None, error_status=out.error_status if i == n - 1 else 0)
        for i in range(n)]


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (the inverse of one_per_token): tokens and their logprobs in
    order, what arrives once (prompt logprobs, first-scheduled time) from the first, how it ended from the last."""
    first, last = outs[0], outs[-1]
    with_lps = first.logprobs is not None
    with_top = first.top_logprobs is not None
    return dataclasses.replace(
        last, new_token_ids=[t for o in outs for t in o.new_token_ids],
        logprobs=[lp for o in outs for lp in (o.logprobs or ())] if with_lps else None,
        top_logprobs=[top for o in outs for top in (o.top_logprobs or ())] if with_top else None,
        prompt_logprobs=first.prompt_logprobs, first_scheduled_time=first.first_scheduled_time,
        num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens)
