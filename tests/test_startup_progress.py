"""Start-up progress: the worker's phases (executor/startup.py), the supervisor's board (console lines, the frame
for the HTTP process), /health answering 503 with that progress until the pipeline is ready and 200 after, and
the persistent compile cache (cache.compile_cache_dir) pointed at before anything compiles."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pipeline_server import free_port, terminate, wait_healthy

from appliance.executor.compile_cache import use_compile_cache
from appliance.executor.startup import HOLD_ENV, StartupLog
from appliance.runtime.messages import PROGRESS_CODEC, StageProgress, StartupProgress
from appliance.runtime.startup_progress import ProgressBoard, progress_body


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_count_items_and_add_up_in_the_breakdown() -> None:
    clock, seen = Clock(), []
    log = StartupLog(clock)
    log.sink = seen.append
    clock.now += 2.0  # before the first phase: "process start"
    with log.phase("loading weights"):
        clock.now += 3.0
    log.enter("capturing decode graphs", total=3)
    for _ in range(3):
        clock.now += 0.5
        log.advance()
    clock.now += 1.0
    assert log.finish() == pytest.approx(7.5)
    clock.now += 0.5  # between phases: "other"
    assert log.took == {"process start": pytest.approx(2.0), "loading weights": pytest.approx(3.0),
                        "capturing decode graphs": pytest.approx(2.5)}
    assert [(p.phase, p.done, p.total) for p in seen] == [
        ("loading weights", 0, 0), ("capturing decode graphs", 0, 3), ("capturing decode graphs", 1, 3),
        ("capturing decode graphs", 2, 3), ("capturing decode graphs", 3, 3)]
    assert seen[-1].elapsed_s == pytest.approx(6.5)
    assert log.breakdown() == ("start-up 8.0 s: process start 2.0 s, loading weights 3.0 s, "
                               "capturing decode graphs 2.5 s, other 0.5 s")


def test_elapsed_counts_from_the_spawn() -> None:
    log = StartupLog()
    log.start_at(time.time() - 5.0)
    assert 5.0 <= log.elapsed() < 6.0


def test_the_board_logs_phase_changes_and_throttles_items(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    board = ProgressBoard(None, log_interval_s=2.0, clock=clock)
    caplog.set_level(logging.INFO, logger="appliance.runtime")
    board.update(StageProgress("worker0", 1, "capturing decode graphs", 0, 140, 50.0))
    for i in range(1, 40):  # 39 items within 1.9 s: no line until the interval passes
        clock.now += 0.05
        board.update(StageProgress("worker0", 1, "capturing decode graphs", i, 140, 50.0 + i * 0.05))
    clock.now += 0.2
    board.update(StageProgress("worker0", 1, "capturing decode graphs", 40, 140, 52.2))
    board.update(StageProgress("worker0", 1, "capturing piecewise buckets", 0, 40, 52.3))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["worker0: capturing decode graphs 0/140 (50.0 s)",
                     "worker0: capturing decode graphs 40/140 (52.2 s)",
                     "worker0: capturing piecewise buckets 0/40 (52.3 s)"]
    frame = PROGRESS_CODEC.decode(PROGRESS_CODEC.encode(board.frame()))
    assert [(p.stage, p.phase, p.done, p.total) for p in frame.stages] == [
        ("worker0", "capturing piecewise buckets", 0, 40)]
    board.ready("worker0", 1)
    assert board.frame().stages[0].phase == "ready"


def test_the_health_body_names_every_stage_phase() -> None:
    body = progress_body(StartupProgress([StageProgress("worker0", 7, "capturing decode graphs", 37, 140, 52.34),
                                          StageProgress("worker1", 8, "loading weights", 0, 0, 3.0)], 53.0))
    assert body == {"status": "starting", "elapsed_s": 53.0,
                    "message": "worker0: capturing decode graphs 37/140 (52.3 s); worker1: loading weights (3.0 s)",
                    "stages": {"worker0": {"phase": "capturing decode graphs", "done": 37, "total": 140,
                                           "elapsed_s": 52.34},
                               "worker1": {"phase": "loading weights", "done": 0, "total": 0, "elapsed_s": 3.0}}}
    assert progress_body(None)["message"] == "the server is starting"


def test_the_compile_cache_points_triton_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    got = use_compile_cache(str(tmp_path / "cc"))
    assert got == {"TRITON_CACHE_DIR": str(tmp_path / "cc" / "triton"),
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cc" / "inductor")}
    assert all(Path(p).is_dir() for p in got.values())
    from triton import knobs

    assert knobs.cache.dir == str(tmp_path / "cc" / "triton")  # read when a kernel compiles


def test_an_unusable_compile_cache_dir_is_an_error_naming_the_setting(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cache.compile_cache_dir"):
        use_compile_cache(str(tmp_path / "file"))


def test_the_runner_reports_its_phases_and_the_warm_up_counts_items(tiny_model: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the constructor runs no warm-up (no graphs); run it directly: every phase is reported in order,
    and a phase with items ends with all of them done."""
    from appliance.config import build_config
    from appliance.executor.model_runner import ModelRunner
    from appliance.executor.startup import STARTUP

    seen: list = []
    monkeypatch.setattr(STARTUP, "sink", seen.append)
    runner = ModelRunner(build_config(flat=dict(model=str(tiny_model), max_num_seqs=5, max_total_tokens=256), env={}))
    runner.warmup()
    phases = list(dict.fromkeys(p.phase for p in seen))
    assert phases == ["reading the model config", "building the model", "loading weights", "profiling memory",
                      "allocating the KV cache",
                      "compiling prefill kernels", "compiling the sampler", "warming the LM head",
                      "capturing decode graphs", "capturing piecewise buckets", "warm-up steps"]
    prefills = [p for p in seen if p.phase == "compiling prefill kernels"]
    assert [(p.done, p.total) for p in prefills] == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]  # 1, 2, 4, 5 seqs
    assert set(phases) <= set(STARTUP.took)


@pytest.mark.slow
def test_health_is_503_with_progress_until_ready_then_200(tmp_path: Path) -> None:
    """The embedded default model, held in its last start-up phase by the test hook: /health answers 503 with
    the worker's phase in its body, the supervisor's console names the phases, the worker's compile caches point
    under cache.compile_cache_dir; once released, /health is 200 and the worker logged its start-up breakdown."""
    port, hold, cache = free_port(), tmp_path / "hold", tmp_path / "compile-cache"
    hold.write_text("")
    env = {**os.environ, "OMP_NUM_THREADS": "1", HOLD_ENV: str(hold)}
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli.main", "run", "--set", f"api.port={port}",
                             "--set", f"cache.compile_cache_dir={cache}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, body = time.monotonic() + 120, {}
        while "worker0" not in body.get("stages", {}) or not body["stages"]["worker0"]["phase"].startswith("held"):
            assert proc.poll() is None and time.monotonic() < deadline, body
            try:
                r = httpx.get(f"{base}/health", timeout=2)
                assert r.status_code == 503, r.text
                body = r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert body["status"] == "starting" and f"worker0: held by {HOLD_ENV}" in body["message"]
        assert body["stages"]["worker0"]["elapsed_s"] > 0
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=2)
        assert r.status_code == 503 and "held by" in r.json()["error"]["message"]
        assert (cache / "triton").is_dir() and (cache / "inductor").is_dir()  # made by the worker
        hold.unlink()
        wait_healthy(proc, base, 60)
        assert httpx.get(f"{base}/health", timeout=2).status_code == 200
    finally:
        terminate(proc)
    out = proc.stdout.read() if proc.stdout else ""
    for line in (f"TRITON_CACHE_DIR={cache / 'triton'}", "worker0: imports", "worker0: reading the model config",
                 "worker0: building the model", "worker0: allocating the KV cache",
                 f"worker0: held by {HOLD_ENV}", "worker 0 start-up "):
        assert line in out, out
