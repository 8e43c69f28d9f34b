"""A stream that falls behind takes its queued outputs as one (runtime/frontend.py merge_outputs): tokens and
logprobs in order, once-only fields from the first, the end from the last; not with stop strings (one token at a
time there), never across a failure; the metrics still see every output."""
from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from appliance.engine.sampling_params import SamplingParams
from appliance.runtime.addresses import Addresses
from appliance.runtime.frontend import ZmqEngineClient, merge_outputs, one_per_token
from appliance.server.engine_client import EngineDead, RequestOutput

FAIL = object()


@pytest.fixture
def addresses() -> Iterator[Addresses]:
    with tempfile.TemporaryDirectory(prefix="fmerge-", dir="/tmp") as d:
        yield Addresses(*(f"ipc://{d}/{n}" for n in ("control", "frontend", "requests", "outputs", "results")),
                        plans=())


def outputs(rid: str, sizes: list[int], finish: str | None = "length") -> list[RequestOutput]:
    """Consecutive outputs of `sizes` tokens (ids 1, 2, ...), logprobs -0.01 x id, `finish` on the last."""
    outs, t = [], 1
    for k, n in enumerate(sizes):
        ids = list(range(t, t + n))
        t += n
        outs.append(RequestOutput(rid, ids, [-0.01 * i for i in ids], [[(i, -0.01 * i)] for i in ids],
                                  [None, [(7, -0.5)]] if k == 0 else None,
                                  finish if k == len(sizes) - 1 else None, num_prompt_tokens=2, num_cached_tokens=1,
                                  first_scheduled_time=12.5 if k == 0 else None))
    return outs


def test_merge_is_the_inverse_of_one_per_token() -> None:
    outs = outputs("r", [2, 1, 3])
    merged = merge_outputs(outs)
    assert merged.new_token_ids == [1, 2, 3, 4, 5, 6]
    assert merged.logprobs == pytest.approx([-0.01 * i for i in range(1, 7)])
    assert merged.top_logprobs == [[(i, -0.01 * i)] for i in range(1, 7)]
    assert merged.prompt_logprobs == [None, [(7, -0.5)]] and merged.first_scheduled_time == 12.5
    assert (merged.finish_reason, merged.num_prompt_tokens, merged.num_cached_tokens) == ("length", 2, 1)
    assert merge_outputs(one_per_token(merged)) == merged
    plain = merge_outputs([RequestOutput("r", [1]), RequestOutput("r", [2], finish_reason="stop")])
    assert (plain.logprobs, plain.top_logprobs, plain.finish_reason) == (None, None, "stop")


class Recorder:
    """FrontendObservability's on_output / request_arrived, recorded."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], float, int]] = []
        self.metrics = None

    def request_arrived(self, *args: Any) -> None:
        pass

    def on_output(self, out: RequestOutput, now: float, num_taken: int, stopped_by_text: bool) -> bool:
        self.seen.append((out.new_token_ids, now, num_taken))
        return out.finish_reason is not None and num_taken == len(out.new_token_ids)

    def request_aborted(self, request_id: str) -> None:
        pass


async def consume(client: ZmqEngineClient, sampling: SamplingParams, queued: list[Any]) -> list[RequestOutput]:
    """What one request's consumer takes when `queued` (outputs, or FAIL: the pipeline fails) all reached it by the
    time it first looks."""
    agen: AsyncIterator[RequestOutput] = client.generate("r", [5, 6], sampling)
    first = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0)  # generate() sent the request and waits on its queue
    for i, item in enumerate(queued):
        if item is FAIL:
            client.fail("the pipeline failed")
        else:
            client._queues["r"].put_nowait((item, float(i)))  # as the output reader routes them
    taken = [await first]
    try:
        async for out in agen:
            taken.append(out)
    finally:
        await agen.aclose()
    return taken


@pytest.mark.anyio
async def test_a_consumer_behind_takes_its_queued_outputs_as_one(addresses: Addresses) -> None:
    rec = Recorder()
    client = ZmqEngineClient(addresses, None, rec)
    try:
        outs = outputs("r", [1, 1, 2, 1])
        taken = await consume(client, SamplingParams(max_tokens=5), outs)
    finally:
        await client.close()
    assert taken == [merge_outputs(outs)]
    # the metrics saw every output, with its own arrival time, all of its tokens taken
    assert rec.seen == [([1], 0.0, 1), ([2], 1.0, 1), ([3, 4], 2.0, 2), ([5], 3.0, 1)]


@pytest.mark.anyio
async def test_with_stop_strings_tokens_go_one_at_a_time(addresses: Addresses) -> None:
    client = ZmqEngineClient(addresses, None)
    try:
        outs = outputs("r", [1, 2, 1])
        taken = await consume(client, SamplingParams(max_tokens=5, stop=["zz"]), outs)
    finally:
        await client.close()
    assert [o.new_token_ids for o in taken] == [[1], [2], [3], [4]]


@pytest.mark.anyio
async def test_tokens_before_a_failure_are_taken_then_it_is_raised(addresses: Addresses) -> None:
    client = ZmqEngineClient(addresses, None)
    error = RequestOutput("r", [], finish_reason="error", error="boom", error_status=500)
    try:
        taken = await consume(client, SamplingParams(max_tokens=9), [*outputs("r", [1, 2], None), error])
        assert [o.new_token_ids for o in taken] == [[1, 2, 3], []] and taken[-1].error == "boom"
        with pytest.raises(EngineDead):
            await consume(client, SamplingParams(max_tokens=9), [*outputs("r", [1, 1], None), FAIL])
    finally:
        await client.close()

