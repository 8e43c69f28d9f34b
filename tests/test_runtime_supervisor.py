"""The supervisor's failure paths with real processes: a stage that cannot start, a supervisor killed by
SIGKILL (its children notice and exit), SIGTERM (ordered, clean exit)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pipeline_server import free_port, stage_children, survivors, wait_healthy

pytestmark = pytest.mark.slow


def _start(model: Path | str, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "appliance.cli.main", "serve", str(model), "--device", "cpu",
                             "--port", str(port), "--max-total-tokens", "2048", "--log-level", "warning", *extra],
                            env=env, stderr=subprocess.PIPE, text=True)


def test_a_stage_that_cannot_start_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    proc = _start(tmp_path / "no-such-model", free_port())
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    # the tokenizer and the worker both read the model dir; whichever fails first is named, with the path
    assert ("stage worker0 failed" in err or "stage tokenizer failed" in err) and "no-such-model" in err


def test_sigkill_of_the_supervisor_takes_the_children_down(make_tiny_model: Any) -> None:
    port = free_port()
    proc = _start(make_tiny_model("llama"), port)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", timeout_s=120)
        kids = stage_children(proc.pid)
        assert sorted(kids.values()) == ["scheduler", "tokenizer", "worker0"]
        body = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as h, h.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                                     json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.kill()  # with a request in flight: it must end with an error, not hang
            proc.wait()
            t0 = time.monotonic()
            rest: list[str] = []
            try:
                rest.extend(lines)
            except httpx.HTTPError:
                rest.append("connection broken")
            assert time.monotonic() - t0 < 5
            assert rest and ('"error"' in " ".join(rest) or rest[-1] == "connection broken"), rest[-3:]
            assert "data: [DONE]" not in rest or '"error"' in " ".join(rest)
        left = survivors(kids, within_s=5)
        assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_port_in_use_fails_fast_with_the_reason(tiny_model: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = _start(tiny_model, s.getsockname()[1])
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "stage tokenizer failed" in err and "Address already in use" in err


def test_stop_order_is_front_to_back_and_worker_rank_0_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 hosts the process group's TCPStore: the other workers go first, or their NCCL watchdogs print
    stack traces into the log when it disappears under them."""
    from types import SimpleNamespace

    from appliance.runtime import supervisor as sup

    stopped: list[str] = []
    monkeypatch.setattr(sup, "_terminate", lambda proc, grace: stopped.append(proc.name))
    stages = [sup.StageProc(n, k, r, SimpleNamespace(name=n)) for n, k, r in (
        ("worker0", "worker", 0), ("worker1", "worker", 1), ("scheduler", "scheduler", 0),
        ("worker2", "worker", 2), ("tokenizer", "tokenizer", 0))]
    fake = SimpleNamespace(stages=stages, grace_period=0.0)
    sup.Supervisor.stop(fake)  # type: ignore[arg-type]
    assert stopped == ["tokenizer", "scheduler", "worker2", "worker1", "worker0"]
