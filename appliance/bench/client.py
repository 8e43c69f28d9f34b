"""The serving client: streamed requests to any OpenAI-compatible server, timed as vLLM's `bench serve` times them.

TTFT is send -> the first chunk with text, ITL the gaps between later chunks with text. Arrivals are a gamma
process (Poisson at burstiness 1) at request_rate (inf: all at once), capped by max_concurrency. Output tokens
come from the streamed usage when the server sends it, else one per chunk.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from appliance.bench.report import RequestTiming
from appliance.bench.workloads import TextRequest


@dataclass(frozen=True)
class ServeTarget:
    """Where and how requests go: base_url + endpoint (/v1/completions or /v1/chat/completions)."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 6 * 3600

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: TextRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        return body


def chunk_text(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    delta = c.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def chunk_ids(obj: dict[str, Any]) -> list[int]:
    """The token ids a chunk carries (vLLM's return_token_ids), else none."""
    choices = obj.get("choices") or []
    return list(choices[0].get("token_ids") or []) if choices else []


async def send_one(client: httpx.AsyncClient, target: ServeTarget, req: TextRequest) -> RequestTiming:
    """One streamed request; failures (HTTP status, an error event, no output, transport) are recorded, not raised."""
    return await send_body(client, target, target.body(req), req.prompt_len)


async def send_body(client: httpx.AsyncClient, target: ServeTarget, body: dict[str, Any], prompt_len: int,
                    on_chunk: Callable[[dict[str, Any]], None] | None = None) -> RequestTiming:
    """One streamed request of a ready body; on_chunk sees every parsed chunk. A chunk with text or token ids
    is a token event (TTFT, ITL). The usage's cached_tokens, when the server reports it, lands in the timing."""
    res = RequestTiming(prompt_len=prompt_len)
    start = last = time.perf_counter()
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))[:200]
                    return res
                if on_chunk is not None:
                    on_chunk(obj)
                usage = obj.get("usage") or usage
                if chunk_text(obj) or chunk_ids(obj):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
        res.output_tokens = int(usage["completion_tokens"]) if usage else chunks
        if usage and usage.get("prompt_tokens"):
            res.prompt_len = int(usage["prompt_tokens"])
        details = (usage or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.cached_tokens = int(details["cached_tokens"])
        res.success = chunks > 0 or res.output_tokens > 0
        res.error = "" if res.success else "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def arrivals(n: int, rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Request indices at a gamma-process rate (vLLM's get_request); rate inf: all at once."""
    if burstiness <= 0 or rate <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate} and {burstiness}")
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate == float("inf") or i == n - 1:
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))


async def run(target: ServeTarget, requests: Sequence[TextRequest], request_rate: float = float("inf"),
              burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0, progress: bool = False,
              transport: httpx.AsyncBaseTransport | None = None) -> tuple[list[RequestTiming], float]:
    """Send every request; (their timings in request order, the run's duration in seconds)."""
    limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=None)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="serve", unit="req")
    async with httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s), limits=limits,
                                 transport=transport) as client:

        async def one(req: TextRequest) -> RequestTiming:
            if sem is None:
                res = await send_one(client, target, req)
            else:
                async with sem:
                    res = await send_one(client, target, req)
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(requests[i]))
                 async for i in arrivals(len(requests), request_rate, burstiness, seed)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration
