"""The engine: request state machine, scheduler, KV block pool and prefix cache. Pure Python, no torch.

Public API: EngineCore (the loop), EngineConfig (its settings), RequestDelta / TokenLogprob (what a step
reports), SamplingParams, the StepPlan protocol (step.py) that executors implement, and the errors callers
handle (QueueFull, IllegalTransition).
"""
from __future__ import annotations

from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore, EngineStats
from appliance.engine.delta import RequestDelta, TokenLogprob
from appliance.engine.request import FinishReason, IllegalTransition, RequestStatus
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import QueueFull
from appliance.engine.step import Executor, StepPlan, StepResult

__all__ = [
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "Executor",
    "FinishReason",
    "IllegalTransition",
    "QueueFull",
    "RequestDelta",
    "RequestStatus",
    "SamplingParams",
    "StepPlan",
    "StepResult",
    "TokenLogprob",
]
