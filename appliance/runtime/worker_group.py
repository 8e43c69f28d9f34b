"""The offline LLM's executor for tp > 1: the pipeline's own worker processes, driven from the calling process.

`LLM(model=..., tensor_parallel_size=2)` spawns one `appliance.runtime.stage` worker per rank (the same
Bootstrap, environment and sockets the supervisor gives them), waits until every rank reports ready, then sends
each StepPlan through a RemoteExecutor. The workers die with this process (PR_SET_PDEATHSIG) and are stopped
by `shutdown()`. One replica on one node: dp and nnodes belong to `appliance run`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import zmq

from appliance.engine.step import Executor, StepPlan, StepResult
from appliance.engine.swap import SwapCosts
from appliance.runtime.addresses import Addresses, remove_dir
from appliance.runtime.bootstrap import Bootstrap
from appliance.runtime.messages import CONTROL_CODEC, StageFailed, StageProgress, StageReady
from appliance.runtime.remote_executor import RemoteExecutor
from appliance.runtime.startup_progress import ProgressBoard
from appliance.runtime.topology import Topology, replica_peers, window_groups_of

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig


class WorkerGroupExecutor(Executor):
    def __init__(self, config: ApplianceConfig, *, ready_timeout: float = 900.0) -> None:
        topo = Topology.from_config(config)
        if topo.dp != 1 or topo.nnodes != 1:
            raise ValueError(f"the offline LLM runs one tensor-parallel group on one node (dp={topo.dp}, "
                             f"nnodes={topo.nnodes}); serve with `appliance run` for data parallelism or nodes")
        self._ctx = zmq.Context()
        self.addresses, self._dir = Addresses.in_new_dir(topo.tp)
        self._control = self._ctx.socket(zmq.PULL)
        self._control.bind(self.addresses.control)
        self._procs: list[subprocess.Popen] = []
        self._remote: RemoteExecutor | None = None
        try:
            port = topo.master_port(0)
            for w in topo.workers(0):
                self._spawn(Bootstrap("worker", w.name, w.tp_rank, topo.tp, os.getpid(), self.addresses,
                                      config.to_dict(), spawned_at=time.time()), topo.worker_env(w, port))
            info = replica_peers(self._await_ready(ready_timeout))
            self.num_blocks = int(info["num_kv_blocks"])
            self.num_host_blocks = int(info.get("num_host_blocks", 0))
            self.eos_token_ids = [int(t) for t in info.get("eos_token_ids", [])]
            self.max_model_len = int(info["max_model_len"])
            self.num_state_slots = int(info.get("num_state_slots", 0))
            self.state_cache_bytes = int(info.get("state_cache_bytes", 0))
            self.swap_costs = SwapCosts.from_dict(info.get("swap_costs"))
            self.num_disk_blocks = int(info.get("num_disk_blocks", 0))
            self.window_groups = window_groups_of(info)
            self._remote = RemoteExecutor(self._ctx, self.addresses, alive=self._all_alive)
        except BaseException:
            self.shutdown()
            raise

    def execute(self, plan: StepPlan) -> StepResult:
        assert self._remote is not None
        return self._remote.execute(plan)

    def submit(self, plan: StepPlan) -> object:
        assert self._remote is not None
        return self._remote.submit(plan)

    def collect(self, handle: object) -> StepResult:
        assert self._remote is not None
        return self._remote.collect(handle)

    def shutdown(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        if self._remote is not None:
            self._remote.shutdown()
            self._remote = None
        if not self._control.closed:
            self._control.close(0)
            self._ctx.term()
            remove_dir(self._dir)

    def _spawn(self, boot: Bootstrap, env: dict[str, str]) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "appliance.runtime.stage", boot.name], stdin=subprocess.PIPE,
                                text=True, process_group=0, close_fds=True, env={**os.environ, **env})
        self._procs.append(proc)
        assert proc.stdin is not None
        proc.stdin.write(boot.dumps() + json.dumps({}) + "\n")  # no earlier stages to wait for
        proc.stdin.close()

    def _await_ready(self, timeout: float) -> list[dict[str, Any]]:
        infos: dict[int, dict[str, Any]] = {}
        board = ProgressBoard(None)  # the workers' start-up phases on the console
        deadline = time.monotonic() + timeout
        while len(infos) < len(self._procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers not ready after {timeout:.0f} s")
            if self._control.poll(100):
                msg = CONTROL_CODEC.decode_or_none(self._control.recv())
                if isinstance(msg, StageFailed):
                    raise RuntimeError(f"{msg.stage} failed: {msg.message}")
                if isinstance(msg, StageProgress):
                    board.update(msg)
                if isinstance(msg, StageReady):
                    for i, p in enumerate(self._procs):
                        if p.pid == msg.pid:
                            infos[i] = dict(msg.info)
            for i, p in enumerate(self._procs):
                if p.poll() is not None:
                    raise RuntimeError(f"tensor-parallel worker {i} exited with code {p.returncode} while starting")
        return [infos[i] for i in range(len(self._procs))]

    def _all_alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)
