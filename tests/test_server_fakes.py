"""An in-memory EngineClient for HTTP-layer tests (no tests here): a fixed token script, one token per output."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from appliance.engine.sampling_params import SamplingParams
from appliance.server.engine_client import EngineDead, QueueFull, RequestOutput


@dataclass
class FakeEngine:
    script: list[int]  # tokens every request generates, in order (cycled)
    eos: int | None = None
    delay: float = 0.0  # seconds between outputs
    max_queued: int | None = None
    cached_tokens: int = 0
    state: str = "ready"
    error_message: str = ""
    submitted: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    open: set[str] = field(default_factory=set)

    def check_capacity(self, num_requests: int) -> None:
        if self.state == "failed":
            raise EngineDead(self.error_message)
        if self.max_queued is not None and len(self.open) + num_requests > self.max_queued:
            raise QueueFull(f"{len(self.open)} waiting")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Records the request, yields `outputs` until one finishes; one that ends early counts as aborted."""
        self.submitted.append((request_id, list(prompt_token_ids), sampling))
        self.open.add(request_id)
        finished = False
        try:
            async for out in self.outputs(request_id, prompt_token_ids, sampling):
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self.open.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    async def outputs(self, request_id: str, prompt_token_ids: list[int],
                      sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The script, one token per output."""
        limit = sampling.max_tokens or 16
        for i in range(limit):
            if self.state == "failed":
                raise EngineDead(self.error_message)
            if self.delay:
                await asyncio.sleep(self.delay)
            tok = self.script[i % len(self.script)]
            reason = None
            if (tok == self.eos and not sampling.ignore_eos) or tok in sampling.stop_token_ids:
                reason = "stop"
            elif i == limit - 1:
                reason = "length"
            lps = top = None
            if sampling.logprobs is not None:
                lps = [-0.5]
                top = [[(tok, -0.5), (tok + 1, -1.5), (tok + 2, -2.5)][: max(sampling.logprobs, 0)]]
            prompt_lps = None
            if i == 0 and sampling.prompt_logprobs is not None:
                prompt_lps = [None] + [[(t, -1.0)] for t in prompt_token_ids[1:]]
            yield RequestOutput(request_id, [tok], lps, top, prompt_lps, reason, len(prompt_token_ids),
                                self.cached_tokens)

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    async def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.open), "num_waiting": 0, "kv_blocks_total": 10, "kv_blocks_free": 10}
