"""The executor that runs a ModelRunner in the calling process (offline LLM, tests, single-GPU).

With scheduler.enable_overlap, submit() launches the step on the device and returns at once (the runner leaves
its sampled ids on the device, executor/inflight.py); collect() waits for them. The engine therefore plans step
N+1 and launches it before it collects step N, and the device never waits for the host between the two.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.engine.step import Executor, StepPlan, StepResult
from appliance.executor.inflight import StepHandle
from appliance.executor.model_runner import ModelRunner

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig
    from appliance.engine.swap import SwapCosts
    from transformers import PretrainedConfig


class InProcessExecutor(Executor):
    def __init__(self, config: ApplianceConfig) -> None:
        p = config.parallelism
        if p.tp * p.dp > 1:
            raise ValueError(f"the in-process executor runs one worker; tp={p.tp} dp={p.dp} needs the runtime's "
                             "multi-process executor")
        self.runner = ModelRunner(config)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def window_groups(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The sliding-window KV cache groups' windows and pool sizes (executor/window_groups.py)."""
        return self.runner.kv_layout.window_sizes, self.runner.kv_layout.window_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.runner.num_host_blocks

    @property
    def num_disk_blocks(self) -> int:
        return self.runner.num_disk_blocks

    @property
    def swap_costs(self) -> SwapCosts | None:
        return self.runner.swap_costs

    @property
    def num_state_slots(self) -> int:
        return self.runner.num_state_slots

    @property
    def state_cache_bytes(self) -> int:
        return self.runner.state_cache_bytes

    @property
    def eos_token_ids(self) -> list[int]:
        return self.runner.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def hf_config(self) -> PretrainedConfig:
        return self.runner.hf_config

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def submit(self, plan: StepPlan) -> object:
        return self.runner.launch(plan)

    def collect(self, handle: object) -> StepResult:
        if not isinstance(handle, StepHandle):
            raise TypeError(f"collect() got {type(handle).__name__}, not a handle of this executor's submit()")
        return self.runner.finish(handle)

    def shutdown(self) -> None:
        self.runner.flush()
        self.runner.requests.clear()
