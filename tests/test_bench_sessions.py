"""`appliance bench sessions`: the metrics on known numbers, and the multi-turn client and CLI against the real
pipeline (supervisor + tokenizer, scheduler, worker processes on the CPU) serving the embedded default model."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pipeline_server import Server, free_port, launch, stop

from appliance.bench import sessions
from appliance.bench.client import ServeTarget
from appliance.bench.report import RequestTiming

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def _turn(session: int, turn: int, ttft: float, latency: float, out: int, cached: int | None, ideal: int,
          prompt: int = 100) -> sessions.TurnResult:
    t = RequestTiming(True, prompt, out, ttft=ttft, latency=latency, itl=[0.01] * (out - 1), cached_tokens=cached)
    return sessions.TurnResult(session, turn, t, ideal)


def test_metrics_on_known_numbers() -> None:
    results = [_turn(0, 1, 0.2, 1.2, 11, 0, 0), _turn(0, 2, 0.1, 0.6, 11, 90, 96),
               _turn(1, 1, 0.3, 2.3, 11, 64, 64), _turn(1, 2, 0.1, 1.1, 11, 80, 96)]
    m = sessions.session_metrics(results, 4.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (4, 0, 400, 44)
    assert m["ttft_by_turn"][1]["n"] == 2 and m["ttft_by_turn"][1]["p50_ms"] == pytest.approx(250.0)
    assert m["p50_ttft_later_turns_ms"] == pytest.approx(100.0)
    # per-user rates: 10 tokens over 1.0, 0.5, 2.0, 1.0 s = 10, 20, 5, 10 tok/s
    assert m["median_tok_s_per_user"] == pytest.approx(10.0)
    assert m["p90_tok_s_per_user"] == pytest.approx(np_percentile10([10, 20, 5, 10]))
    assert (m["cached_tokens"], m["ideal_hit_tokens"]) == (234, 256)
    assert m["hit_vs_ideal"] == pytest.approx(234 / 256) and m["computed_prefill_throughput"] == pytest.approx(41.5)
    assert m["p50_itl_ms"] == pytest.approx(10.0)
    # a server that does not report cached tokens: no hit figures rather than zeros
    unreported = sessions.session_metrics([_turn(0, 1, 0.1, 0.5, 3, None, 0)], 1.0)
    assert unreported["hit_vs_ideal"] is None and unreported["computed_prefill_throughput"] is None
    levels = {1: {"failed": 0, "p90_tok_s_per_user": 120.0}, 2: {"failed": 0, "p90_tok_s_per_user": 75.0},
              4: {"failed": 0, "p90_tok_s_per_user": 40.0}, 8: {"failed": 1, "p90_tok_s_per_user": 90.0}}
    assert sessions.largest_concurrency(levels, 70) == 2 and sessions.largest_concurrency(levels, 200) is None


def np_percentile10(xs: list[float]) -> float:
    import numpy as np

    return float(np.percentile(xs, 10))


def test_workload_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        sessions.SessionWorkload(1, 0, 8, 8, 8, 8)
    with pytest.raises(ValueError, match="low < high"):
        sessions.SessionWorkload(1, 1, 8, 8, 8, 8, id_low=5, id_high=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    config = f'''
[model]
device = "cpu"
[cache]
block_size = {BLOCK}
max_total_tokens = 4096
[api]
port = {port}
served_model_name = "default-sessions"
[observability]
log_level = "warning"
enable_cache_report = true
'''
    srv = launch(config, port, cfg_path=tmp_path_factory.mktemp("bench_sessions") / "serve.toml")
    yield srv
    stop(srv)


def test_history_grows_with_the_servers_tokens(server: Server) -> None:
    # turn 1: 64 + 10 = 74 prompt tokens, 8 generated: 81 computed, so turn 2 can hit 5 whole blocks (80 tokens),
    # which only a history carrying the server's own tokens allows (the prompts alone share 4 blocks)
    w = sessions.SessionWorkload(2, 3, system_len=64, user_len=10, tool_len=6, output_len=8, id_low=10, id_high=900)
    target = ServeTarget(server.base, "/v1/completions", "default-sessions")
    results, duration = asyncio.run(sessions.run_sessions(target, w, concurrency=1))
    assert len(results) == 6 and all(r.timing.success for r in results), [r.timing.error for r in results]
    for r in results:
        assert r.timing.prompt_len == 74 + (r.turn - 1) * 14 and r.timing.output_tokens == 8
        assert r.timing.cached_tokens is not None and r.timing.cached_tokens <= r.ideal_hit
        assert r.ideal_hit - r.timing.cached_tokens < BLOCK  # nothing reusable was recomputed
        if r.turn > 1:
            assert r.ideal_hit == 74 + (r.turn - 2) * 14 + 7 and r.timing.cached_tokens > 64 + (r.turn - 2) * 14
    m = sessions.session_metrics(results, duration)
    assert m["hit_vs_ideal"] > 0.9 and set(m["ttft_by_turn"]) == {1, 2, 3}
    assert server.wait_idle()["num_running"] == 0


def test_cli_sweeps_concurrency(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "sessions.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "appliance.cli.main", "bench", "sessions", "--base-url", server.base,
                        "--turns", "2", "--system-len", "48", "--user-len", "8", "--tool-len", "8",
                        "--output-len", "4", "--think-time", "0.05", "--max-concurrency", "1,2",
                        "--min-tok-s-per-user", "0.001", "--save-result", "--result-filename", str(out)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Turn 2 TTFT p50 / p99 (ms):" in r.stdout and "Reported hit / ideal hit:" in r.stdout
    res = json.loads(out.read_text())
    assert res["model"] == "default-sessions" and set(res["levels"]) == {"1", "2"}
    assert [res["levels"][c]["completed"] for c in ("1", "2")] == [2, 4]
    assert res["largest_concurrency"] == 2 and res["levels"]["2"]["p90_tok_s_per_user"] > 0
    assert res["levels"]["2"]["computed_prefill_throughput"] > 0


def test_priority_is_refused_by_fcfs(server: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="priority needs scheduler.policy"):
        client.completions.create(model="default-sessions", prompt=[5, 6, 7], max_tokens=2,
                                  extra_body={"priority": 1})
    ok = client.completions.create(model="default-sessions", prompt=[5, 6, 7], max_tokens=2,
                                   extra_body={"priority": 0})
    assert ok.usage.completion_tokens == 2


def test_slo_policy_serves_priorities_and_sessions(tmp_path: Path) -> None:
    import openai

    port = free_port()
    srv = launch(f'''
[model]
device = "cpu"
[scheduler]
policy = "slo"
slo_tbt_ms = 50
chunked_prefill_size = 64
[api]
port = {port}
[observability]
log_level = "warning"
''', port, cfg_path=tmp_path / "slo.toml")
    try:
        client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="none")
        outs = [client.completions.create(model=client.models.list().data[0].id, prompt=list(range(10, 10 + n)),
                                          max_tokens=3, temperature=0, extra_body={"priority": p, "ignore_eos": True})
                for n, p in ((200, 2), (20, -1), (90, 0))]
        assert [o.usage.completion_tokens for o in outs] == [3, 3, 3]
        w = sessions.SessionWorkload(3, 2, system_len=100, user_len=20, tool_len=10, output_len=6, id_high=900)
        results, _ = asyncio.run(sessions.run_sessions(ServeTarget(srv.base, "/v1/completions", outs[0].model),
                                                       w, concurrency=3))
        assert len(results) == 6 and all(r.timing.success for r in results), [r.timing.error for r in results]
        assert srv.wait_idle()["accounting_ok"]
    finally:
        stop(srv)


def _oversubscribed_sessions(srv: Server, model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """4 sessions of 4 turns whose histories reach ~560 tokens each, run 4 at a time against `srv`: (their
    session_metrics, the idle server's stats), every turn answered and every block accounted for."""
    w = sessions.SessionWorkload(4, 4, system_len=16, user_len=300, tool_len=64, output_len=16, id_high=900)
    results, duration = asyncio.run(sessions.run_sessions(ServeTarget(srv.base, "/v1/completions", model), w,
                                                          concurrency=4))
    assert all(r.timing.success for r in results), [r.timing.error for r in results]
    stats = srv.wait_idle()
    assert stats["accounting_ok"], stats
    return sessions.session_metrics(results, duration), stats


@pytest.mark.parametrize("host_cache", [True, False])
def test_host_tier_keeps_oversubscribed_histories(tmp_path: Path, host_cache: bool) -> None:
    # 4 sessions whose histories reach ~560 tokens each, 2.2x the 1024-token device pool, interleaved by turn
    port = free_port()
    srv = launch(f'''
[model]
device = "cpu"
max_model_len = 1024
[cache]
block_size = {BLOCK}
max_total_tokens = 1024
host_cache = {str(host_cache).lower()}
host_cache_size_gb = 0.025  # 273 blocks of 96 KiB: the workers size it and tell the scheduler
[api]
port = {port}
served_model_name = "tier"
[observability]
log_level = "warning"
''', port, cfg_path=tmp_path / "tier.toml")
    try:
        m, _ = _oversubscribed_sessions(srv, "tier")
        if host_cache:
            assert m["hit_vs_ideal"] > 0.9, m
        else:
            assert m["hit_vs_ideal"] < 0.9, m
    finally:
        stop(srv)


def test_disk_tier_and_measured_swaps_through_the_pipeline(tmp_path: Path) -> None:
    # the same oversubscribed sessions with a host tier of 48 blocks and the disk tier behind it, no room reserved
    # for outputs and preemption auto: the workers' measured rates and their disk slots reach the scheduler
    port, log = free_port(), tmp_path / "server.log"
    srv = launch(f'''
[model]
device = "cpu"
max_model_len = 1024
[scheduler]
preemption_mode = "auto"
schedule_conservativeness = 0
[cache]
block_size = {BLOCK}
max_total_tokens = 1024
host_cache = true
host_cache_ratio = 0.75
disk_cache = true
disk_cache_dir = "{tmp_path / 'disk'}"
disk_cache_size_gb = 0.05
[api]
port = {port}
served_model_name = "disk"
[observability]
log_level = "info"
''', port, cfg_path=tmp_path / "disk.toml", stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        m, stats = _oversubscribed_sessions(srv, "disk")
        assert stats["tier_disk_spilled"] > 0 and stats["tier_host_loaded"] > 0, stats
        assert m["hit_vs_ideal"] > 0.9, m
    finally:
        stop(srv)
    text = log.read_text()
    assert text.count("preemption costs measured") == 1 and "preemption auto:" in text
    assert "disk tier: " in text and not list((tmp_path / "disk").iterdir())  # its file is unlinked at once
