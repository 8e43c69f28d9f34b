"""`appliance bench sessions`: a closed-loop multi-turn (agentic) workload of token ids against any
OpenAI-compatible /v1/completions server.

Every session starts from one system prompt that all sessions share and a first user message of its own. Each turn
sends the whole history as token ids, streams the answer with `return_token_ids` (the server's own generated
tokens), appends those tokens and a tool result to the history and waits the think time before the next turn.
`concurrency` sessions run at once; a worker then starts another (closed loop).

The ideal hit of a turn is the part of its prompt an earlier request already computed: the previous turn's prompt
and output except the output's last token (sampled, never fed back), or the system prompt once a request carrying
it was sent. A cache that works in blocks reports up to a block less per request. The hit the server reports is
usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details, SGLang's and appliance's
observability.enable_cache_report); a server that does not report it leaves the hit and computed-prefill rate out.

tok/s per user of a turn = (output tokens - 1) / (latency - TTFT); "p90 tok/s per user" is the rate 90% of the
turns reach (the 10th percentile of the rates, i.e. 1 / p90 TPOT).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from appliance.bench.client import ServeTarget, chunk_ids, chunk_text, send_body
from appliance.bench.report import RequestTiming, stats_ms


@dataclass(frozen=True)
class SessionWorkload:
    """sessions x turns; lengths in tokens; ids drawn uniformly from [id_low, id_high)."""

    num_sessions: int
    turns: int
    system_len: int
    user_len: int
    tool_len: int
    output_len: int
    think_time_s: float = 0.0
    id_low: int = 10
    id_high: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.turns < 1 or self.user_len < 1 or self.output_len < 1:
            raise ValueError("sessions, turns, user and output lengths must be >= 1")
        if self.system_len < 0 or self.tool_len < 0 or self.think_time_s < 0:
            raise ValueError("system and tool lengths and the think time must be >= 0")
        if not 0 <= self.id_low < self.id_high:
            raise ValueError(f"token ids need 0 <= low < high, got [{self.id_low}, {self.id_high})")


@dataclass(frozen=True)
class TurnResult:
    session: int
    turn: int  # 1-based
    timing: RequestTiming
    ideal_hit: int


def _ids(rng: np.random.Generator, n: int, w: SessionWorkload) -> list[int]:
    return rng.integers(w.id_low, w.id_high, size=n).tolist()


async def run_sessions(target: ServeTarget, w: SessionWorkload, concurrency: int, tokenizer: Any = None,
                       transport: httpx.AsyncBaseTransport | None = None) -> tuple[list[TurnResult], float]:
    """Run every session, `concurrency` at a time; (the turns in completion order, the run's duration in s).
    tokenizer: encodes the answer's text for servers that send no token ids."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    system = _ids(np.random.default_rng([w.seed, 0]), w.system_len, w)
    results: list[TurnResult] = []
    todo = list(range(w.num_sessions))
    system_sent = False

    async def session(client: httpx.AsyncClient, i: int) -> None:
        nonlocal system_sent
        rng = np.random.default_rng([w.seed, i + 1])
        history = system + _ids(rng, w.user_len, w)
        computed = 0  # tokens of the history its earlier turns computed
        for turn in range(1, w.turns + 1):
            ideal = max(computed, w.system_len if system_sent else 0)
            system_sent = True
            out_ids: list[int] = []
            text: list[str] = []

            def on_chunk(obj: dict[str, Any], out_ids: list[int] = out_ids, text: list[str] = text) -> None:
                out_ids.extend(chunk_ids(obj))
                text.append(chunk_text(obj))

            body = {"model": target.model, "prompt": history, "max_tokens": w.output_len, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": target.temperature,
                    "ignore_eos": True, "return_token_ids": True}
            timing = await send_body(client, target, body, len(history), on_chunk)
            if timing.success and not out_ids:
                if tokenizer is None:
                    timing.success = False
                    timing.error = ("the server sent no token ids (return_token_ids); give --tokenizer to encode "
                                    "its text instead")
                else:
                    out_ids = list(tokenizer.encode("".join(text), add_special_tokens=False))
            results.append(TurnResult(i, turn, timing, ideal))
            if not timing.success:
                return
            computed = len(history) + len(out_ids) - 1
            history = history + out_ids + _ids(rng, w.tool_len, w)
            if turn < w.turns and w.think_time_s:
                await asyncio.sleep(w.think_time_s)

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            await session(client, todo.pop(0))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s), limits=limits,
                                 transport=transport) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(min(concurrency, w.num_sessions))))
        duration = time.perf_counter() - start
    return results, duration


def session_metrics(results: Sequence[TurnResult], duration: float) -> dict[str, Any]:
    """The run's figures (see the module docstring); times in ms."""
    ok = [r for r in results if r.timing.success]
    t = [r.timing for r in ok]
    m: dict[str, Any] = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
                         "total_input_tokens": sum(x.prompt_len for x in t),
                         "total_output_tokens": sum(x.output_tokens for x in t)}
    m["output_throughput"] = m["total_output_tokens"] / duration if duration > 0 else 0.0
    m["ttft_by_turn"] = {}
    for turn in sorted({r.turn for r in ok}):
        s = stats_ms("ttft", [r.timing.ttft for r in ok if r.turn == turn], [50, 99])
        m["ttft_by_turn"][turn] = {"n": sum(1 for r in ok if r.turn == turn),
                                   "p50_ms": s["p50_ttft_ms"], "p99_ms": s["p99_ttft_ms"]}
    later = [r.timing.ttft for r in ok if r.turn > 1]
    m["p50_ttft_later_turns_ms"] = stats_ms("ttft", later, [50])["p50_ttft_ms"] if later else None
    m.update(stats_ms("itl", [x for r in t for x in r.itl], [50, 90, 99]))
    rates = [(x.output_tokens - 1) / (x.latency - x.ttft) for x in t if x.output_tokens > 1 and x.latency > x.ttft]
    m["median_tok_s_per_user"] = float(np.median(rates)) if rates else None
    m["p90_tok_s_per_user"] = float(np.percentile(rates, 10)) if rates else None
    reported = [r for r in ok if r.timing.cached_tokens is not None]
    m["ideal_hit_tokens"] = sum(r.ideal_hit for r in ok)
    if reported and len(reported) == len(ok):
        cached = sum(r.timing.cached_tokens or 0 for r in ok)
        m["cached_tokens"] = cached
        m["hit_vs_ideal"] = cached / m["ideal_hit_tokens"] if m["ideal_hit_tokens"] else None
        m["hit_rate"] = cached / m["total_input_tokens"] if m["total_input_tokens"] else 0.0
        m["computed_prefill_tokens"] = m["total_input_tokens"] - cached
        m["computed_prefill_throughput"] = m["computed_prefill_tokens"] / duration if duration > 0 else 0.0
    else:
        m.update(cached_tokens=None, hit_vs_ideal=None, hit_rate=None, computed_prefill_tokens=None,
                 computed_prefill_throughput=None)
    m["errors"] = sorted({r.timing.error for r in results if not r.timing.success})[:10]
    return m


def largest_concurrency(levels: dict[int, dict[str, Any]], min_tok_s: float) -> int | None:
    """The largest concurrency whose p90 tok/s per user is >= min_tok_s, with every turn served; None if none."""
    good = [c for c, m in levels.items()
            if not m["failed"] and m["p90_tok_s_per_user"] is not None and m["p90_tok_s_per_user"] >= min_tok_s]
    return max(good) if good else None


def report_rows(concurrency: int, w: SessionWorkload, m: dict[str, Any]) -> list[tuple[str, Any]]:
    def opt(v: float | None, fmt: str = "{:.2f}") -> Any:
        return "not reported" if v is None else fmt.format(v)

    rows: list[tuple[str, Any]] = [
        ("Concurrent sessions:", concurrency), ("Sessions x turns:", f"{w.num_sessions} x {w.turns}"),
        ("Successful turns:", m["completed"]), ("Failed turns:", m["failed"]),
        ("Benchmark duration (s):", m["duration"]), ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Output token throughput (tok/s):", m["output_throughput"]),
        ("Computed prefill (tok/s):", opt(m["computed_prefill_throughput"])),
        ("Reported cached tokens:", opt(m["cached_tokens"], "{}")), ("Ideal cached tokens:", m["ideal_hit_tokens"]),
        ("Reported hit / ideal hit:", opt(m["hit_vs_ideal"], "{:.3f}")),
        ("Median tok/s per user:", opt(m["median_tok_s_per_user"])),
        ("P90 tok/s per user:", opt(m["p90_tok_s_per_user"])),
        ("P50 ITL (ms):", m["p50_itl_ms"]), ("P90 ITL (ms):", m["p90_itl_ms"]), ("P99 ITL (ms):", m["p99_itl_ms"])]
    for turn, s in m["ttft_by_turn"].items():
        rows.append((f"Turn {turn} TTFT p50 / p99 (ms):", f"{s['p50_ms']:.2f} / {s['p99_ms']:.2f}"))
    return rows
