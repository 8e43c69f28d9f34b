"""Prometheus token counts when a stop string matches inside a multi-token output (a speculative step's): the
generation_tokens counter and the request_generation_tokens histogram count what the client receives, the same
number as usage.completion_tokens, not what the engine generated. Levels: FrontendObservability.on_output with a
cut output, one_per_token, and the HTTP server over a real ZmqEngineClient fed by a fake scheduler on ipc
sockets (chunked outputs, some still in flight after the stop)."""
from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families
from server_client import make_config, script_for, sse_events
from spec_fixtures import chunked_outputs, one_by_one_count

from appliance.engine.sampling_params import SamplingParams
from appliance.observability.hooks import FrontendObservability
from appliance.runtime.addresses import Addresses
from appliance.runtime.dp_router import DataParallelClient
from appliance.runtime.frontend import ZmqEngineClient, one_per_token
from appliance.runtime.messages import (
    OUTPUT_CODEC,
    REQUEST_CODEC,
    AbortRequest,
    GenerateRequest,
    OutputBatch,
)
from appliance.server.app import build_app
from appliance.server.context import make_context
from appliance.server.engine_client import RequestOutput

TEXT = "Hello world! How are you? Fine, thanks."
STOP = "are"


def samples(obs: FrontendObservability) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = obs.render()
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def val(s: dict, name: str, **labels: str) -> float:
    return s.get(("appliance:" + name, tuple(sorted(labels.items()))), 0.0)


def front() -> FrontendObservability:
    return FrontendObservability(make_config(), "m", max_model_len=64)


# ---- FrontendObservability.on_output with a cut output ---------------------------------------------------------

def test_a_cut_output_counts_only_the_tokens_taken_and_finishes_stop() -> None:
    obs = front()
    obs.request_arrived("r", 5, 40, now=0.0)
    assert not obs.on_output(RequestOutput("r", [1, 2, 3], num_prompt_tokens=5), now=1.0)
    # the stop string completed on the 2nd token of a 4-token output that the engine ended with "length"
    assert obs.on_output(RequestOutput("r", [4, 5, 6, 7], finish_reason="length", num_prompt_tokens=5), now=2.0,
                         num_taken=2, stopped_by_text=True)
    s = samples(obs)
    assert val(s, "generation_tokens_total") == 5
    assert val(s, "request_generation_tokens_sum") == 5 and val(s, "request_generation_tokens_count") == 1
    assert val(s, "request_success_total", finished_reason="stop") == 1
    assert val(s, "request_success_total", finished_reason="length") == 0
    assert val(s, "inter_token_latency_seconds_count") == 1  # one per output, not per token
    assert val(s, "request_time_per_output_token_seconds_sum") == pytest.approx((2.0 - 1.0) / (5 - 1))
    assert obs.metrics is not None and obs.metrics.num_tracked == 0


def test_an_output_cut_without_a_stop_string_leaves_the_finish_to_the_abort() -> None:
    obs = front()
    obs.request_arrived("r", 5, 40)
    assert not obs.on_output(RequestOutput("r", [1, 2, 3], finish_reason="length"), num_taken=1)
    obs.request_aborted("r")
    s = samples(obs)
    assert val(s, "generation_tokens_total") == 1 and val(s, "request_generation_tokens_sum") == 1
    assert val(s, "request_success_total", finished_reason="abort") == 1
    assert val(s, "request_success_total", finished_reason="length") == 0


@pytest.mark.parametrize("taken", [-1, 4])
def test_num_taken_outside_the_output_is_an_error(taken: int) -> None:
    obs = front()
    obs.request_arrived("r", 5)
    with pytest.raises(ValueError, match="num_taken"):
        obs.on_output(RequestOutput("r", [1, 2, 3]), num_taken=taken)


def test_one_per_token_keeps_every_field_in_its_place() -> None:
    out = RequestOutput("r", [7, 8, 9], [-0.1, -0.2, -0.3], [[(7, -0.1)], [(8, -0.2)], [(9, -0.3)]], [None],
                        "length", 4, 2, first_scheduled_time=12.5)
    parts = one_per_token(out)
    assert [p.new_token_ids for p in parts] == [[7], [8], [9]]
    assert [p.logprobs for p in parts] == [[-0.1], [-0.2], [-0.3]]
    assert [p.top_logprobs for p in parts] == [[[(7, -0.1)]], [[(8, -0.2)]], [[(9, -0.3)]]]
    assert [p.prompt_logprobs for p in parts] == [[None], None, None]
    assert [p.first_scheduled_time for p in parts] == [12.5, None, None]
    assert [p.finish_reason for p in parts] == [None, None, "length"]
    assert all(p.num_prompt_tokens == 4 and p.num_cached_tokens == 2 for p in parts)


# ---- the HTTP server over ZmqEngineClient, a fake scheduler behind ipc sockets ----------------------------------

@pytest.fixture
def addresses() -> Iterator[list[Addresses]]:
    """Two pipelines' worth of ipc addresses (a data-parallel front uses both)."""
    with tempfile.TemporaryDirectory(prefix="mcut-", dir="/tmp") as d:
        yield [Addresses(*(f"ipc://{d}/{n}{k}" for n in ("control", "frontend", "requests", "outputs", "results")),
                         plans=()) for k in range(2)]


class FakeScheduler:
    """Answers each GenerateRequest with `script` in `chunk`-token outputs (one OutputBatch each, all sent at
    once, so outputs past a stop are still in flight when the client closes), "length" on the last; records
    aborts."""

    def __init__(self, addresses: Addresses, script: list[int], chunk: int) -> None:
        self.script, self.chunk = script, chunk
        self.aborted: list[str] = []
        self.ctx = zmq.asyncio.Context()
        self.requests = self.ctx.socket(zmq.PULL)
        self.requests.bind(addresses.requests)
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.bind(addresses.outputs)
        self.frontend = self.ctx.socket(zmq.PUSH)
        self.frontend.bind(addresses.frontend)

    async def serve(self) -> None:
        while True:
            msg = REQUEST_CODEC.decode(await self.requests.recv())
            if isinstance(msg, AbortRequest):
                self.aborted.extend(msg.request_ids)
            elif isinstance(msg, GenerateRequest):
                for out in self.answer(msg):
                    await self.outputs.send(OUTPUT_CODEC.encode(OutputBatch([out])))

    def answer(self, req: GenerateRequest) -> Iterator[RequestOutput]:
        return chunked_outputs(req.request_id, len(req.prompt_token_ids), self.script, self.chunk,
                               SamplingParams.from_dict(req.sampling))

    def close(self) -> None:
        for s in (self.requests, self.outputs, self.frontend):
            s.close(0)
        self.ctx.term()


@contextlib.asynccontextmanager
async def server(tok: Any, addresses: list[Addresses], script: list[int], chunk: int, dp: int = 1
                 ) -> AsyncIterator[tuple[httpx.AsyncClient, FrontendObservability, list[FakeScheduler]]]:
    scheds = [FakeScheduler(a, script, chunk) for a in addresses[:dp]]
    tasks = [asyncio.create_task(s.serve()) for s in scheds]
    obs = front()
    replicas = [ZmqEngineClient(a, None, obs) for a in addresses[:dp]]
    engine = replicas[0] if dp == 1 else DataParallelClient(replicas)  # type: ignore[arg-type]
    engine.start()
    ctx = make_context(make_config(), tok, engine, max_model_len=64, vocab_size=384, obs=obs)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://127.0.0.1") as client:
            yield client, obs, scheds
    finally:
        await engine.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in scheds:
            s.close()


async def eventually(cond: Callable[[], bool], what: str = "the condition") -> None:
    for _ in range(300):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} never held")


async def settled(obs: FrontendObservability) -> None:
    """Until the request's finish is recorded (the frontend's `finally` runs when the stream is closed; behind
    the data-parallel router, when the replica's generator is finalized)."""
    await eventually(lambda: obs.metrics is not None and obs.metrics.num_tracked == 0, "the request's finish")


def assert_counts(obs: FrontendObservability, completion_tokens: int, reason: str) -> None:
    s = samples(obs)
    assert val(s, "generation_tokens_total") == completion_tokens
    assert val(s, "request_generation_tokens_sum") == completion_tokens
    assert val(s, "request_generation_tokens_count") == 1
    assert val(s, "request_success_total", finished_reason=reason) == 1
    for other in {"stop", "length", "abort"} - {reason}:
        assert val(s, "request_success_total", finished_reason=other) == 0, other
    assert val(s, "num_requests_in_flight") == 0


@pytest.mark.anyio
@pytest.mark.parametrize(("chunk", "dp"), [(3, 1), (4, 1), (64, 1), (4, 2)])
async def test_server_metrics_equal_usage_when_the_stop_falls_inside_an_output(
        tokenizer: Any, addresses: list[Addresses], chunk: int, dp: int) -> None:
    ids = script_for(tokenizer, TEXT)
    want, want_text = one_by_one_count(tokenizer, ids, STOP)
    assert -(-want // chunk) * chunk > want  # the output that completes the stop carries tokens past it
    async with server(tokenizer, addresses, ids, chunk, dp) as (c, obs, scheds):
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "stop": [STOP], "logprobs": 1})
        assert r.status_code == 200, r.text
        await settled(obs)
        if chunk < len(ids):  # the engine was still generating: the stop aborts it
            await eventually(lambda: sum(len(s.aborted) for s in scheds) == 1)
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == want_text and (choice["finish_reason"], choice["stop_reason"]) == ("stop", STOP)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([-0.01 * (i + 1) for i in range(want)])
    assert body["usage"]["completion_tokens"] == want
    assert_counts(obs, want, "stop")
    assert val(samples(obs), "time_to_first_token_seconds_count") == 1


@pytest.mark.anyio
async def test_server_chat_stream_metrics_equal_usage(tokenizer: Any, addresses: list[Addresses]) -> None:
    ids = script_for(tokenizer, TEXT)
    want, want_text = one_by_one_count(tokenizer, ids, STOP)
    async with server(tokenizer, addresses, ids, 4) as (c, obs, _):
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stop": STOP, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        await settled(obs)
    events = sse_events(r.text)
    content = "".join(ch["delta"].get("content") or "" for e in events for ch in e.get("choices", []))
    assert content == want_text
    assert events[-1]["usage"]["completion_tokens"] == want
    assert_counts(obs, want, "stop")


@pytest.mark.anyio
async def test_server_metrics_without_a_stop_string_count_every_token_once_per_output(
        tokenizer: Any, addresses: list[Addresses]) -> None:
    ids = script_for(tokenizer, TEXT)
    async with server(tokenizer, addresses, ids, 4) as (c, obs, scheds):
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "ignore_eos": True})
        assert r.status_code == 200, r.text
        await settled(obs)
    assert r.json()["usage"]["completion_tokens"] == 10
    assert_counts(obs, 10, "length")
    assert val(samples(obs), "inter_token_latency_seconds_count") == 2  # outputs of 4, 4, 2 tokens
    assert scheds[0].aborted == []
