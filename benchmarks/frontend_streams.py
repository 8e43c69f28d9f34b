"""The tokenizer process alone under many streams: what its per-output Python (routing, detokenization, SSE
framing) delivers when the engine outruns it.

A stand-in scheduler process answers every GenerateRequest with one token per step, a step every --step-ms for
all live requests at once (one OutputBatch, as the real scheduler sends), "length" after --output-len tokens. The
real ZmqEngineClient and app serve --streams streaming /v1/completions requests, driven in-process by httpx (the
client shares the process, so the figures bound the front end's cost from above). Prints the offered and the
delivered tokens/s and the SSE chunks the clients got: a front end that keeps up delivers one chunk per token at
the offered rate; one behind takes what each stream has queued as one chunk (runtime/frontend.py merge_outputs).

    python -m benchmarks.frontend_streams --streams 256 --output-len 256 --step-ms 20
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile
import time
from dataclasses import dataclass

import httpx
import zmq

from appliance.config import build_config, resolve_model_path
from appliance.runtime.addresses import Addresses
from appliance.runtime.frontend import ZmqEngineClient
from appliance.runtime.messages import (
    OUTPUT_CODEC,
    REQUEST_CODEC,
    GenerateRequest,
    OutputBatch,
)
from appliance.server.app import build_app
from appliance.server.context import make_context
from appliance.server.engine_client import RequestOutput
from appliance.tokenization import load_tokenizer


@dataclass(frozen=True)
class Load:
    streams: int
    output_len: int
    step_s: float


def stand_in_scheduler(addresses: Addresses, load: Load) -> None:
    """One token per live request every step, on its own clock (its own process, as the real scheduler)."""
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    requests.bind(addresses.requests)
    outputs = ctx.socket(zmq.PUSH)
    outputs.bind(addresses.outputs)
    frontend = ctx.socket(zmq.PUSH)  # bound for the client to connect; nothing is sent on it
    frontend.bind(addresses.frontend)
    live: dict[str, int] = {}
    due = time.monotonic()
    while True:
        while requests.poll(0):
            msg = REQUEST_CODEC.decode_or_none(requests.recv())
            if isinstance(msg, GenerateRequest):
                live[msg.request_id] = 0
        due += load.step_s
        time.sleep(max(0.0, due - time.monotonic()))
        batch = []
        for rid, n in list(live.items()):
            n = live[rid] = n + 1
            done = n >= load.output_len
            batch.append(RequestOutput(rid, [5 + n % 50], finish_reason="length" if done else None,
                                       num_prompt_tokens=3))
            if done:
                del live[rid]
        if batch:
            outputs.send(OUTPUT_CODEC.encode(OutputBatch(batch, len(live), 0, 0)))


async def drive(addresses: Addresses, load: Load) -> tuple[float, int]:
    """(seconds until every stream ended, SSE data chunks received)."""
    config = build_config()
    tokenizer = load_tokenizer(resolve_model_path(config.model.path))
    engine = ZmqEngineClient(addresses, None)
    engine.start()
    ctx = make_context(config, tokenizer, engine, max_model_len=4096, vocab_size=len(tokenizer))
    chunks = 0
    body = {"prompt": "x", "max_tokens": load.output_len, "stream": True, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://127.0.0.1", timeout=600) as client:

            async def stream() -> None:
                nonlocal chunks
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: {")

            t0 = time.perf_counter()
            await asyncio.gather(*(stream() for _ in range(load.streams)))
            return time.perf_counter() - t0, chunks
    finally:
        await engine.close()


def measure(load: Load) -> tuple[float, int]:
    """(seconds until every stream ended, SSE data chunks received) with the stand-in scheduler running."""
    with tempfile.TemporaryDirectory(prefix="fstreams-") as d:
        addresses = Addresses(*(f"ipc://{d}/{n}" for n in ("control", "frontend", "requests", "outputs", "results")),
                              plans=())
        proc = multiprocessing.get_context("spawn").Process(target=stand_in_scheduler, args=(addresses, load),
                                                            daemon=True)
        proc.start()
        try:
            return asyncio.run(drive(addresses, load))
        finally:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the stand-in engine's step time")
    args = ap.parse_args()
    load = Load(args.streams, args.output_len, args.step_ms / 1000)
    seconds, chunks = measure(load)
    tokens = load.streams * load.output_len
    print(f"{load.streams} streams x {load.output_len} tokens, a step every {args.step_ms:g} ms: offered "
          f"{load.streams / load.step_s:,.0f} tok/s, delivered {tokens / seconds:,.0f} tok/s in {seconds:.2f} s "
          f"(ideal {load.output_len * load.step_s:.2f} s), {chunks} SSE chunks ({chunks / tokens:.2f} per token)")


if __name__ == "__main__":
    main()
