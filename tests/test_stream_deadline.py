"""server/generation.py with_deadline: one timer per stream ends a wait for an item with a 408 and closes the
stream; a deadline passing while the consumer holds an item refuses the next; other cancellations stay theirs."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from appliance.server.errors import ApiError
from appliance.server.generation import with_deadline


class Source:
    """Items at given delays; records whether it was closed and how it ended."""

    def __init__(self, delays: list[float]) -> None:
        self.delays, self.closed, self.cancelled = delays, False, False

    async def items(self) -> AsyncIterator[int]:
        try:
            for i, d in enumerate(self.delays):
                await asyncio.sleep(d)
                yield i
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed = True


def test_every_item_before_the_deadline() -> None:
    async def run() -> list[int]:
        return [i async for i in with_deadline(Source([0, 0.01, 0]).items(), 5.0)]

    assert asyncio.run(run()) == [0, 1, 2]


def test_a_wait_past_the_deadline_is_a_408_and_the_stream_is_closed() -> None:
    src = Source([0, 0, 10])
    got: list[int] = []

    async def run() -> None:
        async for i in with_deadline(src.items(), 0.05):
            got.append(i)

    with pytest.raises(ApiError) as err:
        asyncio.run(run())
    assert err.value.status == 408 and got == [0, 1] and src.closed and src.cancelled


def test_a_deadline_passing_while_the_consumer_holds_an_item_refuses_the_next() -> None:
    src = Source([0, 0, 0])
    got: list[int] = []

    async def run() -> None:
        async for i in with_deadline(src.items(), 0.02):
            got.append(i)
            await asyncio.sleep(0.05)  # the consumer's own await: not cancelled by the deadline

    with pytest.raises(ApiError) as err:
        asyncio.run(run())
    assert err.value.status == 408 and got == [0] and src.closed


def test_another_cancellation_is_not_turned_into_a_408() -> None:
    src = Source([10])

    async def run() -> None:
        async def consume() -> None:
            async for _ in with_deadline(src.items(), 5.0):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.02)
        task.cancel()  # a client disconnect
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert src.closed and src.cancelled


def test_no_timeout_passes_items_through() -> None:
    async def run() -> list[int]:
        return [i async for i in with_deadline(Source([0, 0]).items(), None)]

    assert asyncio.run(run()) == [0, 1]
