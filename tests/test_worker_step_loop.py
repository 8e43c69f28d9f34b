"""The worker process's StepLoop (runtime/worker_proc.py): a step whose ids are still on their way is answered
after the next plan is launched (the device runs the two back to back), a step whose ids are already here (or
that ran synchronously, as on a CPU) is answered before the next launch, and answers keep the steps' order."""
from __future__ import annotations

from dataclasses import dataclass, field

from appliance.engine.step import StepPlan, StepResult
from appliance.executor.inflight import StepHandle
from appliance.runtime.messages import RESULT_CODEC
from appliance.runtime.worker_proc import StepLoop


class _Event:
    def __init__(self) -> None:
        self.arrived = False

    def query(self) -> bool:
        return self.arrived


@dataclass
class _Runner:
    """Launches leave the step unfinished with an event the test sets; finish() completes it."""

    deferred: bool
    with_event: bool = True  # False: deferred on a CPU, where the ids are there when launch returns
    calls: list[tuple[str, int]] = field(default_factory=list)

    def launch(self, plan: StepPlan) -> StepHandle:
        self.calls.append(("launch", plan.step_id))
        if not self.deferred:
            return StepHandle(plan.step_id, StepResult(plan.step_id))
        handle = StepHandle(plan.step_id)
        if self.with_event:
            handle.event = _Event()  # type: ignore[assignment]
        return handle

    def finish(self, handle: StepHandle) -> StepResult:
        self.calls.append(("finish", handle.step_id))
        handle.result = StepResult(handle.step_id)
        return handle.result


class _Sock:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sent.append(RESULT_CODEC.decode(frames[1]).step_id)


def test_a_step_in_flight_is_answered_after_the_next_launch() -> None:
    runner, sock = _Runner(deferred=True), _Sock()
    loop = StepLoop(runner, sock, b"0", 0)
    loop.run(StepPlan(0))
    loop.run(StepPlan(1))  # step 0's ids have not arrived: launch 1 first, then answer 0
    assert runner.calls == [("launch", 0), ("launch", 1), ("finish", 0)] and sock.sent == [0]
    loop.previous.event.arrived = True
    loop.run(StepPlan(2))  # step 1's ids are here: answer it before launching 2
    assert runner.calls[3:] == [("finish", 1), ("launch", 2)] and sock.sent == [0, 1]


def test_steps_computed_by_launch_are_answered_before_the_next_launch() -> None:
    # a CPU computes inside launch(): holding step N's answer until N+1 is computed would pair the tokens
    runner, sock = _Runner(deferred=True, with_event=False), _Sock()
    loop = StepLoop(runner, sock, b"0", 0)
    for step in range(3):
        loop.run(StepPlan(step))
    assert runner.calls == [("launch", 0), ("finish", 0), ("launch", 1), ("finish", 1), ("launch", 2)]
    assert sock.sent == [0, 1]
