"""Every message that crosses a process boundary of the pipeline, and the codecs that carry them.

Sockets (all `ipc://` paths in a private directory the supervisor creates, see `addresses.py`):
  control   children -> supervisor   StageReady, StageFailed, StageProgress (start-up phases of a worker)
  frontend  supervisor -> tokenizer  PipelineState (failed / draining), so in-flight requests end with an error
  progress  supervisor -> tokenizer  StartupProgress (PUB/SUB, until the tokenizer's turn): /health's 503 body
  requests  tokenizer -> scheduler   GenerateRequest, AbortRequest, StatsQuery
  outputs   scheduler -> tokenizer   OutputBatch, StatsReply, StatsSnapshot (observability, ~1/s)
  plans     scheduler -> worker i    StepPlan (engine/step.py)
  results   workers -> scheduler     StepResult, WorkerError
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.engine.step import StepPlan, StepResult
from appliance.observability.stats import StatsSnapshot
from appliance.runtime.wire import Codec
from appliance.server.engine_client import RequestOutput


@dataclass(frozen=True)
class StageReady:
    stage: str  # "worker0", "scheduler", "tokenizer"
    pid: int
    info: dict[str, Any] = field(default_factory=dict)  # what later stages need (e.g. num KV blocks)


@dataclass(frozen=True)
class StageFailed:
    stage: str
    message: str


@dataclass(frozen=True)
class StageProgress:
    """A stage entered a start-up phase or finished one more of its items (executor/startup.py Progress)."""
    stage: str
    pid: int
    phase: str
    done: int = 0
    total: int = 0
    elapsed_s: float = 0.0  # since the stage was spawned

    def describe(self) -> str:
        count = f" {self.done}/{self.total}" if self.total else ""
        return f"{self.stage}: {self.phase}{count} ({self.elapsed_s:.1f} s)"


@dataclass(frozen=True)
class StartupProgress:
    """The latest phase of every stage that reported one, for the HTTP process' answers while it starts."""
    stages: list[StageProgress]
    elapsed_s: float = 0.0  # since the supervisor started the pipeline


@dataclass(frozen=True)
class PipelineState:
    state: str  # "failed" or "draining"
    message: str = ""


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams.to_dict(), with n == 1 (the server fans n out)
    arrival_time: float = 0.0


@dataclass(frozen=True)
class AbortRequest:
    request_ids: list[str]


@dataclass(frozen=True)
class StatsQuery:
    query_id: int


@dataclass(frozen=True)
class StatsReply:
    query_id: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class OutputBatch:
    outputs: list[RequestOutput]
    num_running: int = 0
    num_waiting: int = 0


@dataclass(frozen=True)
class WorkerError:
    step_id: int
    rank: int
    message: str


CONTROL_CODEC = Codec(StageReady, StageFailed, StageProgress)
PROGRESS_CODEC = Codec(StartupProgress)
FRONTEND_CODEC = Codec(PipelineState)
REQUEST_CODEC = Codec(GenerateRequest, AbortRequest, StatsQuery)
OUTPUT_CODEC = Codec(OutputBatch, StatsReply, StatsSnapshot)
PLAN_CODEC = Codec(StepPlan)
RESULT_CODEC = Codec(StepResult, WorkerError)
