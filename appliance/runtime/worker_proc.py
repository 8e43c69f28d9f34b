"""A worker process: one ModelRunner (one GPU, or the CPU), executing the scheduler's StepPlans in order.

With tp > 1 it is one rank of its replica's tensor-parallel group (torch.distributed from the environment the
supervisor sets, see executor/distributed.py); every rank gets every plan and runs it in lock step.

The worker binds its plan socket before reporting ready, so the scheduler (started after it) can connect at
once. A failing step is reported as WorkerError and ends the process: the supervisor then names this worker.
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import zmq

from appliance import fault_injection
from appliance.executor.startup import STARTUP, Progress, hold_for_test
from appliance.runtime.bootstrap import Bootstrap
from appliance.runtime.gc_heap import freeze_startup_heap
from appliance.runtime.messages import (
    CONTROL_CODEC,
    PLAN_CODEC,
    RESULT_CODEC,
    StageProgress,
    StageReady,
    WorkerError,
)
from appliance.runtime.process import parent_alive
from appliance.runtime.topology import scheduler_binds

if TYPE_CHECKING:
    from appliance.executor.model_runner import ModelRunner
    from appliance.executor.runner_protocol import ModelRunnerProtocol
    from appliance.engine.step import StepPlan
    from appliance.executor.inflight import StepHandle

log = logging.getLogger("appliance.worker")


def run_worker(boot: Bootstrap, build: Callable[[Bootstrap], ModelRunnerProtocol] | None = None) -> None:
    """Serve the scheduler's plans; build: the runner (default: build_runner, the ModelRunner)."""
    # the distributed environment of this rank, for the runner's process groups
    os.environ.setdefault("RANK", str(boot.rank))
    os.environ.setdefault("LOCAL_RANK", str(boot.rank))
    os.environ.setdefault("WORLD_SIZE", str(boot.world_size))
    ctx = zmq.Context()
    control = ctx.socket(zmq.PUSH)
    control.connect(boot.addresses.control)
    report_progress(boot, control)
    runner = (build or build_runner)(boot)
    config = runner.config
    from appliance.executor.distributed import min_over_ranks

    plans = ctx.socket(zmq.PULL)
    plan_addr = boot.addresses.plans[boot.rank]
    head = None  # on several nodes: watches the connection to the head's scheduler
    if scheduler_binds(plan_addr):
        if config.parallelism.node_rank > 0:  # on the head, the supervisor sees the scheduler itself
            head = HeadWatch(plans)
        plans.connect(plan_addr)
    else:
        plans.bind(plan_addr)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 1000)
    results.connect(boot.addresses.results)
    # every rank sized its own pool; the scheduler may use only what all of them have (ranks may be on other nodes)
    info = {"num_kv_blocks": min_over_ranks(runner.num_blocks),
            "num_host_blocks": min_over_ranks(runner.num_host_blocks),
            "num_disk_blocks": min_over_ranks(runner.num_disk_blocks), "eos_token_ids": list(runner.eos_token_ids),
            "max_model_len": runner.max_model_len, "block_size": runner.block_size, "device": str(runner.device),
            "vocab_size": int(getattr(runner.hf_config, "vocab_size", 0) or 0),
            "num_state_slots": runner.num_state_slots, "state_cache_bytes": runner.state_cache_bytes,
            "swap_costs": runner.swap_costs.to_dict() if runner.swap_costs is not None else None,
            # sliding-window KV cache groups (executor/window_groups.py): the same on every rank, pools sized per rank
            "window_sizes": list(runner.kv_layout.window_sizes),
            "window_blocks": [min_over_ranks(n) for n in runner.kv_layout.window_blocks]}
    hold_for_test()
    # a full collection's pass would stall the GPU (gc_heap.py)
    with STARTUP.phase("freezing the start-up heap"):
        info["gc_frozen_objects"] = freeze_startup_heap(f"worker {boot.rank}")
    STARTUP.finish()
    STARTUP.sink = None
    log.info("worker %d %s", boot.rank, STARTUP.breakdown())
    control.send(CONTROL_CODEC.encode(StageReady(boot.name, os.getpid(), info)))
    log.info("worker %d ready on %s: %d KV blocks", boot.rank, runner.device, runner.num_blocks)
    rank = str(boot.rank).encode()
    steps = StepLoop(runner, results, rank, boot.rank)
    while parent_alive(boot.parent_pid):
        if head is not None and head.lost():
            raise ConnectionError(f"lost the connection to the scheduler on the head node ({plan_addr})")
        if not steps.wait_for_plan(plans):
            continue
        plan = PLAN_CODEC.decode_or_none(plans.recv())
        if plan is None:
            log.warning("dropped a malformed plan frame (%d so far)", PLAN_CODEC.num_malformed)
            continue
        steps.run(plan)


def build_runner(boot: Bootstrap) -> ModelRunner:
    """The worker's start-up up to serving: its imports, the device and process group, the ModelRunner (each a
    phase of STARTUP; benchmarks/startup_imports.py times them in a fresh interpreter)."""
    with STARTUP.phase("imports"):
        config = boot.load_config()
        from appliance.executor.distributed import init_distributed
        from appliance.executor.model_runner import ModelRunner
        from appliance.layers.custom_all_reduce import AllReduceSettings
        from appliance.layers.parallel_state import init_expert_parallel

    # boot.rank / world_size: this worker's tensor-parallel rank within its data-parallel replica
    with STARTUP.phase("initialising the device and process group"):
        init_distributed(config.model.device, all_reduce=AllReduceSettings.from_config(config))
        init_expert_parallel(config.parallelism.enable_expert_parallel)  # ep = tp: experts split over the group
    return ModelRunner(config)


def report_progress(boot: Bootstrap, control: zmq.Socket) -> None:
    """Send each start-up phase and item to the supervisor (console, /health), counted from the spawn."""
    if boot.spawned_at:
        STARTUP.start_at(boot.spawned_at)
    pid = os.getpid()

    def send(p: Progress) -> None:
        msg = StageProgress(boot.name, pid, p.phase, p.done, p.total, round(p.elapsed_s, 3))
        try:
            control.send(CONTROL_CODEC.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # progress is best effort; readiness and failures are sent blocking

    STARTUP.sink = send


class StepLoop:
    """Launches each plan as it arrives and answers the step before it once this one is launched: in overlap
    mode the scheduler sends plan N+1 before it waits for step N, so the device runs N+1 right after N. A step
    with no successor is answered as soon as its sampled ids are on the host."""

    def __init__(self, runner: ModelRunnerProtocol, results: zmq.Socket, rank: bytes, rank_index: int) -> None:
        self.runner, self.results, self.rank, self.rank_index = runner, results, rank, rank_index
        self.previous: StepHandle | None = None  # the launched step not answered yet
        self.num_steps = 0
        self.faults = fault_injection.faults()  # APPLIANCE_FAULT_INJECTION, for the tests; None unless set

    def wait_for_plan(self, plans: zmq.Socket) -> bool:
        """Whether a plan is waiting; meanwhile answer the step in flight once its ids have arrived."""
        if self.previous is None:
            return bool(plans.poll(1000))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if plans.poll(0):
                return True
            event = self.previous.event
            if event is None or event.query():
                self._answer()
                return bool(plans.poll(1000))
            time.sleep(50e-6)
        return False

    def run(self, plan: StepPlan) -> None:
        if self.previous is not None and (self.previous.event is None or self.previous.event.query()):
            self._answer()  # its ids are here already (or the device computes synchronously, as a CPU does)
        self.num_steps += 1
        try:
            if self.faults is not None:
                self.faults.before_forward(self.num_steps)
            handle = self.runner.launch(plan)
        except Exception as exc:
            self._fail(plan.step_id, exc)
        self._answer()
        self.previous = handle
        if handle.done:
            self._answer()

    def _answer(self) -> None:
        handle, self.previous = self.previous, None
        if handle is None:
            return
        try:
            result = self.runner.finish(handle)
        except Exception as exc:
            self._fail(handle.step_id, exc)
        self.results.send_multipart([self.rank, RESULT_CODEC.encode(result)])

    def _fail(self, step_id: int, exc: Exception) -> NoReturn:
        log.error("step %d failed:\n%s", step_id, traceback.format_exc())
        self.results.send_multipart([self.rank, RESULT_CODEC.encode(WorkerError(step_id, self.rank_index, str(exc)))])
        raise exc


class HeadWatch:
    """Socket events of a plan socket that connects to the head node: a disconnect after a connect means the
    head's scheduler is gone (this node's supervisor cannot see the head's processes)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._events = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._connected = False

    def lost(self) -> bool:
        from zmq.utils.monitor import recv_monitor_message

        while self._events.poll(0):
            event = recv_monitor_message(self._events)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                return True
        return False
