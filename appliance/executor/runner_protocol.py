"""The ModelRunner protocol: what the code around a worker's runner uses of it (runtime/worker_proc.py StepLoop and
its ready report, executor/in_process.py, the logits processors). executor/model_runner.ModelRunner implements it;
tests pass small stand-ins. Typed here, so the runtime names no concrete runner class."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from appliance.config.schema import ApplianceConfig
    from appliance.engine.step import StepPlan, StepResult
    from appliance.executor.batch_sampler import BatchSampler
    from appliance.executor.inflight import StepHandle
    from appliance.executor.logits_processors import LogitsProcessors
    from appliance.executor.request_table import LiveRequests


class ModelRunnerProtocol(Protocol):
    config: ApplianceConfig
    device: torch.device
    hf_config: PretrainedConfig
    block_size: int
    max_model_len: int
    num_blocks: int  # KV cache blocks this runner holds
    eos_token_ids: list[int]
    requests: LiveRequests  # the live requests' worker-side state
    batch_sampler: BatchSampler
    logits_processors: LogitsProcessors | None  # made on the first request that needs one (logits_processors.py)

    def launch(self, plan: StepPlan) -> StepHandle:
        """Start a step; its result may stay on the device until finish()."""
        ...

    def finish(self, handle: StepHandle) -> StepResult:
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """launch + finish."""
        ...

    def flush(self) -> None:
        """Finish every step in flight."""
        ...
