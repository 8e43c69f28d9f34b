"""Timeouts and crashes of the REAL pipeline: api.request_timeout ends a request with 408 and frees its blocks;
killing the scheduler or the tokenizer (HTTP) process ends every in-flight request with an error within 5 s, /health
answers 503 while the HTTP process lives, the supervisor exits non-zero and no process is left. (Killing the worker:
test_pipeline_e2e.py; SIGKILL of the supervisor: test_runtime_supervisor.py.) The kill tests start their own
pipelines."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from pipeline_server import Server, free_port, kill_stage, launch, stop, survivors

pytestmark = pytest.mark.slow

KEY = "crash-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 0.3  # 480 tokens of the tiny model take ~1 s on a CPU


def config(model: Any, port: int, timeout: float = 0) -> str:
    return f'''
[model]
path = "{model}"
device = "cpu"
[cache]
max_total_tokens = 2048
[api]
port = {port}
served_model_name = "tiny"
api_key = "{KEY}"
request_timeout = {timeout}
[observability]
enable_metrics = true
log_level = "error"
'''


@pytest.fixture(scope="module")
def server(make_tiny_model: Any) -> Iterator[Server]:
    port = free_port()
    srv = launch(config(make_tiny_model("llama"), port, timeout=TIMEOUT), port, headers=AUTH)
    yield srv
    stop(srv)


def in_flight(srv: Server, stream: bool, out: dict[str, Any]) -> threading.Thread:
    """A long request in a thread; out: 'first' (monotonic time of the first byte), 'end' (when it ended),
    'status', 'body' (text received), 'error' (the transport error, if the connection broke)."""
    def run() -> None:
        body = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": stream}
        try:
            with httpx.Client(timeout=30) as h, h.stream("POST", f"{srv.base}/v1/completions", json=body,
                                                         headers=AUTH) as r:
                out["status"] = r.status_code
                chunks = []
                for chunk in r.iter_text():
                    out.setdefault("first", time.monotonic())
                    chunks.append(chunk)
                out["body"] = "".join(chunks)
        except httpx.HTTPError as exc:
            out["error"] = exc
        out["end"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_request_timeout_ends_the_request_and_frees_its_blocks(server: Server) -> None:
    t0 = time.monotonic()
    r = httpx.post(f"{server.base}/v1/completions", headers=AUTH, timeout=30, json={
        "prompt": "Hello", "max_tokens": 480, "ignore_eos": True})
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout", r.text
    assert TIMEOUT < time.monotonic() - t0 < TIMEOUT + 2
    s = server.wait_idle(timeout=2)
    assert s["kv_blocks_owned"] == 0 and s["num_running"] == 0
    out: dict[str, Any] = {}
    in_flight(server, True, out).join(timeout=10)
    assert out["status"] == 200 and '"code": "timeout"' in out["body"].replace('":"', '": "'), out["body"][-300:]
    assert out["end"] - out["first"] < TIMEOUT + 2
    s = server.wait_idle(timeout=2)
    assert s["kv_blocks_owned"] == 0 and s["accounting_ok"]


def _health_codes_until_down(srv: Server, until: float) -> list[int]:
    codes = []
    while time.monotonic() < until:
        try:
            codes.append(httpx.get(f"{srv.base}/health", timeout=1).status_code)
        except httpx.HTTPError:
            codes.append(0)  # the HTTP process is gone
            if srv.proc.poll() is not None:
                break
        time.sleep(0.02)
    return codes


def _check_crash(srv: Server, outs: list[dict[str, Any]], killed_at: float, errors: str) -> None:
    for out in outs:
        assert "end" in out and out["end"] - killed_at < 5, out
        if errors == "event":  # the HTTP process lives on: an error event / a 503 body
            if out.get("status") == 200:
                assert '"error"' in out.get("body", ""), out.get("body", "")[-200:]
            else:
                assert out.get("status") == 503 or "error" in out, out
        else:  # the HTTP process died: the connection broke
            assert "error" in out or '"error"' in out.get("body", ""), out
        assert "Traceback" not in out.get("body", "")
    assert srv.proc.wait(timeout=20) != 0
    left = survivors(srv.stages, within_s=5)
    assert not left, left


def _start_in_flight(srv: Server) -> tuple[list[dict[str, Any]], list[threading.Thread]]:
    outs: list[dict[str, Any]] = [{}, {}]
    threads = [in_flight(srv, True, outs[0]), in_flight(srv, False, outs[1])]
    deadline = time.monotonic() + 10
    while srv.stats()["num_running"] < 2 or "first" not in outs[0]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return outs, threads


@contextmanager
def own_pipeline(model: Any) -> Iterator[Server]:
    """A pipeline of its own for a test that kills one of its stages; SIGKILLed if it outlives the test."""
    port = free_port()
    srv = launch(config(model, port), port, headers=AUTH)
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_killing_the_scheduler_fails_every_request_fast(make_tiny_model: Any) -> None:
    with own_pipeline(make_tiny_model("llama")) as srv:
        outs, threads = _start_in_flight(srv)
        killed = kill_stage(srv, "scheduler")
        codes = _health_codes_until_down(srv, killed + 4)
        for t in threads:
            t.join(timeout=10)
        assert 200 not in codes[5:], codes  # 503 (a failed engine) until the HTTP process stops
        assert 503 in codes, codes
        _check_crash(srv, outs, killed, errors="event")


def test_killing_the_tokenizer_process_stops_everything(make_tiny_model: Any) -> None:
    """The HTTP process itself dies, so its clients see the connection break; the supervisor stops the rest."""
    with own_pipeline(make_tiny_model("llama")) as srv:
        outs, threads = _start_in_flight(srv)
        killed = kill_stage(srv, "tokenizer")
        for t in threads:
            t.join(timeout=10)
        _check_crash(srv, outs, killed, errors="broken")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.base}/health", timeout=1)
