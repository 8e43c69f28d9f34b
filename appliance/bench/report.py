"""Metrics and their report, with vLLM's benchmark names: `output_throughput` / `total_token_throughput` (tok/s),
`request_throughput` (req/s), and mean / median (p50) / pNN of TTFT, TPOT, ITL and E2EL in milliseconds.

TTFT: request sent -> first token; ITL: the gaps between later tokens; TPOT: (latency - TTFT) / (output tokens - 1)
per request (requests of one token have none); E2EL: the whole request.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestTiming:
    """What one request took, in seconds; success False with an error when it failed."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def stats_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean_/median_/std_/pNN_{name}_ms of values given in seconds (zeros when there are none)."""
    ms = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def throughput_metrics(duration: float, requests: int, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The rates of a run; vLLM's throughput keys (requests_per_second, tokens_per_second) beside its serving ones."""
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {"duration": duration, "elapsed_time": duration, "num_requests": requests, "completed": requests,
            "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
            "total_num_tokens": input_tokens + output_tokens,
            "request_throughput": rate(requests), "requests_per_second": rate(requests),
            "output_throughput": rate(output_tokens), "total_token_throughput": rate(input_tokens + output_tokens),
            "tokens_per_second": rate(input_tokens + output_tokens)}


def timing_metrics(timings: Sequence[RequestTiming], duration: float,
                   percentiles: Sequence[float]) -> dict[str, Any]:
    """Throughput over the successful requests and the latency statistics of each metric."""
    ok = [t for t in timings if t.success]
    m = throughput_metrics(duration, len(ok), sum(t.prompt_len for t in ok), sum(t.output_tokens for t in ok))
    m["failed"] = len(timings) - len(ok)
    m.update(stats_ms("ttft", [t.ttft for t in ok], percentiles))
    m.update(stats_ms("tpot", [t.tpot for t in ok if t.tpot is not None], percentiles))
    m.update(stats_ms("itl", [x for t in ok for x in t.itl], percentiles))
    m.update(stats_ms("e2el", [t.latency for t in ok], percentiles))
    m["errors"] = sorted({t.error for t in timings if not t.success})[:10]
    return m


def format_report(title: str, rows: Sequence[tuple[str, Any]], metrics: dict[str, Any] | None = None,
                  latency_keys: Sequence[str] = (), percentiles: Sequence[float] = ()) -> str:
    """vLLM's result block: the rows, then per latency metric its mean, median and percentiles."""
    lines = ["{s:{c}^50}".format(s=f" {title} ", c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    for label, value in rows:
        row(label, value)
    for key in latency_keys:
        assert metrics is not None
        lines.append("{s:{c}^50}".format(s=TITLES[key], c="-"))
        name = key.upper()
        row(f"Mean {name} (ms):", metrics[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", metrics[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{p:g} {name} (ms):", metrics[f"p{p:g}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def throughput_rows(m: dict[str, Any]) -> list[tuple[str, Any]]:
    return [("Successful requests:", m["completed"]), ("Benchmark duration (s):", m["duration"]),
            ("Total input tokens:", m["total_input_tokens"]), ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", m["request_throughput"]),
            ("Output token throughput (tok/s):", m["output_throughput"]),
            ("Total Token throughput (tok/s):", m["total_token_throughput"])]


def save_result(result: dict[str, Any], path: str | None, command: str) -> Path:
    """Write the result as JSON (default name: bench-<command>-<unix time>.json); returns the path."""
    out = Path(path or f"bench-{command}-{int(time.time())}.json")
    out.write_text(json.dumps(result, indent=1, default=str))
    return out
