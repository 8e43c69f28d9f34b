"""The supervisor: starts workers, then the scheduler, then the tokenizer (HTTP) process, each only after the
previous reported ready; watches them; stops them in order.

Shutdown: SIGINT/SIGTERM -> the tokenizer is told to drain, then every stage, front to back, gets SIGTERM and a
grace period before SIGKILL. Failure: a child that exits or reports StageFailed -> the tokenizer is told, so
requests in flight end with an error, the rest is stopped and `run` returns 1 with a message naming the stage.
Only the supervisor's own children are signalled and reaped.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from appliance.runtime.addresses import Addresses, remove_dir
from appliance.runtime.bootstrap import Bootstrap
from appliance.runtime.messages import (
    CONTROL_CODEC,
    FRONTEND_CODEC,
    PipelineState,
    StageFailed,
    StageReady,
)

log = logging.getLogger("appliance.runtime")


class StageError(RuntimeError):
    """A stage failed to start or died; the message names it."""


@dataclass
class StageProc:
    name: str
    kind: str
    rank: int
    proc: subprocess.Popen
    info: dict[str, Any] = field(default_factory=dict)


def num_workers(config: Any) -> int:
    """One worker per GPU of the tensor/data-parallel world; one CPU worker without a GPU."""
    par = config.parallelism
    world = getattr(par, "world_size", None) or (getattr(par, "tp", 1) or 1) * (getattr(par, "dp", 1) or 1)
    device = getattr(config.model, "device", "auto")
    if device == "cpu":
        return 1
    try:  # the supervisor must not initialise CUDA itself (children could not fork-share it anyway)
        has_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        has_gpu = False
    return max(1, int(world)) if has_gpu or device == "cuda" else 1


class Supervisor:
    def __init__(self, config: Any, *, ready_timeout: float = 900.0, grace_period: float = 5.0) -> None:
        self.config = config
        self.ready_timeout = ready_timeout
        self.grace_period = grace_period
        self.stages: list[StageProc] = []
        self._stop_signal: int | None = None
        self._ctx = zmq.Context()
        self.addresses, self._dir = Addresses.in_new_dir(num_workers(config))
        self._control = self._ctx.socket(zmq.PULL)
        self._control.bind(self.addresses.control)
        self._frontend = self._ctx.socket(zmq.PUSH)
        self._frontend.setsockopt(zmq.LINGER, 0)
        self._frontend.setsockopt(zmq.SNDTIMEO, 200)
        self._frontend.bind(self.addresses.frontend)

    # -- public --------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Start, serve until a signal or a failure, stop. Returns the process exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self.start()
                log.info("appliance ready on http://%s:%s", self.config.api.host, self.port)
                failure = self.monitor()
            except StageError as exc:
                failure = str(exc)
            if failure is not None:
                print(f"appliance: {failure}; stopping", file=sys.stderr, flush=True)
                self._tell_frontend(PipelineState("failed", failure))
                self.stop()
                return 1
            self._tell_frontend(PipelineState("draining", "shutting down"))
            self.stop()
            return 0
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.close()

    @property
    def port(self) -> int:
        for st in self.stages:
            if st.kind == "tokenizer":
                return int(st.info.get("port", self.config.api.port))
        return int(self.config.api.port)

    def start(self) -> None:
        """All stages are spawned at once (they warm up in parallel); each is released only when the stages
        before it are ready, so readiness follows the pipeline order: workers, scheduler, tokenizer."""
        n = len(self.addresses.plans)
        workers = [self._spawn("worker", f"worker{r}", r, n) for r in range(n)]
        sched = self._spawn("scheduler", "scheduler", 0, n)
        tok = self._spawn("tokenizer", "tokenizer", 0, n)
        peers: dict[str, dict[str, Any]] = {}
        for st in workers:
            self._release(st, peers)
        for st in workers:
            self._await_ready(st)
            peers[st.name] = st.info
        self._release(sched, peers)
        self._await_ready(sched)
        peers["scheduler"] = sched.info
        self._release(tok, peers)
        self._await_ready(tok)

    def monitor(self) -> str | None:
        """Block until a stop signal (returns None) or a failure (returns its message)."""
        while self._stop_signal is None:
            failure = self._poll_failure(timeout_ms=100)
            if failure is not None:
                return failure
        log.info("received %s, stopping", signal.Signals(self._stop_signal).name)
        return None

    def stop(self) -> None:
        """Front to back: tokenizer, scheduler, workers. SIGTERM, grace period, SIGKILL; reap each."""
        for st in sorted(self.stages, key=lambda s: {"tokenizer": 0, "scheduler": 1}.get(s.kind, 2)):
            _terminate(st.proc, self.grace_period)

    def close(self) -> None:
        for st in self.stages:  # never leave a child behind, whatever path got us here
            if st.proc.poll() is None:
                _terminate(st.proc, 0.5)
        self._control.close(0)
        self._frontend.close(0)
        self._ctx.term()
        remove_dir(self._dir)

    # -- internals -----------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop waiting for graceful exits
        self._stop_signal = signum

    def _spawn(self, kind: str, name: str, rank: int, world: int) -> StageProc:
        boot = Bootstrap(kind, name, rank, world, os.getpid(), self.addresses, self.config.to_dict())
        proc = subprocess.Popen(
            [sys.executable, "-m", "appliance.runtime.stage", name],  # the name is for `ps` only
            stdin=subprocess.PIPE, text=True, process_group=0, close_fds=True,
        )
        assert proc.stdin is not None
        proc.stdin.write(boot.dumps())
        proc.stdin.flush()
        st = StageProc(name, kind, rank, proc)
        self.stages.append(st)
        log.debug("started %s (pid %d)", name, proc.pid)
        return st

    def _release(self, st: StageProc, peers: dict[str, dict[str, Any]]) -> None:
        assert st.proc.stdin is not None
        try:
            st.proc.stdin.write(json.dumps(peers) + "\n")
            st.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # it died; _await_ready reports it

    def _await_ready(self, st: StageProc) -> None:
        started = time.monotonic()
        deadline = started + self.ready_timeout
        while not st.info:
            if self._stop_signal is not None:
                raise StageError(f"interrupted while {st.name} was starting")
            if time.monotonic() > deadline:
                raise StageError(f"stage {st.name} not ready after {self.ready_timeout:.0f} s")
            failure = self._poll_failure(timeout_ms=100)
            if failure is not None:
                raise StageError(failure)
        log.info("stage %s ready (pid %d, %.1f s)", st.name, st.proc.pid, time.monotonic() - started)

    def _poll_failure(self, timeout_ms: int) -> str | None:
        if self._control.poll(timeout_ms):
            while True:
                try:
                    frame = self._control.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = CONTROL_CODEC.decode_or_none(frame)
                if isinstance(msg, StageFailed):
                    return f"stage {msg.stage} failed: {msg.message}"
                if isinstance(msg, StageReady):
                    for st in self.stages:
                        if st.name == msg.stage and st.proc.pid == msg.pid:
                            st.info = dict(msg.info) or {"ready": True}
        for st in self.stages:
            code = st.proc.poll()
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
                return f"stage {st.name} (pid {st.proc.pid}) exited with {how}"
        return None

    def _tell_frontend(self, state: PipelineState) -> None:
        try:
            self._frontend.send(FRONTEND_CODEC.encode(state), zmq.NOBLOCK)
            time.sleep(0.2)  # let in-flight requests receive their error before the tokenizer is stopped
        except zmq.ZMQError:
            pass


def _terminate(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass
