"""`appliance bench serve`: the metric definitions on known numbers, the client against the HTTP app in process,
and the real CLI against the real pipeline (supervisor + tokenizer, scheduler, worker processes on the CPU)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pipeline_server import Server, free_port, launch, stop
from test_server_fakes import FakeEngine

from appliance.bench import client
from appliance.bench.report import RequestTiming, format_report, timing_metrics
from appliance.bench.workloads import random_text_requests
from appliance.config import ApplianceConfig
from appliance.server.app import build_app
from appliance.server.context import make_context
from appliance.tokenization import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_metrics_follow_vllm_definitions() -> None:
    R = RequestTiming
    timings = [R(True, 10, 5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
               R(True, 20, 3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
               R(True, 30, 1, ttft=0.2, latency=0.2, itl=[]),
               R(False, 5, 0, error="HTTP 500")]
    m = timing_metrics(timings, 2.0, [50, 99])
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
    text = format_report("Serving Benchmark Result", [("Successful requests:", 3)], m, ["ttft", "itl"], [99])
    assert "Mean TTFT (ms):" in text and "P99 ITL (ms):" in text and "TPOT" not in text


def test_random_text_lengths(tiny_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    reqs = random_text_requests(20, (16, 48), (4, 12), 4, tok, seed=1)
    assert all(4 <= r.output_len <= 12 for r in reqs) and len({r.prompt for r in reqs}) == 20
    words = random_text_requests(5, (10, 10), (4, 4), 0, None, seed=1)
    assert all(r.prompt_len == 10 and len(r.prompt.split()) == 10 for r in words)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_client_against_the_app(tiny_tokenizer_dir: Path, endpoint: str) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    config = ApplianceConfig.model_validate({"model": {"path": "tiny"}, "api": {"chat_template": TEMPLATE}})
    engine = FakeEngine(tok.encode("Hello world", add_special_tokens=False))
    app = build_app(make_context(config, tok, engine, max_model_len=512, vocab_size=384))
    target = client.ServeTarget("http://127.0.0.1", endpoint, "tiny")
    reqs = random_text_requests(6, (16, 16), (5, 5), 0, tok, seed=0)
    timings, duration = asyncio.run(client.run(target, reqs, request_rate=200, max_concurrency=2,
                                               transport=httpx.ASGITransport(app=app)))
    m = timing_metrics(timings, duration, [99])
    assert m["completed"] == 6 and m["total_output_tokens"] == 30, m["errors"]
    assert m["total_input_tokens"] == sum(len(s[1]) for s in engine.submitted)
    assert all(t.ttft <= t.latency for t in timings)


@pytest.fixture(scope="module")
def server(make_tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    config = f'''
[model]
path = "{make_tiny_model("llama")}"
device = "cpu"
[cache]
max_total_tokens = 4096
[api]
port = {port}
served_model_name = "tiny-bench"
api_key = "k"
chat_template = {TEMPLATE!r}
[observability]
log_level = "warning"
'''
    srv = launch(config, port, cfg_path=tmp_path_factory.mktemp("bench_serve") / "serve.toml",
                 headers={"Authorization": "Bearer k"})
    yield srv
    stop(srv)


def bench_serve(srv: Server, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", "bench", "serve", "--base-url", srv.base,
                           *argv], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_cli_against_the_pipeline(server: Server, make_tiny_model: Any, tmp_path: Path, backend: str) -> None:
    out = tmp_path / "serve.json"
    r = bench_serve(server, "--backend", backend, "--api-key", "k", "--tokenizer", str(make_tiny_model("llama")),
                    "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "5", "--ignore-eos",
                    "--max-concurrency", "2", "--metric-percentiles", "50,99", "--save-result",
                    "--result-filename", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Output token throughput (tok/s):" in r.stdout and "P99 TPOT (ms):" in r.stdout
    res = json.loads(out.read_text())
    assert res["model"] == "tiny-bench" and "api_key" not in res["config"]  # the model came from /v1/models
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (6, 0, 30)
    assert res["mean_ttft_ms"] > 0 and res["p50_itl_ms"] > 0 and res["output_throughput"] > 0
    assert server.wait_idle()["num_running"] == 0


def test_cli_reports_failures(server: Server) -> None:
    r = bench_serve(server, "--api-key", "wrong", "--model", "tiny-bench", "--num-prompts", "2",
                    "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm")
    assert r.returncode == 1 and "Failed requests:                        2" in r.stdout
    assert "HTTP 401" in r.stderr
