"""The executor that runs a ModelRunner in the calling process (offline LLM, tests, single-GPU).

With scheduler.enable_overlap, submit() hands the step to one worker thread and collect() waits for it, so the
engine plans step N+1 and applies step N's result while the thread builds and runs step N (its waits on the
device release the GIL). One thread keeps the steps in submission order, and only it touches the runner while
steps are in flight.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from appliance.engine.step import Executor, StepPlan, StepResult
from appliance.executor.model_runner import ModelRunner


class InProcessExecutor(Executor):
    def __init__(self, config: Any) -> None:
        p = config.parallelism
        if p.tp * p.dp > 1:
            raise ValueError(f"the in-process executor runs one worker; tp={p.tp} dp={p.dp} needs the runtime's "
                             "multi-process executor")
        self.runner = ModelRunner(config)
        self._thread: ThreadPoolExecutor | None = None

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def eos_token_ids(self) -> list[int]:
        return self.runner.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def hf_config(self) -> Any:
        return self.runner.hf_config

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def submit(self, plan: StepPlan) -> object:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="appliance-step")
        # self.execute, not the runner's: a wrapper installed on execute (benchmarks time it) still sees each step
        return self._thread.submit(self.execute, plan)

    def collect(self, handle: object) -> StepResult:
        if not isinstance(handle, Future):
            raise TypeError(f"collect() got {type(handle).__name__}, not a handle of this executor's submit()")
        return handle.result()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self.runner.requests.clear()
