"""The scheduler's Executor: sends each StepPlan to every worker and waits for all their StepResults.

submit() sends a plan and collect() waits for its results, so in overlap mode the workers already hold plan N+1
in their sockets while they compute step N (they run plans in the order sent). Every rank runs the same plan (tensor parallelism keeps them in lock step) and samples the same tokens; rank 0's
result is used, the others' serve as a barrier and are checked to agree with it. A WorkerError is raised here
and takes the scheduler down (the supervisor then stops the pipeline and names the stage).
"""
from __future__ import annotations

from collections.abc import Callable

import zmq

from appliance.engine.step import Executor, StepPlan, StepResult
from appliance.runtime.addresses import Addresses
from appliance.runtime.messages import PLAN_CODEC, RESULT_CODEC, WorkerError
from appliance.runtime.topology import scheduler_binds


class WorkerFailed(RuntimeError):
    pass


class RemoteExecutor(Executor):
    def __init__(self, ctx: zmq.Context, addresses: Addresses, *, alive: Callable[[], bool] = lambda: True) -> None:
        self._plans = []
        for addr in addresses.plans:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr) if scheduler_binds(addr) else sock.connect(addr)  # tcp: workers on other nodes
            self._plans.append(sock)
        self._results = ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        self._results.bind(addresses.results)
        self._alive = alive
        self.num_malformed = 0
        self._early: dict[int, dict[int, StepResult]] = {}  # step id -> rank -> result collected ahead of time

    @property
    def world_size(self) -> int:
        return len(self._plans)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.submit(plan))

    def submit(self, plan: StepPlan) -> object:
        frame = PLAN_CODEC.encode(plan)
        for sock in self._plans:
            sock.send(frame)
        return plan.step_id

    def collect(self, handle: object) -> StepResult:
        if not isinstance(handle, int):
            raise TypeError(f"collect() got {type(handle).__name__}, not a step id from submit()")
        step_id = handle
        # a fast rank may already have answered the next step (overlap mode): keep those for its collect
        results = self._early.pop(step_id, {})
        while len(results) < self.world_size:
            if not self._results.poll(1000):
                if not self._alive():
                    raise WorkerFailed("a worker process (or the supervisor) is gone")
                continue
            parts = self._results.recv_multipart()  # [rank, frame]
            msg = RESULT_CODEC.decode_or_none(parts[-1]) if len(parts) == 2 else None
            rank = int(parts[0]) if msg is not None and parts[0].isdigit() else -1
            if msg is None or not 0 <= rank < self.world_size:
                self.num_malformed += 1
                continue
            if isinstance(msg, WorkerError):
                raise WorkerFailed(f"worker{msg.rank} failed in step {msg.step_id}: {msg.message}")
            if msg.step_id < step_id:
                continue  # an older step nobody waits for any more
            if msg.step_id > step_id:
                self._early.setdefault(msg.step_id, {})[rank] = msg
                continue
            results[rank] = msg
        _check_agreement(results)
        return results[0]

    def shutdown(self) -> None:
        for sock in self._plans:
            sock.close(0)
        self._results.close(0)


def _check_agreement(results: dict[int, StepResult]) -> None:
    """Tensor-parallel ranks see identical logits and keep identical sampler seeds, so they sample the same
    tokens, and each appends its own sample to its copy of the sequence; a disagreement would silently feed the
    ranks different inputs from the next step on, so it stops the pipeline instead."""
    if len(results) < 2:
        return
    first = [(t.request_id, t.token_id) for t in results[0].sampled]
    for rank, res in results.items():
        if rank and [(t.request_id, t.token_id) for t in res.sampled] != first:
            raise WorkerFailed(f"tensor-parallel ranks 0 and {rank} sampled different tokens in step "
                               f"{res.step_id}; their states would diverge")
