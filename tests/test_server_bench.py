"""tools/bench_serving.py: metric definitions on known numbers, and a run against the HTTP app."""
from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server_fakes import FakeEngine

from appliance.config import ApplianceConfig
from appliance.server.app import build_app
from appliance.server.context import make_context
from appliance.tokenization import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "tools" / "bench_serving.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["bench_serving"] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


bench = load_bench()


def test_metrics_follow_vllm_definitions() -> None:
    R = bench.RequestResult
    results = [
        R(True, 10, 5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        R(True, 20, 3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        R(True, 30, 1, ttft=0.2, latency=0.2, itl=[]),
        R(False, 5, 0, error="HTTP 500"),
    ]
    m = bench.compute_metrics(results, 2.0, [50, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT: (0.5 - 0.1) / 4 and (0.7 - 0.3) / 2; the one-token request has none
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["mean_itl_ms"] == pytest.approx(800.0 / 6)
    assert m["p99_itl_ms"] == pytest.approx(200.0) and m["median_itl_ms"] == pytest.approx(100.0)
    assert m["errors"] == ["HTTP 500"]
    args = bench.build_parser().parse_args(["--model", "m"])
    text = bench.report(m, args)
    assert "Mean TTFT (ms):" in text and "P99 ITL (ms):" in text and "Request throughput (req/s):" in text


def test_random_dataset_lengths(tiny_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    reqs = bench.random_requests(20, 32, 8, 0.5, 4, tok, seed=1)
    assert all(4 <= r.expected_output_len <= 12 for r in reqs)
    assert len({r.prompt for r in reqs}) == 20
    words = bench.random_requests(5, 10, 4, 0.0, 0, None, seed=1)
    assert all(r.prompt_len == 10 and len(r.prompt.split()) == 10 for r in words)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_run_against_the_app(tiny_tokenizer_dir: Path, endpoint: str) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    config = ApplianceConfig.model_validate({"model": {"path": "tiny"}, "api": {"chat_template": "{{ messages[0]['content'] }}"}})
    engine = FakeEngine(tok.encode("Hello world", add_special_tokens=False))
    app = build_app(make_context(config, tok, engine, max_model_len=512, vocab_size=384))
    args = bench.build_parser().parse_args(["--model", "tiny", "--base-url", "http://127.0.0.1", "--endpoint", endpoint,
                                            "--num-prompts", "6", "--random-input-len", "16", "--random-output-len",
                                            "5", "--request-rate", "200", "--max-concurrency", "2"])
    reqs = bench.random_requests(6, 16, 5, 0.0, 0, tok, seed=0)
    results, duration = asyncio.run(bench.run_benchmark(args, reqs, transport=httpx.ASGITransport(app=app)))
    m = bench.compute_metrics(results, duration, [99])
    assert m["completed"] == 6 and m["total_output_tokens"] == 30, m["errors"]
    assert m["total_input_tokens"] == sum(len(s[1]) for s in engine.submitted)
    assert all(r.ttft <= r.latency for r in results)
