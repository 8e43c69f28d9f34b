"""The supervisor: starts workers, then the scheduler, then the tokenizer (HTTP) process, each only after the
previous reported ready; watches them; stops them in order.

Shutdown: SIGINT/SIGTERM -> the tokenizer is told to drain, then every stage, front to back, gets SIGTERM and a
grace period before SIGKILL. Failure: a child that exits or reports StageFailed -> the tokenizer is told, so
requests in flight end with an error, the rest is stopped and `run` returns 1 with a message naming the stage.
Only the supervisor's own children are signalled and reaped.

Parallelism (runtime/topology.py): tp x dp workers, one per rank; each data-parallel replica has its own
scheduler and tensor-parallel group; the one tokenizer process routes requests across the replicas.
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
from typing import TYPE_CHECKING, Any

import zmq

from appliance.runtime.addresses import Addresses, remove_dir
from appliance.runtime.bootstrap import Bootstrap
from appliance.runtime.messages import (
    CONTROL_CODEC,
    FRONTEND_CODEC,
    PipelineState,
    StageFailed,
    StageProgress,
    StageReady,
)
from appliance.runtime.startup_progress import ProgressBoard
from appliance.runtime.topology import Topology, replica_peers

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

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


class Supervisor:
    def __init__(self, config: ApplianceConfig, *, ready_timeout: float = 900.0,
                 grace_period: float | None = None) -> None:
        self.config = config
        self.ready_timeout = ready_timeout
        # api.shutdown_grace_period: how long the HTTP process may drain open requests after SIGTERM
        self.grace_period = float(config.api.shutdown_grace_period if grace_period is None else grace_period)
        self.stages: list[StageProc] = []
        self._stop_signal: int | None = None
        self._ctx = zmq.Context()
        self.topology = Topology.from_config(config)
        self.addresses, self._dir = Addresses.in_new_dir(self.topology.num_workers)
        self._control = self._ctx.socket(zmq.PULL)
        self._control.bind(self.addresses.control)
        self._frontend = self._ctx.socket(zmq.PUSH)
        self._frontend.setsockopt(zmq.LINGER, 0)
        self._frontend.setsockopt(zmq.SNDTIMEO, 200)
        self._frontend.bind(self.addresses.frontend)
        self._progress = self._ctx.socket(zmq.PUB)  # start-up phases for the HTTP process' /health
        self._progress.setsockopt(zmq.LINGER, 0)
        self._progress.bind(self.addresses.progress)
        self.board = ProgressBoard(self._progress)

    # -- public --------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Start, serve until a signal or a failure, stop. Returns the process exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self.start()
                if self.topology.is_head:
                    log.info("appliance ready on http://%s:%s", self.config.api.host, self.port)
                else:
                    log.info("node %d ready: its workers joined the head's groups", self.topology.node_rank)
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
        topo = self.topology
        groups: list[list[StageProc]] = []  # the workers of each data-parallel replica, in tp-rank order
        scheds: list[StageProc] = []
        for d in range(topo.dp):
            addrs, port = topo.replica_addresses(self.addresses, d), topo.master_port(d)
            groups.append([self._spawn("worker", w.name, w.tp_rank, topo.tp, addrs, topo.worker_env(w, port))
                           for w in topo.local_workers(d)])
        if not topo.is_head:  # a worker-only node: its ranks join the head's groups; nothing else runs here
            for st in (w for g in groups for w in g):
                self._release(st, {})
            for st in (w for g in groups for w in g):
                self._await_ready(st)
            return
        for d in range(topo.dp):
            scheds.append(self._spawn("scheduler", topo.scheduler_name(d), d, topo.dp,
                                      topo.replica_addresses(self.addresses, d)))
        tok = self._spawn("tokenizer", "tokenizer", 0, topo.dp)
        for st in (w for g in groups for w in g):
            self._release(st, {})
        for st in (w for g in groups for w in g):
            self._await_ready(st)
        peers: dict[str, dict[str, Any]] = {}
        for group, sched in zip(groups, scheds):
            # a scheduler sees its own replica's workers, under the single-replica names
            self._release(sched, {"worker0": replica_peers([w.info for w in group])})
        for d, sched in enumerate(scheds):
            self._await_ready(sched)
            peers[topo.scheduler_name(d)] = sched.info
        peers["worker0"] = replica_peers([w.info for w in groups[0]])
        peers["scheduler"] = scheds[0].info
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
        """Front to back: tokenizer, scheduler, workers (highest rank first: rank 0 hosts the process group's
        TCPStore, and the other ranks' NCCL watchdogs print stack traces when it goes before them). SIGTERM,
        grace period, SIGKILL; reap each."""
        order = {"tokenizer": 0, "scheduler": 1}
        for st in sorted(self.stages, key=lambda s: (order.get(s.kind, 2), -s.rank if s.kind == "worker" else 0)):
            # the tokenizer drains for grace_period itself; the slack covers its own shut-down after that
            _terminate(st.proc, self.grace_period + 3.0 if st.kind == "tokenizer" else 5.0)

    def close(self) -> None:
        for st in self.stages:  # never leave a child behind, whatever path got us here
            if st.proc.poll() is None:
                _terminate(st.proc, 0.5)
        self._control.close(0)
        self._frontend.close(0)
        self._progress.close(0)
        self._ctx.term()
        remove_dir(self._dir)

    # -- internals -----------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop waiting for graceful exits
        self._stop_signal = signum

    def _spawn(self, kind: str, name: str, rank: int, world: int, addresses: Addresses | None = None,
               env: dict[str, str] | None = None) -> StageProc:
        boot = Bootstrap(kind, name, rank, world, os.getpid(), addresses or self.addresses, self.config.to_dict(),
                         spawned_at=time.time())
        proc = subprocess.Popen(
            self.stage_argv(kind, name),
            stdin=subprocess.PIPE, text=True, process_group=0, close_fds=True,
            env={**os.environ, **env} if env else None,
        )
        assert proc.stdin is not None
        proc.stdin.write(boot.dumps())
        proc.stdin.flush()
        st = StageProc(name, kind, rank, proc)
        self.stages.append(st)
        log.debug("started %s (pid %d)", name, proc.pid)
        return st

    def stage_argv(self, kind: str, name: str) -> list[str]:
        """The command line of a child stage (the name is for `ps` only). benchmarks/host_path.py runs its
        stages through a stand-in entry point that times them and replaces the model worker."""
        return [sys.executable, "-m", "appliance.runtime.stage", name]

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
            self.board.tick()
        self.board.ready(st.name, st.proc.pid)
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
                    if msg.dump_stacks:
                        self._dump_stacks()
                    return f"stage {msg.stage} failed: {msg.message}"
                if isinstance(msg, StageProgress):
                    self.board.update(msg)
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

    def _dump_stacks(self) -> None:
        """Every live stage writes its Python stacks to stderr (faulthandler on SIGUSR1, runtime/stage.py)."""
        for st in self.stages:
            if st.proc.poll() is None:
                try:
                    os.kill(st.proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)  # faulthandler writes from a signal handler, at once; let it land before the SIGTERMs

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
