"""Start and stop the REAL pipeline (`appliance run` / `appliance serve`: a supervisor subprocess with its stage
processes) for the end-to-end tests: a free port, the wait for /health, the supervisor's stage children, and a
stop that checks no stage outlived it. A plain module the tests import (not a conftest)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import httpx

# the tests import these from here too
from appliance.runtime.process import alive, stage_children
from appliance.runtime.topology import free_port  # noqa: F401


def start_run(cfg_path: Path, **popen: Any) -> subprocess.Popen:
    """`appliance run <cfg_path>` as a subprocess, one torch thread per stage (the CI machine has 2 cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "appliance.cli.main", "run", str(cfg_path)], env=env, **popen)


def _captured_output(proc: subprocess.Popen) -> str:
    stream = proc.stdout or proc.stderr
    return stream.read() if stream else ""


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 120.0, probe_timeout_s: float = 1.0) -> None:
    """Returns once GET {base}/health answers 200; fails if the supervisor exits first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, \
            f"the supervisor exited during start-up with {proc.returncode}:\n{_captured_output(proc)}"
        try:
            if httpx.get(f"{base}/health", timeout=probe_timeout_s).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready in {timeout_s} s"
        time.sleep(0.2)


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM (if still running), 30 s to exit, then SIGKILL: for teardown that asserts nothing."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Running(Protocol):
    proc: subprocess.Popen
    stages: dict[int, str]


class Server:
    """A ready pipeline: its supervisor process, base URL and stage children (taken once it answered /health);
    headers (an api key) go with its own requests."""

    def __init__(self, proc: subprocess.Popen, port: int, headers: dict[str, str] | None = None) -> None:
        self.proc = proc
        self.base = f"http://127.0.0.1:{port}"
        self.stages = stage_children(proc.pid)
        self.headers = headers or {}

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.base}/v1/internal/stats", headers=self.headers, timeout=10).json()

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s["num_running"], s["num_waiting"], s["kv_blocks_owned"]) == (0, 0, 0) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)


def launch(config_toml: str, port: int, timeout: float = 120.0, cfg_path: Path | None = None,
           headers: dict[str, str] | None = None, **popen: Any) -> Server:
    """Start `appliance run` on a config file's text (written to cfg_path, or a fresh temp dir); returns once
    /health answers 200. headers: for the Server's own requests (the config's api key)."""
    cfg = cfg_path or Path(tempfile.mkdtemp(prefix="appl-")) / "serve.toml"
    cfg.write_text(config_toml)
    proc = start_run(cfg, **popen)
    wait_healthy(proc, f"http://127.0.0.1:{port}", timeout)
    return Server(proc, port, headers)


def stop(srv: Running, expect_clean_exit: bool = True) -> int:
    """SIGTERM a supervisor that still runs (and, with expect_clean_exit, assert it exits 0 within 30 s), then
    assert no stage outlived it. A supervisor that already ended (a test killed a stage) is only reaped."""
    signalled = srv.proc.poll() is None
    if signalled:
        srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(timeout=30)
    if signalled and expect_clean_exit:
        assert code == 0, f"the supervisor exited with {code} on SIGTERM"
    assert not [n for pid, n in srv.stages.items() if alive(pid)], "a stage outlived the supervisor"
    return code


def kill_stage(srv: Running, name: str) -> float:
    """SIGKILL the stage called name; returns the monotonic time of the kill."""
    os.kill(next(pid for pid, n in srv.stages.items() if n == name), signal.SIGKILL)
    return time.monotonic()


def survivors(stages: dict[int, str], within_s: float) -> dict[int, str]:
    """The stages still alive after waiting up to within_s for all of them to exit (they exit asynchronously
    once their supervisor or a peer died)."""
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in stages) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {pid: name for pid, name in stages.items() if alive(pid)}


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets a process holds open (its /proc fd links read "socket:[inode]")."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def unix_socket_of(pid: int, name: str) -> str:
    """The ipc:// endpoint a process bound whose path ends with /name (from /proc/net/unix)."""
    inodes = socket_inodes(pid)
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes and parts[7].endswith("/" + name):
                return "ipc://" + parts[7]
    raise AssertionError(f"no socket */{name} bound by {pid}")
