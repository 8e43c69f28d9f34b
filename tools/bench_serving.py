#!/usr/bin/env python
"""Serving benchmark against any OpenAI-compatible endpoint, reporting what `vllm bench serve` reports.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --model tiny --tokenizer /path/to/model \
        --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 200 \
        --request-rate 8 --max-concurrency 32 [--endpoint /v1/chat/completions] [--save-result out.json]

Semantics follow vLLM's benchmark: requests stream; TTFT is send -> first chunk with text, ITL the gaps between
later chunks with text, TPOT (latency - TTFT) / (output tokens - 1) per request, E2EL the whole request.
Arrivals are a gamma process (Poisson at --burstiness 1) at --request-rate (inf: all at once), capped by
--max-concurrency. Output tokens come from the streamed usage when the server sends it, else one per chunk.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

_WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "an", "be", "this", "which", "have", "are", "not", "they", "one", "all", "were", "had", "but", "their", "been", "has", "more", "when", "who", "will", "no", "would", "there", "can", "its", "if", "so", "what", "time", "year", "about", "people", "into", "only", "new", "some", "could", "them", "other", "than", "then", "now", "look", "also", "back", "after", "use", "two", "how", "our", "work", "first", "well", "way", "even", "want", "because", "any", "these", "give", "day", "most", "us"]


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ---- dataset ---------------------------------------------------------------------------------------------

def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                    tokenizer: Any | None, seed: int) -> list[SampleRequest]:
    """vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)], random token ids decoded to
    text (or random words, roughly a token each, without a tokenizer)."""
    rng = np.random.default_rng(seed)
    lo_in, hi_in = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
    lo_out, hi_out = max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio)))
    in_lens = rng.integers(lo_in, hi_in + 1, size=num)
    out_lens = rng.integers(lo_out, hi_out + 1, size=num)
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = [i for i in range(len(tokenizer)) if i not in special]
        prefix = [vocab[i] for i in rng.integers(0, len(vocab), size=prefix_len)]
    else:
        prefix = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=prefix_len)]
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        if tokenizer is not None:
            ids = prefix + [vocab[i] for i in rng.integers(0, len(vocab), size=int(n_in))]
            prompt = tokenizer.decode(ids)
            n = len(tokenizer.encode(prompt, add_special_tokens=False))
        else:
            prompt = " ".join(prefix + [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=int(n_in))])
            n = prefix_len + int(n_in)
        out.append(SampleRequest(prompt, n, int(n_out)))
    return out


# ---- one request -----------------------------------------------------------------------------------------

def request_body(args: argparse.Namespace, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "max_tokens": req.expected_output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    delta = c.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_one(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any],
                   req: SampleRequest) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
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
                usage = obj.get("usage") or usage
                if _chunk_text(obj):
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
        res.success = chunks > 0 or res.output_tokens > 0
        if not res.success:
            res.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


# ---- the run ---------------------------------------------------------------------------------------------

async def arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield request indices at a gamma-process rate (vLLM's get_request)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate == float("inf") or i == n - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


async def run_benchmark(args: argparse.Namespace, requests: list[SampleRequest],
                        transport: httpx.AsyncBaseTransport | None = None) -> tuple[list[RequestResult], float]:
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 10_000, max_keepalive_connections=None)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, transport=transport) as client:

        async def limited(req: SampleRequest) -> RequestResult:
            if sem is None:
                return await send_one(client, url, headers, request_body(args, req), req)
            async with sem:
                return await send_one(client, url, headers, request_body(args, req), req)

        start = time.perf_counter()
        tasks = []
        async for i in arrivals(len(requests), args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(limited(requests[i])))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    m: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    m.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    m.update(_stats("tpot", tpots, percentiles))
    m.update(_stats("itl", [x for r in ok for x in r.itl], percentiles))
    m.update(_stats("e2el", [r.latency for r in ok], percentiles))
    m["errors"] = sorted({r.error for r in results if not r.success})[:10]
    return m


def report(m: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Maximum request concurrency:", args.max_concurrency or "unlimited")
    row("Request rate configured (RPS):", args.request_rate)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key in args.percentile_metrics.split(","):
        lines.append("{s:{c}^50}".format(s=titles[key], c="-"))
        name = key.upper()
        row(f"Mean {name} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", m[f"median_{key}_ms"])
        for p in args.metric_percentiles:
            row(f"P{p:g} {name} (ms):", m[f"p{p:g}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--backend", choices=["openai", "openai-chat", "vllm"], default=None,
                   help="vLLM's names: openai-chat selects /v1/chat/completions")
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for random prompts (default: random words)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=6 * 3600)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99", type=lambda s: [float(x) for x in s.split(",")])
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-filename", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    if args.backend == "openai-chat" and args.endpoint == "/v1/completions":
        args.endpoint = "/v1/chat/completions"
    if args.burstiness <= 0:
        print("--burstiness must be > 0", file=sys.stderr)
        return 2
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    random.seed(args.seed)
    requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.random_prefix_len, tokenizer, args.seed)
    results, duration = asyncio.run(run_benchmark(args, requests))
    metrics = compute_metrics(results, duration, args.metric_percentiles)
    print(report(metrics, args))
    if metrics["errors"]:
        print("errors:", *metrics["errors"], sep="\n  ", file=sys.stderr)
    if args.save_result or args.result_filename:
        path = args.result_filename or f"bench-{int(time.time())}.json"
        with open(path, "w") as f:
            json.dump({**metrics, "config": {k: v for k, v in vars(args).items() if k != "api_key"},
                       "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results]}, f, indent=1)
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
