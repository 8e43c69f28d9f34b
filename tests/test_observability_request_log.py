"""Request logging levels and the decode-progress line."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from appliance.config.sections_serving import ObservabilitySection
from appliance.observability.request_log import PARTIAL_TEXT_CHARS, DecodeProgressLog, RequestLogger, clip_text

PARAMS = {"temperature": 0.5, "max_tokens": 8}


def logged(level: int, prompt: str = "hello", output: str = "world") -> tuple[str, str]:
    rl = RequestLogger(True, level)
    a = rl.received("r1", "/v1/completions", 5, PARAMS, prompt)
    b = rl.finished("r1", "stop", 5, 2, num_cached=4, e2e_s=0.5, ttft_s=0.1, output=output)
    return a, b


def test_levels_add_params_then_text() -> None:
    a0, b0 = logged(0)
    assert 'request_id="r1"' in a0 and "prompt_tokens=5" in a0
    assert "params=" not in a0 and "hello" not in a0 and "world" not in b0
    assert 'finish_reason="stop"' in b0 and "cached_tokens=4" in b0 and "e2e_s=0.5000" in b0
    a1, b1 = logged(1)
    assert 'params={"temperature":0.5,"max_tokens":8}' in a1 and "hello" not in a1 and "world" not in b1
    a2, b2 = logged(2)
    assert 'prompt="hello"' in a2 and 'output="world"' in b2
    long = "x" * (PARAMS_LEN := PARTIAL_TEXT_CHARS + 10)
    a2l, b2l = logged(2, long, long)
    assert f"...({PARAMS_LEN - PARTIAL_TEXT_CHARS} more)" in a2l and "x" * (PARTIAL_TEXT_CHARS + 1) not in b2l
    a3l, b3l = logged(3, long, long)
    assert long in a3l and long in b3l and "more)" not in b3l


def test_disabled_logs_nothing_and_lines_stay_single(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="appliance.requests")
    off = RequestLogger.from_config(ObservabilitySection())
    assert off.received("r", "/v1/completions", 1) is None and not caplog.records
    rl = RequestLogger.from_config(ObservabilitySection(enable_log_requests=True, log_requests_level=3))
    line = rl.received("r", "/v1/chat/completions", 2, PARAMS, "two\nlines")
    assert "\n" not in line and len(caplog.records) == 1
    assert rl.received("r", "/x", 2, None, [1, 2, 3]).endswith("prompt=[1,2,3]")
    with pytest.raises(ValueError):
        RequestLogger(True, 4)


def test_clip_text() -> None:
    assert clip_text("abc", None) == "abc"
    assert clip_text("abcdef", 2) == "ab...(4 more)"


@dataclass(frozen=True)
class Stats:
    num_running: int = 3
    num_waiting: int = 1
    kv_usage: float = 0.25
    blocks_owned: int = 5
    prefix_hit_rate: float = 0.5


def test_decode_log_every_interval_steps_with_throughput() -> None:
    t = [0.0]
    dl = DecodeProgressLog(3, block_size=16, clock=lambda: t[0])
    lines = []
    for step in range(7):
        t[0] += 0.5
        lines.append(dl.on_step(Stats(), 4 if step != 1 else 0))  # step 1 generated nothing: not counted
    logged_at = [i for i, line in enumerate(lines) if line]
    assert logged_at == [3, 6]
    first = lines[3]
    assert "running=3 waiting=1" in first and "kv_tokens=80" in first
    assert "gen_throughput_tok_s=6.00" in first  # 12 tokens in 2.0 s
    assert "gen_throughput_tok_s=8.00" in lines[6]  # 12 tokens in 1.5 s
    with pytest.raises(ValueError):
        DecodeProgressLog(0, 16)
