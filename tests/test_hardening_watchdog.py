"""A worker that freezes or fails mid-run, end to end on the REAL pipeline (APPLIANCE_FAULT_INJECTION makes every
worker's forward hang or raise from its step N on): with scheduler.watchdog_timeout the frozen worker turns
/health to 503, every stage's Python stacks are logged, the open stream ends with an error event and the
supervisor exits 1; a raising worker does the same without waiting."""
from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pipeline_server import free_port, stage_children, start_run, survivors
from test_observability_e2e import prompt_ids

pytestmark = pytest.mark.slow

WATCHDOG_S = 4.0
FAULT_STEP = 30


def run_with_fault(model: Path, fault: str, watchdog_s: float) -> tuple[subprocess.Popen, str, Path, dict[int, str]]:
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="appl-wd-"))
    cfg = folder / "serve.toml"
    cfg.write_text(f'''
[model]
path = "{model}"
device = "cpu"
[scheduler]
watchdog_timeout = {watchdog_s}
[cache]
max_total_tokens = 2048
[api]
port = {port}
served_model_name = "tiny"
[observability]
log_level = "info"
''')
    log = folder / "server.log"
    os.environ["APPLIANCE_FAULT_INJECTION"] = fault
    try:
        with open(log, "w") as err:
            proc = start_run(cfg, stderr=err)
    finally:
        del os.environ["APPLIANCE_FAULT_INJECTION"]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base, log, stage_children(proc.pid)
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "not ready"
        time.sleep(0.2)


def stream_in_thread(base: str, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        lines = out.setdefault("lines", [])
        try:
            with httpx.Client(timeout=120) as h, h.stream("POST", f"{base}/v1/completions", json={
                    "prompt": prompt_ids(3, 8), "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
                out["status"] = r.status_code
                lines.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))
        except httpx.HTTPError as exc:
            out["transport_error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def watch_health(base: str, proc: subprocess.Popen, within_s: float) -> list[int | None]:
    """/health's answers (None: no answer) every 20 ms until the supervisor exits."""
    seen: list[int | None] = []
    deadline = time.monotonic() + within_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.append(httpx.get(f"{base}/health", timeout=1).status_code)
        except httpx.HTTPError:
            seen.append(None)
        time.sleep(0.02)
    return seen


def test_a_frozen_worker_trips_the_watchdog(make_tiny_model: Any) -> None:
    proc, base, log, stages = run_with_fault(make_tiny_model("llama"), f"forward:hang:{FAULT_STEP}", WATCHDOG_S)
    try:
        out: dict[str, Any] = {}
        t = stream_in_thread(base, out)
        health = watch_health(base, proc, within_s=WATCHDOG_S + 60)
        code = proc.wait(timeout=60)
        t.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert 200 in health and 503 in health and health.index(503) > health.index(200), health
    assert out["status"] == 200 and len(out["lines"]) >= 5, out  # chunks came until the freeze
    assert '"error"' in out["lines"][-2] and out["lines"][-1] == "data: [DONE]", out["lines"][-3:]
    assert "watchdog" in text and "scheduler.watchdog_timeout" in text
    # the frozen worker's stack, written by faulthandler when the supervisor asked for it
    assert "fault_injection.py" in text and "before_forward" in text, text[-3000:]
    assert survivors(stages, 10) == {}


def test_a_raising_worker_fails_the_pipeline_at_once(make_tiny_model: Any) -> None:
    proc, base, log, stages = run_with_fault(make_tiny_model("llama"), f"forward:raise:{FAULT_STEP}", 300.0)
    try:
        out: dict[str, Any] = {}
        t0 = time.monotonic()
        t = stream_in_thread(base, out)
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
        t.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 1 and took < 30, (code, took, text[-3000:])
    assert "InjectedFault" in text
    assert survivors(stages, 10) == {}
    assert '"error"' in out["lines"][-2] and out["lines"][-1] == "data: [DONE]", out["lines"][-3:]
