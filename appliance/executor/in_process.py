"""The executor that runs a ModelRunner in the calling process (offline LLM, tests, single-GPU)."""
from __future__ import annotations

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

    def shutdown(self) -> None:
        self.runner.requests.clear()
