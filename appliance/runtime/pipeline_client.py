"""The interface of the tokenizer process' engine client, one replica (ZmqEngineClient) or several
(DataParallelClient): the server's EngineClient plus what the stage itself drives (start, close, fail) and the
detokenizer's stop-string note. Both derive from it, so a method added here cannot be left out of either
(instantiating a class with an abstract method left is a TypeError), and tests/test_parallel_dp_interface.py
checks that nothing public on ZmqEngineClient is missing here."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from appliance.engine.sampling_params import SamplingParams
from appliance.server.engine_client import RequestOutput


class PipelineClient(ABC):
    # -- EngineClient (server/engine_client.py) ------------------------------------------------------------

    @property
    @abstractmethod
    def state(self) -> str:
        """"ready", "draining" or "failed"."""

    @property
    @abstractmethod
    def error_message(self) -> str: ...

    @property
    @abstractmethod
    def num_open(self) -> int:
        """Requests open through this client."""

    @abstractmethod
    def check_capacity(self, num_requests: int) -> None:
        """Raise QueueFull when `num_requests` more would overflow the queue; EngineDead when failed."""

    @abstractmethod
    def release_reserved(self, count: int) -> None:
        """Give back queue room check_capacity held (server/engine_client.Admission) for requests not sent."""

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit and yield outputs until one has finish_reason; closing the iterator early aborts it."""

    @abstractmethod
    async def abort(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def note_stop_string(self, request_id: str) -> None:
        """The detokenizer matched a stop string: the request closes early but finished with "stop"."""

    @abstractmethod
    async def stats(self) -> dict[str, Any]: ...

    # -- lifecycle (the tokenizer stage) -------------------------------------------------------------------

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def fail(self, message: str) -> None:
        """End every open request with an error; new ones are refused."""
