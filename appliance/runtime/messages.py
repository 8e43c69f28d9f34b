"""Every message that crosses a process boundary of the pipeline, and the codecs that carry them.

Sockets (all `ipc://` paths in a private directory the supervisor creates, see `addresses.py`):
  control   children -> supervisor   StageReady, StageFailed
  frontend  supervisor -> tokenizer  PipelineState (failed / draining), so in-flight requests end with an error
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
    dump_stacks: bool = False  # a hang (runtime/watchdog.py): every stage logs its Python stacks first


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
    seq: int = 0  # the tokenizer process' count of requests sent, this one included (its queue estimate)


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
    num_received: int = 0  # the highest GenerateRequest.seq the scheduler has taken in (the queue estimate's baseline)


@dataclass(frozen=True)
class WorkerError:
    step_id: int
    rank: int
    message: str


CONTROL_CODEC = Codec(StageReady, StageFailed)
FRONTEND_CODEC = Codec(PipelineState)
REQUEST_CODEC = Codec(GenerateRequest, AbortRequest, StatsQuery)
OUTPUT_CODEC = Codec(OutputBatch, StatsReply, StatsSnapshot)
PLAN_CODEC = Codec(StepPlan)
RESULT_CODEC = Codec(StepResult, WorkerError)
